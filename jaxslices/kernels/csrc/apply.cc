// Add a sparse update, given as a recipe (common.h), to a table in place:
// table[ids[s]] += scale * weight[s] * src[bag[s]] for each slot with an id in
// [0, V). With kSumDuplicates the slots of one id are summed first (in order
// of appearance) and each distinct row is written once.
#include "common.h"

namespace jaxslices {

template <typename IdT>
static void Apply(const Recipe<IdT>& r, float* table, int64_t num_rows,
                  bool sum_duplicates, bool coalesced) {
  const int64_t R = r.row;
  if (!sum_duplicates || coalesced) {
    auto rows_of = r.cursor();
    for (int64_t s = 0; s < r.num_slots; ++s) {
      const float* x = rows_of.next();
      if (s + kPrefetch < r.num_slots) {
        IdT ahead = r.ids[s + kPrefetch];
        if (ahead >= 0 && ahead < num_rows) {
          PrefetchRow(table + static_cast<int64_t>(ahead) * R, R, true);
        }
      }
      IdT id = r.ids[s];
      if (id < 0 || id >= num_rows) continue;
      if (!x) continue;
      Axpy(table + static_cast<int64_t>(id) * R, x, r.factor(s), R, false);
    }
    return;
  }
  std::vector<float>& acc = ThreadScratch<float, kApplyRows>();
  std::vector<IdT>& uids = ThreadScratch<IdT, kApplyIds>();
  if (static_cast<int64_t>(acc.size()) < r.num_slots * R) acc.resize(r.num_slots * R);
  if (static_cast<int64_t>(uids.size()) < r.num_slots) uids.resize(r.num_slots);
  int64_t total = 0;
  IdT* u = uids.data();
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

template <ffi::DataType kId>
static ffi::Error ApplyImpl(ffi::Buffer<ffi::F32> table, F32Rows src,
                            IdVector<kId> ids, BagVector bag, F32Vector weight,
                            ffi::BufferR0<ffi::F32> scale,
                            ffi::Result<ffi::Buffer<ffi::F32>> out,
                            bool has_bag, bool has_weight, bool coalesced,
                            bool sum_duplicates, int64_t length) {
  constexpr const char* kKernel = "apply";
  const int64_t row = RowWidth(table);
  if (src.dimensions()[1] != row) {
    return Invalid(kKernel, "update rows of " + Str(src.dimensions()[1]) +
                                " floats for table rows of " + Str(row));
  }
  Recipe<IdOf<kId>> r{};
  if (auto e = MakeRecipe(kKernel, src, ids, bag, weight, *scale.typed_data(),
                          has_bag, has_weight, length, &r);
      !e.success()) {
    return e;
  }
  Apply(r, InPlace(table, out), NumRows(table), sum_duplicates, coalesced);
  return ffi::Error::Success();
}

template <ffi::DataType kId>
static auto ApplyBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()  // table [V, *row]
      .Arg<F32Rows>()                // src [M, R]
      .Arg<IdVector<kId>>()          // ids [N]
      .template Arg<BagVector>()              // bag [N] or []
      .template Arg<F32Vector>()              // weight [N] or []
      .template Arg<ffi::BufferR0<ffi::F32>>()  // scale
      .template Ret<ffi::Buffer<ffi::F32>>()  // table (aliased)
      .template Attr<bool>("has_bag")
      .template Attr<bool>("has_weight")
      .template Attr<bool>("coalesced")
      .template Attr<bool>("sum_duplicates")
      .template Attr<int64_t>("length");
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesApplyS32,
                              jaxslices::ApplyImpl<xla::ffi::S32>,
                              jaxslices::ApplyBinding<xla::ffi::S32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesApplyS64,
                              jaxslices::ApplyImpl<xla::ffi::S64>,
                              jaxslices::ApplyBinding<xla::ffi::S64>());
