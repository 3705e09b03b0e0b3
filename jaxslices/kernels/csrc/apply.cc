// Add a sparse update, given as a recipe (common.h), to a table in place:
// table[ids[s]] += scale * weight[s] * src[bag[s]] for each slot with an id in
// [0, V). With kSumDuplicates the slots of one id are summed first (in order
// of appearance) and each distinct row is written once.
#include "common.h"

namespace jaxslices {

template <typename Id>
static void Apply(const Recipe<Id>& r, float* table, int64_t num_rows,
                  bool sum_duplicates, bool coalesced) {
  const int64_t R = r.row;
  if (!sum_duplicates || coalesced) {
    auto rows_of = r.cursor();
    for (int64_t s = 0; s < r.num_slots; ++s) {
      const float* x = rows_of.next();
      if (s + kPrefetch < r.num_slots) {
        Id ahead = r.ids[s + kPrefetch];
        if (ahead >= 0 && ahead < num_rows) {
          PrefetchRow(table + static_cast<int64_t>(ahead) * R, R, true);
        }
      }
      Id id = r.ids[s];
      if (id < 0 || id >= num_rows) continue;
      if (!x) continue;
      Axpy(table + static_cast<int64_t>(id) * R, x, r.factor(s), R, false);
    }
    return;
  }
  std::vector<float>& acc = ThreadScratch<float, kApplyRows>();
  std::vector<Id>& uids = ThreadScratch<Id, kApplyIds>();
  if (static_cast<int64_t>(acc.size()) < r.num_slots * R) acc.resize(r.num_slots * R);
  if (static_cast<int64_t>(uids.size()) < r.num_slots) uids.resize(r.num_slots);
  int64_t total = 0;
  Id* u = uids.data();
  float* rows = acc.data();
  // Each id's summed row is added to the table as soon as it is complete.
  auto add_row = [&](int64_t j) {
    if (j + kPrefetch < total) {
      PrefetchRow(table + static_cast<int64_t>(u[j + kPrefetch]) * R, R, true);
    }
    float* t = table + static_cast<int64_t>(u[j]) * R;
    const float* a = rows + j * R;
    for (int64_t k = 0; k < R; ++k) t[k] += a[k];
  };
  Coalesce(r, num_rows, false, r.num_slots, rows, u, &total, add_row);
}

static ffi::Error ApplyImpl(ffi::AnyBuffer table, ffi::AnyBuffer src,
                            ffi::AnyBuffer ids, ffi::AnyBuffer bag,
                            ffi::AnyBuffer weight, ffi::AnyBuffer scale,
                            ffi::Result<ffi::AnyBuffer> out, int64_t flags,
                            int64_t length) {
  if (auto e = CheckF32(table, "table"); !e.success()) return e;
  if (auto e = CheckF32(src, "update rows"); !e.success()) return e;
  if (table.untyped_data() != out->untyped_data()) {
    std::memcpy(out->untyped_data(), table.untyped_data(), table.size_bytes());
  }
  int64_t num_rows = Leading(table);
  int64_t row = RowSize(table);
  float scale_v = F32(scale)[0];
  const int32_t* bag_p =
      (flags & kHasBag) ? reinterpret_cast<const int32_t*>(bag.untyped_data())
                        : nullptr;
  const float* w = (flags & kHasWeight) ? F32(weight) : nullptr;
  bool sum_dup = flags & kSumDuplicates;
  bool coalesced = flags & kCoalesced;
  switch (ids.element_type()) {
    case ffi::DataType::S32: {
      Recipe<int32_t> r{F32(src), IdData<int32_t>(ids), bag_p, length, w, scale_v,
                        static_cast<int64_t>(ids.element_count()), Leading(src),
                        row};
      Apply(r, F32(out), num_rows, sum_dup, coalesced);
      break;
    }
    case ffi::DataType::S64: {
      Recipe<int64_t> r{F32(src), IdData<int64_t>(ids), bag_p, length, w, scale_v,
                        static_cast<int64_t>(ids.element_count()), Leading(src),
                        row};
      Apply(r, F32(out), num_rows, sum_dup, coalesced);
      break;
    }
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "jaxslices apply kernel: ids must be int32 or int64");
  }
  return ffi::Error::Success();
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesApply, jaxslices::ApplyImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // table
                                  .Arg<xla::ffi::AnyBuffer>()  // src
                                  .Arg<xla::ffi::AnyBuffer>()  // ids
                                  .Arg<xla::ffi::AnyBuffer>()  // bag
                                  .Arg<xla::ffi::AnyBuffer>()  // weight
                                  .Arg<xla::ffi::AnyBuffer>()  // scale
                                  .Ret<xla::ffi::AnyBuffer>()  // table (alias)
                                  .Attr<int64_t>("flags")
                                  .Attr<int64_t>("length"));
