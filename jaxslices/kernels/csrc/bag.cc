// Forward embedding bag: out[b] = scale[b] * sum over the bag's slots s of
// weight[s] * row(s), row(s) = table[ids[s]] for an id in [0, V) and a row of
// zeros otherwise (as the XLA path's gather with fill value 0: a slot that
// reads no row still adds 0 * weight[s], NaN for a NaN or infinite weight).
// Bags are padded (slot s belongs to bag s / L), given per slot (bag[s]; a
// slot with bag[s] outside [0, B) is unused), or, with no slots at all, all
// empty: zeros (times scale[b]). A bfloat16 or float16 table is read in
// float32 and pooled in float32; the output (the table's type) is rounded
// once, to nearest.
#include <algorithm>

#include "common.h"

namespace jaxslices {

// A slot that reads no row: o += w * 0, which is 0 unless w is NaN or inf
// (then NaN, as XLA's sum of a zero row times that weight).
static inline void AddZeroRow(float* o, float w, int64_t row) {
  if (std::isfinite(w)) return;
  for (int64_t k = 0; k < row; ++k) o[k] += w * 0.f;
}

// Padded bags [b0, b1): each bag's slots are contiguous.
template <typename T, typename IdT>
static void PaddedBags(const T* table, int64_t num_rows, int64_t row,
                       const IdT* ids, const float* weight, const float* scale,
                       int64_t length, int64_t b0, int64_t b1, float* out) {
  const int64_t end = b1 * length;
  for (int64_t b = b0; b < b1; ++b) {
    float* o = out + b * row;
    bool first = true;
    for (int64_t j = 0; j < length; ++j) {
      int64_t s = b * length + j;
      if (s + kPrefetch < end) {
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
      AxpyFrom(o, table + static_cast<int64_t>(id) * row, w, row, first);
      first = false;
    }
    if (first) std::memset(o, 0, sizeof(float) * row);
    if (!scale) continue;
    float f = scale[b];
    for (int64_t k = 0; k < row; ++k) o[k] *= f;
  }
}

// Slots [s0, s1) of bags given per slot, added into `out` (zeroed).
template <typename T, typename IdT>
static void SlotBags(const T* table, int64_t num_rows, int64_t row,
                     const IdT* ids, const int32_t* bag, const float* weight,
                     int64_t num_bags, int64_t s0, int64_t s1, float* out) {
  for (int64_t s = s0; s < s1; ++s) {
    if (s + kPrefetch < s1) {
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
    AxpyFrom(out + b * row, table + static_cast<int64_t>(id) * row, w, row, false);
  }
}

// On several threads: padded bags split into ranges of bags; bags given per
// slot split into ranges of slots that start where a bag starts, when the
// bag array is sorted (as jagged ids' are), else one thread. Each bag's
// slots are summed in slot order by one thread, as without threads.
template <typename T, typename IdT>
static void BagForward(const T* table, int64_t num_rows, int64_t row,
                       const IdT* ids, const int32_t* bag, const float* weight,
                       const float* scale, int64_t num_slots, int64_t num_bags,
                       int64_t length, float* out, const Threads& t) {
  int64_t threads = t.For(num_slots);
  if (length > 0) {
    const int64_t units = UnitsFor(threads, num_bags);
    ParallelFor(t, threads, units, [&](int64_t u) {
      PaddedBags(table, num_rows, row, ids, weight, scale, length,
                 UnitBegin(u, units, num_bags), UnitBegin(u + 1, units, num_bags), out);
    });
    return;
  }
  std::memset(out, 0, sizeof(float) * num_bags * row);
  if (threads > 1 && !std::is_sorted(bag, bag + num_slots)) threads = 1;
  const int64_t units = UnitsFor(threads, num_slots);
  ParallelFor(t, threads, units, [&](int64_t u) {
    // A range starts at the first slot of a bag (never inside one).
    auto begin = [&](int64_t v) {
      int64_t s = UnitBegin(v, units, num_slots);
      while (s > 0 && s < num_slots && bag[s] == bag[s - 1]) ++s;
      return s;
    };
    SlotBags(table, num_rows, row, ids, bag, weight, num_bags, begin(u),
             begin(u + 1), out);
  });
  if (!scale) return;
  for (int64_t b = 0; b < num_bags; ++b) {
    float f = scale[b];
    float* o = out + b * row;
    for (int64_t k = 0; k < row; ++k) o[k] *= f;
  }
}

// The pooled rows in float32 (`pooled`), rounded into the output's type.
template <typename T>
static void RoundRows(const float* pooled, T* out, int64_t count,
                      const Threads& t, int64_t threads) {
  const int64_t units = UnitsFor(threads, count);
  ParallelFor(t, threads, units, [&](int64_t u) {
    for (int64_t i = UnitBegin(u, units, count); i < UnitBegin(u + 1, units, count); ++i) {
      RoundInto(out + i, pooled[i], false, 0);
    }
  });
}

template <ffi::DataType kId>
static ffi::Error BagForwardImpl(ffi::ThreadPool pool,
                                 ffi::AnyBuffer table,
                                 IdVector<kId> ids, BagVector bag,
                                 F32Vector weight, F32Vector scale,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 bool has_bag, bool has_weight, bool has_scale,
                                 int64_t length, int64_t threads,
                                 int64_t min_slots) {
  constexpr const char* kKernel = "bag";
  const int64_t num_rows = NumRows(table), row = RowWidth(table);
  const int64_t num_slots = static_cast<int64_t>(ids.element_count());
  const int64_t num_bags = NumRows(*out);
  if (RowWidth(*out) != row) {
    return Invalid(kKernel, "output rows of " + Str(RowWidth(*out)) +
                                " floats for table rows of " + Str(row));
  }
  if (out->element_type() != table.element_type()) {
    return Invalid(kKernel, "an output of another element type than the table's");
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
  const Threads t{&pool, threads, min_slots};
  return WithTableType(kKernel, table.element_type(), [&](auto tag) {
    using T = decltype(tag);
    float* pooled = static_cast<float*>(out->untyped_data());
    if constexpr (!std::is_same_v<T, float>) {  // pooled in float32 first
      std::vector<float>& rows = ThreadScratch<float, kBagRows>();
      if (static_cast<int64_t>(rows.size()) < num_bags * row) rows.resize(num_bags * row);
      pooled = rows.data();
    }
    BagForward(static_cast<const T*>(table.untyped_data()), num_rows, row,
               ids.typed_data(), has_bag ? bag.typed_data() : nullptr,
               has_weight ? weight.typed_data() : nullptr,
               has_scale ? scale.typed_data() : nullptr, num_slots, num_bags,
               has_bag ? 0 : length, pooled, t);
    if constexpr (!std::is_same_v<T, float>) {
      RoundRows(pooled, static_cast<T*>(out->untyped_data()), num_bags * row, t,
                t.For(num_slots));
    }
    return ffi::Error::Success();
  });
}

template <ffi::DataType kId>
static auto BagForwardBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
      .Arg<ffi::AnyBuffer>()         // table [V, *row]: f32, bf16 or f16
      .Arg<IdVector<kId>>()          // ids [N]
      .template Arg<BagVector>()              // bag [N] or []
      .template Arg<F32Vector>()              // weight [N] or []
      .template Arg<F32Vector>()              // scale [B] or []
      .template Ret<ffi::AnyBuffer>()         // out [B, *row], the table's type
      .template Attr<bool>("has_bag")
      .template Attr<bool>("has_weight")
      .template Attr<bool>("has_scale")
      .template Attr<int64_t>("length")
      .template Attr<int64_t>("threads")
      .template Attr<int64_t>("min_slots");
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxslicesBagForwardS32, jaxslices::BagForwardImpl<xla::ffi::S32>,
    jaxslices::BagForwardBinding<xla::ffi::S32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxslicesBagForwardS64, jaxslices::BagForwardImpl<xla::ffi::S64>,
    jaxslices::BagForwardBinding<xla::ffi::S64>());
