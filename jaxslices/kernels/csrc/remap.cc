// The managed-collision remap (jaxslices/managed/_reference.py) on the CPU: the
// same state, the same rules, the same bits as its XLA reference there.
//
// A raw id is a pair of uint32 words ordered by (low, high). The state keeps
// the tracked ids in two sorted copies, the main one (S entries) and a small
// one of recent admissions (K entries), each followed by zeros. Admission
// ("admit"): the batch is looked up by bisection in both copies, its distinct
// new ids are admitted in (low, high) order into the free slots (a stack),
// and merged into the small copy, which is merged into the main copy first
// when the batch might not fit in it (or, for a batch of more than K ids,
// they go to the main copy). Eviction ("evict"): the `need` occupied slots
// lowest by (first score, second score, slot), found from a sample's
// threshold and one pass over the slots, are freed; the small copy is
// compacted (O(K)) and the evicted ids' entries of the main copy are marked
// stale (slot S, their ids kept: the copy stays sorted) by a search each,
// not moved (lazy deletion): lookups skip them and the next merge into the
// main copy (a flush) drops them first.
// Every merge and compaction is in place: a donated state is never copied.
#include <algorithm>
#include <type_traits>

#include "common.h"

namespace jaxslices {

namespace {

constexpr int32_t kInt32Max = 0x7FFFFFFF;

using U32Vector = ffi::BufferR1<ffi::U32>;
using S32Vector = ffi::BufferR1<ffi::S32>;
using PredVector = ffi::BufferR1<ffi::PRED>;

inline bool Less(uint32_t al, uint32_t ah, uint32_t bl, uint32_t bh) {
  return al < bl || (al == bl && ah < bh);
}

inline int32_t SaturatingAdd(int32_t a, int64_t b) {
  int64_t s = static_cast<int64_t>(a) + b;
  return s > kInt32Max ? kInt32Max : static_cast<int32_t>(s);
}

// A sorted copy: ids (low, high words) and their slots; n entries in use.
struct Copy {
  uint32_t* hi;
  uint32_t* lo;
  int32_t* slots;
  int64_t size;

  // The first entry of [0, n) not below (l, h), for an id not below the
  // one placed at `from`: an exponential search forward from there, then a
  // bisection.
  int64_t Gallop(int64_t from, int64_t n, uint32_t l, uint32_t h) const {
    int64_t low = from, step = 1, high = from;
    while (high < n && Less(lo[high], hi[high], l, h)) {
      low = high + 1;
      high = from + step;
      step *= 2;
    }
    high = std::min(high, n);
    while (low < high) {
      int64_t mid = low + (high - low) / 2;
      if (Less(lo[mid], hi[mid], l, h)) {
        low = mid + 1;
      } else {
        high = mid;
      }
    }
    return low;
  }
  bool Hit(int64_t n, int64_t at, uint32_t l, uint32_t h) const {
    return at < n && lo[at] == l && hi[at] == h;
  }
  // A hit on a live entry (a stale one has slot `stale`).
  bool Live(int64_t n, int64_t at, uint32_t l, uint32_t h, int32_t stale) const {
    return Hit(n, at, l, h) && slots[at] != stale;
  }

  // Merge m sorted entries (l, h, s) into [0, n), in place from the back.
  void Merge(int64_t n, const uint32_t* l, const uint32_t* h, const int32_t* s,
             int64_t m) {
    int64_t i = n - 1, j = m - 1, w = n + m - 1;
    while (j >= 0) {
      if (i >= 0 && Less(l[j], h[j], lo[i], hi[i])) {
        lo[w] = lo[i], hi[w] = hi[i], slots[w] = slots[i];
        --i;
      } else {
        lo[w] = l[j], hi[w] = h[j], slots[w] = s[j];
        --j;
      }
      --w;
    }
  }

  // Keep the entries of [0, n) whose slot `keep` accepts, zeros after them.
  template <typename Keep>
  int64_t Compact(int64_t n, Keep keep) {
    int64_t w = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (!keep(slots[i])) continue;
      lo[w] = lo[i], hi[w] = hi[i], slots[w] = slots[i];
      ++w;
    }
    std::fill(lo + w, lo + n, 0u);
    std::fill(hi + w, hi + n, 0u);
    std::fill(slots + w, slots + n, 0);
    return w;
  }
};

// Scalars of the state, in the order of the wrappers' `scalars` operand.
enum Scalar {
  kNumFree = 0, kNumRecent, kStep, kAdmissions, kDefaulted, kEvictions, kNumStale, kScalars
};

struct NewId {
  uint32_t lo, hi;
  int32_t pos;
};

// Sort by (low, high, position): a stable LSD radix sort of the 64-bit key
// (low << 32 | high), 8 bits a pass; the input is in position order.
void RadixSort(std::vector<NewId>* items, std::vector<NewId>* spare) {
  const size_t n = items->size();
  if (n == 0) return;
  spare->resize(n);
  NewId* a = items->data();
  NewId* b = spare->data();
  for (int pass = 0; pass < 8; ++pass) {
    const int shift = (pass % 4) * 8;
    auto digit = [&](const NewId& x) { return ((pass < 4 ? x.hi : x.lo) >> shift) & 0xFF; };
    size_t count[257] = {0};
    for (size_t i = 0; i < n; ++i) ++count[digit(a[i]) + 1];
    if (count[digit(a[0]) + 1] == n) continue;  // one digit: nothing moves
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (size_t i = 0; i < n; ++i) b[count[digit(a[i])]++] = a[i];
    std::swap(a, b);
  }
  if (a != items->data()) std::memcpy(items->data(), a, n * sizeof(NewId));
}

// The remap's state: fifteen arrays and the scalars, in the order the Python
// side passes them and gets them back (jaxslices/managed/_ops.py:
// STATE_FIELDS, then `scalars`), each output aliasing its input. Bound here
// once for both kernels, sizes checked.
constexpr size_t kStateArrays = 16;

struct State {
  int64_t S, K;  // slots, entries of the recent copy
  uint32_t* ids_hi;
  uint32_t* ids_lo;
  bool* occupied;
  int32_t* counts;
  int32_t* last_seen;
  Copy main, recent;
  int32_t* free_slots;
  int64_t W;  // buckets of the admission filter (0: none)
  uint32_t* filter_hi;
  uint32_t* filter_lo;
  int32_t* filter_counts;
  int32_t* scalars;
};

// The state's arrays from the handler's remaining arguments and results.
ffi::Error BindState(const char* kernel, const ffi::RemainingArgs& in,
                     const ffi::RemainingRets& out, State* st) {
  if (in.size() != kStateArrays || out.size() != kStateArrays) {
    return Invalid(kernel, "a state of " + Str(in.size()) + " arrays and " +
                               Str(out.size()) + " results for " +
                               Str(kStateArrays));
  }
  auto size_of = [&](size_t i) {
    auto a = in.get<ffi::AnyBuffer>(i);
    return a.has_value() ? static_cast<int64_t>(a->element_count()) : int64_t{-1};
  };
  st->S = size_of(0), st->K = size_of(8), st->W = size_of(12);
  size_t i = 0;
  ffi::Error error = ffi::Error::Success();
  auto next = [&](auto** data, ffi::DataType dtype, int64_t size, const char* name) {
    using T = std::remove_pointer_t<std::remove_reference_t<decltype(*data)>>;
    const size_t at = i++;
    if (error.failure()) return;
    auto a = in.get<ffi::AnyBuffer>(at);
    auto r = out.get<ffi::AnyBuffer>(at);
    if (!a.has_value() || !r.has_value() || a->element_type() != dtype ||
        (*r)->element_type() != dtype || a->dimensions().size() != 1 ||
        static_cast<int64_t>(a->element_count()) != size ||
        (*r)->element_count() != a->element_count()) {
      error = Invalid(kernel, std::string("the state's ") + name +
                                  " is not a vector of " + Str(size) +
                                  " entries of its type");
      return;
    }
    *data = InPlaceAny<T>(*a, *r);
  };
  const int64_t S = st->S, K = st->K, W = st->W;
  next(&st->ids_hi, ffi::U32, S, "ids_hi");
  next(&st->ids_lo, ffi::U32, S, "ids_lo");
  next(&st->occupied, ffi::PRED, S, "occupied");
  next(&st->counts, ffi::S32, S, "counts");
  next(&st->last_seen, ffi::S32, S, "last_seen");
  next(&st->main.hi, ffi::U32, S, "sorted_hi");
  next(&st->main.lo, ffi::U32, S, "sorted_lo");
  next(&st->main.slots, ffi::S32, S, "sorted_slots");
  next(&st->recent.hi, ffi::U32, K, "recent_hi");
  next(&st->recent.lo, ffi::U32, K, "recent_lo");
  next(&st->recent.slots, ffi::S32, K, "recent_slots");
  next(&st->free_slots, ffi::S32, S, "free_slots");
  next(&st->filter_hi, ffi::U32, W, "filter_hi");
  next(&st->filter_lo, ffi::U32, W, "filter_lo");
  next(&st->filter_counts, ffi::S32, W, "filter_counts");
  next(&st->scalars, ffi::S32, kScalars, "scalars");
  st->main.size = S, st->recent.size = K;
  return error;
}

}  // namespace

// A raw id's hash (jaxslices/managed/_reference.py: id_hash) and its
// admission draw at a step (admission_draw).
inline uint32_t IdHash(uint32_t hi, uint32_t lo) { return Mix32(lo ^ Mix32(hi + 0x9E3779B9u)); }
inline uint32_t AdmissionDraw(uint32_t hash, int32_t step) {
  return Mix32(hash ^ Mix32(static_cast<uint32_t>(step) * 0x85EBCA6Bu + 0x7F4A7C15u));
}

// A lookup count last updated at step `last`, as of step `step`, when counts
// halve every `half_life` steps (_reference.decayed_counts).
inline int32_t Decayed(int32_t count, int32_t last, int32_t step, int64_t half_life) {
  const int64_t halvings = step / half_life - last / half_life;
  return count >> std::min<int64_t>(std::max<int64_t>(halvings, 0), 31);
}

static ffi::Error AdmitImpl(U32Vector hi, U32Vector lo, PredVector valid,
                            ffi::RemainingArgs state_in, ffi::Result<S32Vector> rows_out,
                            ffi::RemainingRets state_out, int64_t min_count,
                            int64_t threshold, int64_t half_life) {
  constexpr const char* kKernel = "managed admit";
  State st;
  if (ffi::Error e = BindState(kKernel, state_in, state_out, &st); e.failure()) return e;
  auto& [S, K, ih, il, occ, cnt, last, main, recent, stack, W, fh, fl, fc, sc] = st;
  const int64_t N = hi.element_count();
  if (lo.element_count() != N || valid.element_count() != N ||
      rows_out->element_count() != N) {
    return Invalid(kKernel, "ids of " + Str(N) + " high words, " +
                                Str(lo.element_count()) + " low words, " +
                                Str(valid.element_count()) + " mask entries");
  }
  int32_t* rows = rows_out->typed_data();
  const uint32_t* h = hi.typed_data();
  const uint32_t* l = lo.typed_data();
  const bool* ok = valid.typed_data();
  if (N == 0) return ffi::Error::Success();

  int64_t num_free = sc[kNumFree], num_recent = sc[kNumRecent], num_stale = sc[kNumStale];
  const int32_t step = sc[kStep];
  const int32_t stale = static_cast<int32_t>(S);  // a stale entry's slot
  const bool into_recent = N <= K;
  const bool full = into_recent ? num_recent + N > K : num_recent > 0 || num_stale > 0;
  if (full) {  // flush: the main copy without its stale entries, then the recent one into it
    if (num_stale > 0) {
      main.Compact(S - num_free - num_recent + num_stale,
                   [stale](int32_t s) { return s != stale; });
      num_stale = 0;
    }
    if (num_recent > 0) {
      main.Merge(S - num_free - num_recent, recent.lo, recent.hi, recent.slots, num_recent);
      std::fill(recent.lo, recent.lo + num_recent, 0u);
      std::fill(recent.hi, recent.hi + num_recent, 0u);
      std::fill(recent.slots, recent.slots + num_recent, 0);
      num_recent = 0;
    }
  }
  const int64_t n_main = S - num_free - num_recent + num_stale;  // stale entries included

  // The valid ids sorted by (low, high) word (a radix sort), then looked up
  // in turn: each search starts where the previous one ended (galloping), so
  // a batch walks each sorted copy once, forward.
  static thread_local std::vector<NewId> order, spare;
  order.clear();
  for (int64_t i = 0; i < N; ++i) {
    rows[i] = static_cast<int32_t>(S);
    if (ok[i]) order.push_back({l[i], h[i], static_cast<int32_t>(i)});
  }
  RadixSort(&order, &spare);
  int64_t from_main = 0, from_recent = 0;
  static thread_local std::vector<NewId> fresh;
  fresh.clear();
  for (const NewId& q : order) {
    from_main = main.Gallop(from_main, n_main, q.lo, q.hi);
    if (main.Live(n_main, from_main, q.lo, q.hi, stale)) {
      rows[q.pos] = main.slots[from_main];
      continue;
    }
    if (into_recent) {
      from_recent = recent.Gallop(from_recent, num_recent, q.lo, q.hi);
      if (recent.Hit(num_recent, from_recent, q.lo, q.hi)) {
        rows[q.pos] = recent.slots[from_recent];
        continue;
      }
    }
    fresh.push_back(q);  // in (low, high, position) order
  }
  // The admission filter (min_count > 1) and draw (threshold >= 0), over the
  // distinct new ids in (low, high) order: an id whose bucket holds it adds
  // its occurrences to the count, any other takes the bucket with them; an
  // id not admissible leaves `fresh` (the default serves it).
  const bool counting = min_count > 1 && W > 0;
  if (counting || threshold >= 0) {
    size_t w = 0;
    for (size_t q = 0; q < fresh.size();) {
      size_t end = q + 1;
      while (end < fresh.size() && fresh[end].lo == fresh[q].lo && fresh[end].hi == fresh[q].hi) {
        ++end;
      }
      const NewId f = fresh[q];
      const uint32_t hash = IdHash(f.hi, f.lo);
      bool admissible = true;
      if (counting) {
        const int64_t b = hash % static_cast<uint32_t>(W);
        const int64_t seen = static_cast<int64_t>(end - q);
        const bool held = fc[b] > 0 && fh[b] == f.hi && fl[b] == f.lo;
        const int32_t c = SaturatingAdd(held ? fc[b] : 0, seen);
        fh[b] = f.hi, fl[b] = f.lo, fc[b] = c;
        admissible = c >= min_count;
      }
      if (threshold >= 0) {
        admissible = admissible && AdmissionDraw(hash, step) < static_cast<uint32_t>(threshold);
      }
      if (admissible) {
        for (size_t k = q; k < end; ++k) fresh[w++] = fresh[k];
      }
      q = end;
    }
    fresh.resize(w);
  }
  // Admit the distinct new ids in (low, high) order while slots are free.
  static thread_local std::vector<uint32_t> add_lo, add_hi;
  static thread_local std::vector<int32_t> add_slot;
  add_lo.clear(), add_hi.clear(), add_slot.clear();
  int32_t slot = static_cast<int32_t>(S);
  for (size_t q = 0; q < fresh.size(); ++q) {
    const NewId& f = fresh[q];
    bool first = q == 0 || fresh[q - 1].lo != f.lo || fresh[q - 1].hi != f.hi;
    if (first) {
      int64_t rank = static_cast<int64_t>(add_slot.size());
      slot = static_cast<int32_t>(S);
      if (rank < num_free) {
        slot = stack[num_free - 1 - rank];
        add_lo.push_back(f.lo), add_hi.push_back(f.hi), add_slot.push_back(slot);
        ih[slot] = f.hi, il[slot] = f.lo, occ[slot] = true, cnt[slot] = 0;
        if (counting) {  // an admitted id leaves the filter
          const int64_t b = IdHash(f.hi, f.lo) % static_cast<uint32_t>(W);
          if (fc[b] > 0 && fh[b] == f.hi && fl[b] == f.lo) fh[b] = 0, fl[b] = 0, fc[b] = 0;
        }
      }
    }
    rows[f.pos] = slot;
  }
  const int64_t admitted = static_cast<int64_t>(add_slot.size());
  int64_t defaulted = 0;
  for (int64_t i = 0; i < N; ++i) {
    int32_t r = rows[i];
    if (r < S) {
      // decayed to this step at its first lookup of the batch
      if (half_life > 0 && last[r] != step) cnt[r] = Decayed(cnt[r], last[r], step, half_life);
      cnt[r] = SaturatingAdd(cnt[r], 1);
      last[r] = step;
    } else if (ok[i]) {
      ++defaulted;
    }
  }
  if (admitted > 0) {
    Copy& into = into_recent ? recent : main;
    into.Merge(into_recent ? num_recent : n_main, add_lo.data(), add_hi.data(),
               add_slot.data(), admitted);
  }
  sc[kNumFree] = static_cast<int32_t>(num_free - admitted);
  sc[kNumRecent] = static_cast<int32_t>(num_recent + (into_recent ? admitted : 0));
  sc[kNumStale] = static_cast<int32_t>(num_stale);
  sc[kAdmissions] = SaturatingAdd(sc[kAdmissions], admitted);
  sc[kDefaulted] = SaturatingAdd(sc[kDefaulted], defaulted);
  return ffi::Error::Success();
}

namespace {

// A slot's eviction key: (first score, second score, slot), all below 2**31,
// as one 128-bit integer: every key distinct, ordered as the policy orders.
using Key = unsigned __int128;
inline Key EvictionKey(int32_t first, int32_t then, int64_t slot) {
  return (static_cast<Key>(static_cast<uint32_t>(first)) << 62) |
         (static_cast<Key>(static_cast<uint32_t>(then)) << 31) | static_cast<Key>(slot);
}

// The `need` occupied slots of lowest key, in increasing slot order, into
// `out`. A threshold from a sample of the slots (about 16k keys) bounds the
// candidates; one pass collects the keys below it (about twice `need`), and
// a selection among them gives the exact answer (all keys if the sample's
// threshold was too low: never wrong, only slower).
void Lowest(const int32_t* first, const int32_t* then, const bool* occ, int64_t S,
            int64_t occupied, int64_t need, int32_t* out) {
  static thread_local std::vector<Key> sample, candidates;
  const Key all = ~static_cast<Key>(0);
  Key bound = all;
  if (need < occupied) {
    const int64_t stride = std::max<int64_t>(1, S / 16384);
    sample.clear();
    for (int64_t s = 0; s < S; s += stride) {
      if (occ[s]) sample.push_back(EvictionKey(first[s], then[s], s));
    }
    const double share = static_cast<double>(need) / static_cast<double>(occupied);
    const int64_t q = static_cast<int64_t>(1.5 * share * sample.size()) + 16;
    if (q < static_cast<int64_t>(sample.size())) {
      std::nth_element(sample.begin(), sample.begin() + q, sample.end());
      bound = sample[q];
    }
  }
  for (int pass = 0; pass < 2; ++pass) {
    candidates.clear();
    for (int64_t s = 0; s < S; ++s) {
      if (!occ[s]) continue;
      Key k = EvictionKey(first[s], then[s], s);
      if (k <= bound) candidates.push_back(k);
    }
    if (static_cast<int64_t>(candidates.size()) >= need) break;
    bound = all;  // the sample's threshold was too low: every key
  }
  std::nth_element(candidates.begin(), candidates.begin() + (need - 1), candidates.end());
  for (int64_t r = 0; r < need; ++r) {
    out[r] = static_cast<int32_t>(candidates[r] & 0x7FFFFFFF);
  }
  std::sort(out, out + need);
}

}  // namespace

static ffi::Error EvictImpl(ffi::RemainingArgs state_in, ffi::Result<S32Vector> evicted_out,
                            ffi::RemainingRets state_out, bool lfu, int64_t half_life,
                            int64_t ttl) {
  constexpr const char* kKernel = "managed evict";
  State st;
  if (ffi::Error e = BindState(kKernel, state_in, state_out, &st); e.failure()) return e;
  // eviction leaves the admission filter (W, fh, fl, fc) as it is
  [[maybe_unused]] auto& [S, K, ih, il, occ, cnt, last, main, recent, stack, W, fh, fl, fc,
                          sc] = st;
  const int64_t E = evicted_out->element_count();
  if (E > S) return Invalid(kKernel, Str(E) + " evicted slots for " + Str(S) + " slots");
  int32_t* evicted = evicted_out->typed_data();
  std::fill(evicted, evicted + E, static_cast<int32_t>(S));
  const int64_t num_free = sc[kNumFree], num_recent = sc[kNumRecent],
                num_stale = sc[kNumStale];
  int64_t need = std::max<int64_t>(E - num_free, 0);
  const int32_t step = sc[kStep];
  const int32_t* first = lfu ? cnt : last;
  const int32_t* then = lfu ? last : cnt;
  static thread_local std::vector<int32_t> decayed, ranked, ranked_then;
  if (half_life > 0) {  // a decayed LFU: the counts as of this step
    decayed.resize(S);
    for (int64_t s = 0; s < S; ++s) decayed[s] = Decayed(cnt[s], last[s], step, half_life);
    (lfu ? first : then) = decayed.data();
  }
  if (ttl > 0) {  // the expired ids first (least recent first), whatever the pressure
    ranked.resize(S), ranked_then.resize(S);
    int64_t expired = 0;
    for (int64_t s = 0; s < S; ++s) {
      const bool gone = occ[s] && static_cast<int64_t>(step) - last[s] > ttl;
      expired += gone;
      ranked[s] = gone ? 0 : std::min(first[s], kInt32Max - 1) + 1;
      ranked_then[s] = gone ? last[s] : then[s];
    }
    need = std::min<int64_t>(E, std::max(need, expired));
    first = ranked.data(), then = ranked_then.data();
  }
  if (need == 0) return ffi::Error::Success();

  Lowest(first, then, occ, S, S - num_free, need, evicted);
  // Lazy deletion: an evicted id's entry of the main copy (if it is there,
  // not in the recent copy) keeps its place and id, its slot marked stale.
  const int64_t n_main = S - num_free - num_recent + num_stale;
  int64_t marked = 0;
  for (int64_t r = 0; r < need; ++r) {
    int32_t s = evicted[r];
    int64_t at = main.Gallop(0, n_main, il[s], ih[s]);
    if (main.Hit(n_main, at, il[s], ih[s]) && main.slots[at] == s) {
      main.slots[at] = static_cast<int32_t>(S);
      ++marked;
    }
    occ[s] = false, ih[s] = 0, il[s] = 0, cnt[s] = 0, last[s] = 0;
    stack[num_free + r] = s;
  }
  sc[kNumRecent] =
      static_cast<int32_t>(recent.Compact(num_recent, [live = occ](int32_t s) { return live[s]; }));
  sc[kNumStale] = static_cast<int32_t>(num_stale + marked);
  sc[kNumFree] = static_cast<int32_t>(num_free + need);
  sc[kEvictions] = SaturatingAdd(sc[kEvictions], need);
  return ffi::Error::Success();
}

}  // namespace jaxslices

namespace js = jaxslices;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxslicesManagedAdmit, js::AdmitImpl,
    xla::ffi::Ffi::Bind()
        .Arg<js::U32Vector>()   // hi [N]
        .Arg<js::U32Vector>()   // lo [N]
        .Arg<js::PredVector>()  // valid [N]
        .RemainingArgs()        // the state (js::BindState)
        .Ret<js::S32Vector>()   // rows [N]
        .RemainingRets()        // the state, in place
        .Attr<int64_t>("min_count")
        .Attr<int64_t>("threshold")
        .Attr<int64_t>("half_life"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxslicesManagedEvict, js::EvictImpl,
    xla::ffi::Ffi::Bind()
        .RemainingArgs()        // the state (js::BindState)
        .Ret<js::S32Vector>()   // evicted [E]
        .RemainingRets()        // the state, in place
        .Attr<bool>("lfu")
        .Attr<int64_t>("half_life")
        .Attr<int64_t>("ttl"));
