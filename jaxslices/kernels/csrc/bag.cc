// Forward embedding bag: out[b] = scale[b] * sum over the bag's slots s of
// weight[s] * table[ids[s]]; a slot whose id is outside [0, V) adds nothing.
// Bags are either padded (slot s belongs to bag s / L) or given per slot
// (bag[s]; a slot with bag[s] outside [0, B) is unused).
#include "common.h"

namespace jaxslices {

template <typename Id>
static void BagForward(const float* table, int64_t num_rows, int64_t row,
                       const Id* ids, const int32_t* bag, const float* weight,
                       const float* scale, int64_t num_slots, int64_t num_bags,
                       int64_t length, float* out) {
  if (length > 0) {  // padded: each bag's slots are contiguous
    for (int64_t b = 0; b < num_bags; ++b) {
      float* o = out + b * row;
      bool first = true;
      for (int64_t j = 0; j < length; ++j) {
        int64_t s = b * length + j;
        if (s + kPrefetch < num_slots) {
          Id ahead = ids[s + kPrefetch];
          if (ahead >= 0 && ahead < num_rows) {
            PrefetchRow(table + static_cast<int64_t>(ahead) * row, row, false);
          }
        }
        Id id = ids[s];
        if (id < 0 || id >= num_rows) continue;
        float w = weight ? weight[s] : 1.0f;
        Axpy(o, table + static_cast<int64_t>(id) * row, w, row, first);
        first = false;
      }
      if (first) {
        std::memset(o, 0, sizeof(float) * row);
        continue;
      }
      if (!scale) continue;
      float f = scale[b];
      for (int64_t k = 0; k < row; ++k) o[k] *= f;
    }
    return;
  }
  std::memset(out, 0, sizeof(float) * num_bags * row);
  for (int64_t s = 0; s < num_slots; ++s) {
    if (s + kPrefetch < num_slots) {
      Id ahead = ids[s + kPrefetch];
      if (ahead >= 0 && ahead < num_rows) {
        PrefetchRow(table + static_cast<int64_t>(ahead) * row, row, false);
      }
    }
    int64_t b = bag[s];
    if (b < 0 || b >= num_bags) continue;
    Id id = ids[s];
    if (id < 0 || id >= num_rows) continue;
    float w = weight ? weight[s] : 1.0f;
    Axpy(out + b * row, table + static_cast<int64_t>(id) * row, w, row, false);
  }
  if (!scale) return;
  for (int64_t b = 0; b < num_bags; ++b) {
    float f = scale[b];
    float* o = out + b * row;
    for (int64_t k = 0; k < row; ++k) o[k] *= f;
  }
}

static ffi::Error BagForwardImpl(ffi::AnyBuffer table, ffi::AnyBuffer ids,
                                 ffi::AnyBuffer bag, ffi::AnyBuffer weight,
                                 ffi::AnyBuffer scale,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 int64_t flags, int64_t length) {
  if (auto e = CheckF32(table, "table"); !e.success()) return e;
  int64_t num_rows = Leading(table);
  int64_t row = RowSize(table);
  int64_t num_slots = ids.element_count();
  int64_t num_bags = Leading(*out);
  const int32_t* bag_p =
      (flags & kHasBag) ? reinterpret_cast<const int32_t*>(bag.untyped_data())
                        : nullptr;
  const float* w = (flags & kHasWeight) ? F32(weight) : nullptr;
  const float* scale_p = (flags & kHasScale) ? F32(scale) : nullptr;
  if (length <= 0 && !bag_p) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxslices bag kernel: jagged bags need a bag array");
  }
  switch (ids.element_type()) {
    case ffi::DataType::S32:
      BagForward(F32(table), num_rows, row, IdData<int32_t>(ids), bag_p, w,
                 scale_p, num_slots, num_bags, length, F32(out));
      break;
    case ffi::DataType::S64:
      BagForward(F32(table), num_rows, row, IdData<int64_t>(ids), bag_p, w,
                 scale_p, num_slots, num_bags, length, F32(out));
      break;
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "jaxslices bag kernel: ids must be int32 or int64");
  }
  return ffi::Error::Success();
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesBagForward, jaxslices::BagForwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // table
                                  .Arg<xla::ffi::AnyBuffer>()  // ids
                                  .Arg<xla::ffi::AnyBuffer>()  // bag
                                  .Arg<xla::ffi::AnyBuffer>()  // weight
                                  .Arg<xla::ffi::AnyBuffer>()  // scale
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Attr<int64_t>("flags")
                                  .Attr<int64_t>("length"));
