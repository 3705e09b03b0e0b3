// Forward embedding bag: out[b] = scale[b] * sum over the bag's slots s of
// weight[s] * row(s), row(s) = table[ids[s]] for an id in [0, V) and a row of
// zeros otherwise (as the XLA path's gather with fill value 0: a slot that
// reads no row still adds 0 * weight[s], NaN for a NaN or infinite weight).
// Bags are padded (slot s belongs to bag s / L), given per slot (bag[s]; a
// slot with bag[s] outside [0, B) is unused), or, with no slots at all, all
// empty: zeros (times scale[b]).
#include "common.h"

namespace jaxslices {

// A slot that reads no row: o += w * 0, which is 0 unless w is NaN or inf
// (then NaN, as XLA's sum of a zero row times that weight).
static inline void AddZeroRow(float* o, float w, int64_t row) {
  if (std::isfinite(w)) return;
  for (int64_t k = 0; k < row; ++k) o[k] += w * 0.f;
}

template <typename IdT>
static void BagForward(const float* table, int64_t num_rows, int64_t row,
                       const IdT* ids, const int32_t* bag, const float* weight,
                       const float* scale, int64_t num_slots, int64_t num_bags,
                       int64_t length, float* out) {
  if (length > 0) {  // padded: each bag's slots are contiguous
    for (int64_t b = 0; b < num_bags; ++b) {
      float* o = out + b * row;
      bool first = true;
      for (int64_t j = 0; j < length; ++j) {
        int64_t s = b * length + j;
        if (s + kPrefetch < num_slots) {
          IdT ahead = ids[s + kPrefetch];
          if (ahead >= 0 && ahead < num_rows) {
            PrefetchRow(table + static_cast<int64_t>(ahead) * row, row, false);
          }
        }
        IdT id = ids[s];
        float w = weight ? weight[s] : 1.0f;
        if (id < 0 || id >= num_rows) {
          if (first) std::memset(o, 0, sizeof(float) * row);
          first = false;
          AddZeroRow(o, w, row);
          continue;
        }
        Axpy(o, table + static_cast<int64_t>(id) * row, w, row, first);
        first = false;
      }
      if (first) std::memset(o, 0, sizeof(float) * row);
      if (!scale) continue;
      float f = scale[b];
      for (int64_t k = 0; k < row; ++k) o[k] *= f;
    }
    return;
  }
  std::memset(out, 0, sizeof(float) * num_bags * row);
  for (int64_t s = 0; s < num_slots; ++s) {  // no slots: none without a bag
    if (s + kPrefetch < num_slots) {
      IdT ahead = ids[s + kPrefetch];
      if (ahead >= 0 && ahead < num_rows) {
        PrefetchRow(table + static_cast<int64_t>(ahead) * row, row, false);
      }
    }
    int64_t b = bag[s];
    if (b < 0 || b >= num_bags) continue;
    IdT id = ids[s];
    float w = weight ? weight[s] : 1.0f;
    if (id < 0 || id >= num_rows) {
      AddZeroRow(out + b * row, w, row);
      continue;
    }
    Axpy(out + b * row, table + static_cast<int64_t>(id) * row, w, row, false);
  }
  if (!scale) return;
  for (int64_t b = 0; b < num_bags; ++b) {
    float f = scale[b];
    float* o = out + b * row;
    for (int64_t k = 0; k < row; ++k) o[k] *= f;
  }
}

template <ffi::DataType kId>
static ffi::Error BagForwardImpl(ffi::Buffer<ffi::F32> table,
                                 IdVector<kId> ids, BagVector bag,
                                 F32Vector weight, F32Vector scale,
                                 ffi::Result<ffi::Buffer<ffi::F32>> out,
                                 bool has_bag, bool has_weight, bool has_scale,
                                 int64_t length) {
  constexpr const char* kKernel = "bag";
  const int64_t num_rows = NumRows(table), row = RowWidth(table);
  const int64_t num_slots = static_cast<int64_t>(ids.element_count());
  const int64_t num_bags = NumRows(*out);
  if (RowWidth(*out) != row) {
    return Invalid(kKernel, "output rows of " + Str(RowWidth(*out)) +
                                " floats for table rows of " + Str(row));
  }
  if (has_bag && static_cast<int64_t>(bag.element_count()) != num_slots) {
    return Invalid(kKernel, "the bag array has " + Str(bag.element_count()) +
                                " entries for " + Str(num_slots) + " ids");
  }
  if (!has_bag && num_slots != num_bags * length) {
    return Invalid(kKernel, Str(num_slots) + " ids for " + Str(num_bags) +
                                " padded bags of " + Str(length) + " slots");
  }
  if (has_weight && static_cast<int64_t>(weight.element_count()) != num_slots) {
    return Invalid(kKernel, "the weight array has " +
                                Str(weight.element_count()) + " entries for " +
                                Str(num_slots) + " ids");
  }
  if (has_scale && static_cast<int64_t>(scale.element_count()) != num_bags) {
    return Invalid(kKernel, "the scale array has " +
                                Str(scale.element_count()) + " entries for " +
                                Str(num_bags) + " bags");
  }
  BagForward(table.typed_data(), num_rows, row, ids.typed_data(),
             has_bag ? bag.typed_data() : nullptr,
             has_weight ? weight.typed_data() : nullptr,
             has_scale ? scale.typed_data() : nullptr, num_slots, num_bags,
             has_bag ? 0 : length, out->typed_data());
  return ffi::Error::Success();
}

template <ffi::DataType kId>
static auto BagForwardBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()  // table [V, *row]
      .Arg<IdVector<kId>>()          // ids [N]
      .template Arg<BagVector>()              // bag [N] or []
      .template Arg<F32Vector>()              // weight [N] or []
      .template Arg<F32Vector>()              // scale [B] or []
      .template Ret<ffi::Buffer<ffi::F32>>()  // out [B, *row]
      .template Attr<bool>("has_bag")
      .template Attr<bool>("has_weight")
      .template Attr<bool>("has_scale")
      .template Attr<int64_t>("length");
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxslicesBagForwardS32, jaxslices::BagForwardImpl<xla::ffi::S32>,
    jaxslices::BagForwardBinding<xla::ffi::S32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxslicesBagForwardS64, jaxslices::BagForwardImpl<xla::ffi::S64>,
    jaxslices::BagForwardBinding<xla::ffi::S64>());
