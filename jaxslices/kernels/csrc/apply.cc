// Add a sparse update, given as a recipe (common.h), to a table in place:
// table[ids[s]] += scale * weight[s] * src[bag[s]] for each slot with an id in
// [0, V). With kSumDuplicates the slots of one id are summed first (in order
// of appearance) and each distinct row is written once.
//
// A bfloat16 or float16 table: the slots of one id are always summed first
// (in float32, in slot order, as the float32 kernel with kSumDuplicates),
// added to the row read in float32, and the row written back rounded once
// (common.h's RoundInto: to nearest, or stochastically with the seed).
#include "common.h"

namespace jaxslices {

// One slot's row added to the table (a slot whose source row or id is out
// of range adds nothing).
template <typename IdT>
static inline void AddSlot(const Recipe<IdT>& r, float* table, int64_t num_rows,
                           int64_t s, const float* x) {
  IdT id = r.ids[s];
  if (id < 0 || id >= num_rows || !x) return;
  Axpy(table + static_cast<int64_t>(id) * r.row, x, r.factor(s), r.row, false);
}

template <typename IdT>
static inline void PrefetchTableRow(const Recipe<IdT>& r, const float* table,
                                    int64_t num_rows, int64_t s) {
  IdT ahead = r.ids[s];
  if (ahead >= 0 && ahead < num_rows) {
    PrefetchRow(table + static_cast<int64_t>(ahead) * r.row, r.row, true);
  }
}

// Each slot's row added in turn; on several threads each partition adds the
// slots of the rows it owns, in slot order (coalesced: the ids are
// distinct, so any split of the slots will do).
template <typename IdT>
static void AddInTurn(const Recipe<IdT>& r, float* table, int64_t num_rows,
                      bool coalesced, const Threads& t) {
  const int64_t n = r.num_slots, threads = t.For(n);
  if (threads <= 1 || coalesced) {
    const int64_t units = UnitsFor(threads, n);
    ParallelFor(t, threads, units, [&](int64_t u) {
      const int64_t lo = UnitBegin(u, units, n), hi = UnitBegin(u + 1, units, n);
      auto rows_of = r.cursor_at(lo);
      for (int64_t s = lo; s < hi; ++s) {
        if (s + kPrefetch < hi) PrefetchTableRow(r, table, num_rows, s + kPrefetch);
        AddSlot(r, table, num_rows, s, rows_of.next());
      }
    });
    return;
  }
  std::vector<int32_t>& scratch = ThreadScratch<int32_t, kParts>();
  const int64_t parts = UnitsFor(threads, n);
  if (static_cast<int64_t>(scratch.size()) < BucketsSize(n, parts)) {
    scratch.resize(BucketsSize(n, parts));
  }
  Buckets b = Bucket(r, num_rows, parts, scratch.data());
  ParallelFor(t, threads, parts, [&](int64_t p) {
    const int64_t lo = b.begin(p), hi = b.end[p];
    for (int64_t q = lo; q < hi; ++q) {
      if (q + kPrefetch < hi) PrefetchTableRow(r, table, num_rows, b.by_part[q + kPrefetch]);
      int32_t s = b.by_part[q];
      int32_t i = b.src_row[s];
      AddSlot(r, table, num_rows, s, i < 0 ? nullptr : r.src + static_cast<int64_t>(i) * r.row);
    }
  });
}

// The calling thread's scratch for summing a recipe's duplicates: room for
// num_slots summed rows (float32) and their distinct ids, kept and grown
// across calls.
template <typename IdT>
struct SumScratch {
  float* rows;
  IdT* ids;
};

template <typename IdT>
static SumScratch<IdT> SumScratchFor(const Recipe<IdT>& r) {
  std::vector<float>& acc = ThreadScratch<float, kApplyRows>();
  std::vector<IdT>& uids = ThreadScratch<IdT, kApplyIds>();
  const int64_t n = r.num_slots;
  if (static_cast<int64_t>(acc.size()) < n * r.row) acc.resize(n * r.row);
  if (static_cast<int64_t>(uids.size()) < n) uids.resize(n);
  return {acc.data(), uids.data()};
}

template <typename IdT>
static void Apply(const Recipe<IdT>& r, float* table, int64_t num_rows,
                  bool sum_duplicates, bool coalesced, const Threads& t) {
  const int64_t R = r.row;
  if (!sum_duplicates || coalesced) return AddInTurn(r, table, num_rows, coalesced, t);
  const SumScratch<IdT> scratch = SumScratchFor(r);
  int64_t total = 0;
  IdT* u = scratch.ids;
  float* rows = scratch.rows;
  // Each id's summed row is added to the table as soon as it is complete.
  auto add_row = [&](int64_t j) {
    float* row = table + static_cast<int64_t>(u[j]) * R;
    const float* a = rows + j * R;
    for (int64_t k = 0; k < R; ++k) row[k] += a[k];
  };
  auto ahead = [&](int64_t j) {
    PrefetchRow(table + static_cast<int64_t>(u[j]) * R, R, true);
  };
  Coalesce(
      r, num_rows, false, r.num_slots, rows, u, &total,
      [&](int64_t j) {
        if (j + kPrefetch < total) ahead(j + kPrefetch);
        add_row(j);
      },
      &t, t.For(r.num_slots));
}

// Where the rounding noise reads a table row: origin = [base, first_0,
// coord_0, first_1, coord_1, ...] maps row id to its coordinate
// g - first_k + coord_k, g = id + base, k the last segment with first_k <= g
// (the identity: [0, 0, 0]). A sharded buffer's rows map to those of the
// collection's buffer it shards, so a plan rounds as one device does.
template <typename IdT>
struct Origin {
  const IdT* v;
  int64_t segments;
  int64_t operator()(int64_t id) const {
    const int64_t g = id + static_cast<int64_t>(v[0]);
    int64_t lo = 0, hi = segments;  // the last k with first_k <= g
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (static_cast<int64_t>(v[1 + 2 * mid]) <= g) lo = mid;
      else hi = mid;
    }
    return g - static_cast<int64_t>(v[1 + 2 * lo]) + static_cast<int64_t>(v[2 + 2 * lo]);
  }
};

// A low-precision table: each distinct id's summed row added in float32 and
// the row rounded once (stochastically: the noise of the seed, the row's
// coordinate, the column and the float32 result's bits, common.h's
// EntryNoise).
template <typename T, typename IdT>
static void ApplyRounded(const Recipe<IdT>& r, T* table, int64_t num_rows,
                         bool coalesced, bool stochastic, uint32_t seed,
                         const Origin<IdT>& origin, const Threads& t) {
  const int64_t R = r.row;
  const SumScratch<IdT> scratch = SumScratchFor(r);
  int64_t total = 0;
  IdT* u = scratch.ids;
  float* rows = scratch.rows;
  const uint32_t seed_mixed = Mix32(seed);
  auto add_row = [&](int64_t j) {
    const int64_t id = static_cast<int64_t>(u[j]);
    T* row = table + id * R;
    const float* a = rows + j * R;
    AddRoundRow(row, a, R, stochastic, RowNoise(seed_mixed, origin(id)));
  };
  const int64_t threads = t.For(r.num_slots);
  if (coalesced) {  // distinct ids: each slot's row added and rounded in turn
    const int64_t n = r.num_slots, units = UnitsFor(threads, n);
    ParallelFor(t, threads, units, [&](int64_t unit) {
      const int64_t lo = UnitBegin(unit, units, n), hi = UnitBegin(unit + 1, units, n);
      auto rows_of = r.cursor_at(lo);
      std::vector<float> a(R);
      for (int64_t s = lo; s < hi; ++s) {
        if (s + kPrefetch < hi) {
          const IdT ahead = r.ids[s + kPrefetch];
          if (ahead >= 0 && ahead < num_rows) {
            PrefetchRow(table + static_cast<int64_t>(ahead) * R, R, true);
          }
        }
        const float* x = rows_of.next();
        const IdT id = r.ids[s];
        if (id < 0 || id >= num_rows) continue;
        if (x) Axpy(a.data(), x, r.factor(s), R, true);
        else std::fill(a.begin(), a.end(), 0.0f);
        AddRoundRow(table + static_cast<int64_t>(id) * R, a.data(), R, stochastic,
                    RowNoise(seed_mixed, origin(id)));
      }
    });
    return;
  }
  Coalesce(
      r, num_rows, false, r.num_slots, rows, u, &total,
      [&](int64_t j) {
        if (j + kPrefetch < total) {
          PrefetchRow(table + static_cast<int64_t>(u[j + kPrefetch]) * R, R, true);
        }
        add_row(j);
      },
      &t, threads);
}

template <ffi::DataType kId>
static ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, F32Rows src,
                            IdVector<kId> ids, BagVector bag, F32Vector weight,
                            ffi::BufferR0<ffi::F32> scale,
                            ffi::BufferR0<ffi::U32> seed, IdVector<kId> origin,
                            ffi::Result<ffi::AnyBuffer> out,
                            bool has_bag, bool has_weight, bool coalesced,
                            bool sum_duplicates, bool stochastic, int64_t length,
                            int64_t threads, int64_t min_slots) {
  constexpr const char* kKernel = "apply";
  const int64_t row = RowWidth(table);
  if (src.dimensions()[1] != row) {
    return Invalid(kKernel, "update rows of " + Str(src.dimensions()[1]) +
                                " floats for table rows of " + Str(row));
  }
  if (out->element_type() != table.element_type()) {
    return Invalid(kKernel, "an output of another element type than the table's");
  }
  const int64_t origin_size = origin.dimensions()[0];
  if (origin_size < 3 || origin_size % 2 == 0) {
    return Invalid(kKernel, "a row origin of " + Str(origin_size) +
                                " ids (expected 1 + 2 * segments, segments >= 1)");
  }
  const Origin<IdOf<kId>> rows_at{origin.typed_data(), (origin_size - 1) / 2};
  Recipe<IdOf<kId>> r{};
  if (auto e = MakeRecipe(kKernel, src, ids, bag, weight, *scale.typed_data(),
                          has_bag, has_weight, length, &r);
      !e.success()) {
    return e;
  }
  const Threads t{&pool, threads, min_slots};
  return WithTableType(kKernel, table.element_type(), [&](auto tag) {
    using T = decltype(tag);
    T* data = InPlaceAny<T>(table, out);
    if constexpr (std::is_same_v<T, float>) {
      Apply(r, data, NumRows(table), sum_duplicates, coalesced, t);
    } else {
      ApplyRounded(r, data, NumRows(table), coalesced, stochastic,
                   *seed.typed_data(), rows_at, t);
    }
    return ffi::Error::Success();
  });
}

template <ffi::DataType kId>
static auto ApplyBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
      .Arg<ffi::AnyBuffer>()         // table [V, *row]: f32, bf16 or f16
      .Arg<F32Rows>()                // src [M, R]
      .Arg<IdVector<kId>>()          // ids [N]
      .template Arg<BagVector>()              // bag [N] or []
      .template Arg<F32Vector>()              // weight [N] or []
      .template Arg<ffi::BufferR0<ffi::F32>>()  // scale
      .template Arg<ffi::BufferR0<ffi::U32>>()  // seed (stochastic rounding)
      .template Arg<IdVector<kId>>()          // origin: where the noise reads a row
      .template Ret<ffi::AnyBuffer>()         // table (aliased)
      .template Attr<bool>("has_bag")
      .template Attr<bool>("has_weight")
      .template Attr<bool>("coalesced")
      .template Attr<bool>("sum_duplicates")
      .template Attr<bool>("stochastic")
      .template Attr<int64_t>("length")
      .template Attr<int64_t>("threads")
      .template Attr<int64_t>("min_slots");
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesApplyS32,
                              jaxslices::ApplyImpl<xla::ffi::S32>,
                              jaxslices::ApplyBinding<xla::ffi::S32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesApplyS64,
                              jaxslices::ApplyImpl<xla::ffi::S64>,
                              jaxslices::ApplyBinding<xla::ffi::S64>());
