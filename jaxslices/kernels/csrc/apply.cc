// Add a sparse update, given as a recipe (common.h), to a table in place:
// table[ids[s]] += scale * weight[s] * src[bag[s]] for each slot with an id in
// [0, V). With kSumDuplicates the slots of one id are summed first (in order
// of appearance) and each distinct row is written once.
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

template <typename IdT>
static void Apply(const Recipe<IdT>& r, float* table, int64_t num_rows,
                  bool sum_duplicates, bool coalesced, const Threads& t) {
  const int64_t R = r.row;
  if (!sum_duplicates || coalesced) return AddInTurn(r, table, num_rows, coalesced, t);
  std::vector<float>& acc = ThreadScratch<float, kApplyRows>();
  std::vector<IdT>& uids = ThreadScratch<IdT, kApplyIds>();
  if (static_cast<int64_t>(acc.size()) < r.num_slots * R) acc.resize(r.num_slots * R);
  if (static_cast<int64_t>(uids.size()) < r.num_slots) uids.resize(r.num_slots);
  int64_t total = 0;
  IdT* u = uids.data();
  float* rows = acc.data();
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

template <ffi::DataType kId>
static ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, F32Rows src,
                            IdVector<kId> ids, BagVector bag, F32Vector weight,
                            ffi::BufferR0<ffi::F32> scale,
                            ffi::Result<ffi::Buffer<ffi::F32>> out,
                            bool has_bag, bool has_weight, bool coalesced,
                            bool sum_duplicates, int64_t length,
                            int64_t threads, int64_t min_slots) {
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
  Apply(r, InPlace(table, out), NumRows(table), sum_duplicates, coalesced,
        Threads{&pool, threads, min_slots});
  return ffi::Error::Success();
}

template <ffi::DataType kId>
static auto ApplyBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
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
