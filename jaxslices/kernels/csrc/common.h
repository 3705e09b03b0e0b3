// Shared pieces of the jaxslices CPU kernels (XLA FFI handlers).
//
// The Python wrappers (jaxslices/kernels/_ops.py) are the contract: they
// check shapes and dtypes, choose the path and hold the XLA reference of
// every kernel. The kernels are loops over rows with no policy of their own.
//
// A "recipe" describes the rows of a sparse gradient without materialising
// them: slot s of N holds row  scale * weight[s] * src[bag[s]]  for table row
// ids[s]; an id outside [0, V) marks a slot that touches nothing. Without a
// bag array, slot s reads src[s / length] (padded bags of `length` slots) or
// src[s] (length 0); without weights, weight[s] = 1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxslices {

namespace ffi = xla::ffi;

// The typed FFI boundary. Each handler binds typed buffers (float32 rows,
// int32 bags, ids of one integer type per registration) and named bool, enum
// and int64 attributes; a buffer of the wrong dtype or rank is rejected by
// the FFI before the handler runs, and every handler checks the shapes that
// its loops index with (a wrong shape is an error, never a write out of
// bounds). Ids come in two types: each kernel is one template registered
// twice, as "<target>_s32" and "<target>_s64" (jaxslices/kernels/_build.py).
using F32Rows = ffi::BufferR2<ffi::F32>;      // [M, R] rows of floats
using F32Vector = ffi::BufferR1<ffi::F32>;    // [N] (empty: absent)
using BagVector = ffi::BufferR1<ffi::S32>;    // [N] bag of each slot (empty: absent)
template <ffi::DataType kId>
using IdVector = ffi::BufferR1<kId>;          // [N] ids
template <ffi::DataType kId>
using IdOf = ffi::NativeType<kId>;

template <typename Id>
struct Recipe {
  const float* src;
  const Id* ids;
  const int32_t* bag;    // may be null
  int64_t length;        // > 0 (and no bag): slot s reads src[s / length]
  const float* weight;   // may be null
  float scale;
  int64_t num_slots;     // N
  int64_t num_src;       // M, rows of src
  int64_t row;           // R, floats per row

  // The source row of slot s, or null if the slot reads no row.
  const float* source(int64_t s) const {
    int64_t b = bag ? bag[s] : (length > 0 ? s / length : s);
    if (b < 0 || b >= num_src) return nullptr;
    return src + b * row;
  }

  // The source rows of slots 0, 1, 2, ... in turn, without a division per
  // slot for padded bags (an integer division costs more than the row's
  // arithmetic): call next() once per slot, in order.
  struct Cursor {
    const Recipe* r;
    int64_t s = 0, b = 0, j = 0;
    const float* next() {
      int64_t i = next_index();
      return i < 0 ? nullptr : r->src + i * r->row;
    }
    // The source row's index (-1: none) of the next slot.
    int64_t next_index() {
      const Recipe& q = *r;
      int64_t src_row;
      if (q.bag) {
        src_row = q.bag[s];
      } else if (q.length > 0) {
        src_row = b;
        if (++j == q.length) {
          j = 0;
          ++b;
        }
      } else {
        src_row = s;
      }
      ++s;
      if (src_row < 0 || src_row >= q.num_src) return -1;
      return src_row;
    }
  };
  Cursor cursor() const { return Cursor{this}; }
  // A cursor whose next() is slot s's row (one division, at the start).
  Cursor cursor_at(int64_t s) const {
    Cursor c{this, s};
    if (!bag && length > 0) {
      c.b = s / length;
      c.j = s % length;
    }
    return c;
  }
  float factor(int64_t s) const { return weight ? scale * weight[s] : scale; }
};

// The number of rows of a buffer (its leading dimension; 1 for a scalar)
// and the floats per row (the product of every other dimension).
template <typename B>
int64_t NumRows(const B& b) {
  auto dims = b.dimensions();
  return dims.size() == 0 ? 1 : dims[0];
}

template <typename B>
int64_t RowWidth(const B& b) {
  auto dims = b.dimensions();
  int64_t r = 1;
  for (size_t i = 1; i < dims.size(); ++i) r *= dims[i];
  return r;
}

// A kernel's refusal of its arguments: what was given, what was expected.
inline ffi::Error Invalid(const char* kernel, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("jaxslices ") + kernel + " kernel: " + what);
}

inline std::string Str(int64_t x) { return std::to_string(x); }

// The recipe of a gradient from its buffers, checked: src [M, R], ids [N],
// bag [N] (has_bag), weight [N] (has_weight). Source rows out of [0, M) read
// nothing (Recipe::source), so only the per-slot arrays need their sizes.
template <ffi::DataType kId>
ffi::Error MakeRecipe(const char* kernel, const F32Rows& src,
                      const IdVector<kId>& ids, const BagVector& bag,
                      const F32Vector& weight, float scale, bool has_bag,
                      bool has_weight, int64_t length,
                      Recipe<IdOf<kId>>* recipe) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (has_bag && static_cast<int64_t>(bag.element_count()) != n) {
    return Invalid(kernel, "the bag array has " + Str(bag.element_count()) +
                               " entries for " + Str(n) + " ids");
  }
  if (has_weight && static_cast<int64_t>(weight.element_count()) != n) {
    return Invalid(kernel, "the weight array has " +
                               Str(weight.element_count()) + " entries for " +
                               Str(n) + " ids");
  }
  if (length < 0) return Invalid(kernel, "length " + Str(length) + " < 0");
  auto dims = src.dimensions();
  *recipe = Recipe<IdOf<kId>>{src.typed_data(),
                            ids.typed_data(),
                            has_bag ? bag.typed_data() : nullptr,
                            length,
                            has_weight ? weight.typed_data() : nullptr,
                            scale,
                            n,
                            dims[0],
                            dims[1]};
  return ffi::Error::Success();
}

// Open-addressing map from a row id to its slot among the distinct ids, in
// order of first appearance. Reused between calls (one per thread): a
// generation stamp marks the entries of the current call, so starting a call
// costs nothing (no clearing) until the stamp wraps around.
class IdMap {
 public:
  void Reset(int64_t n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    if (static_cast<int64_t>(entries_.size()) < cap) {
      entries_.assign(cap, Entry{0, 0, 0});
      gen_ = 0;
    }
    mask_ = cap - 1;
    if (++gen_ == 0) {  // wrapped: clear the stamps once
      for (Entry& e : entries_) e.stamp = 0;
      gen_ = 1;
    }
  }

  // Start loading the entry where `id`'s probe begins (a cache miss).
  void Prefetch(int64_t id) const {
    __builtin_prefetch(&entries_[Home(id)], 1, 3);
  }

  // The slot of `id`, inserting it as slot `next` if new (then *inserted).
  int64_t FindOrInsert(int64_t id, int64_t next, bool* inserted) {
    int64_t i = Home(id);
    while (true) {
      Entry& e = entries_[i];  // one cache line holds a probe's whole entry
      if (e.stamp != gen_) {
        e = Entry{id, static_cast<int32_t>(next), gen_};
        *inserted = true;
        return next;
      }
      if (e.key == id) {
        *inserted = false;
        return e.slot;
      }
      i = (i + 1) & mask_;
    }
  }

 private:
  int64_t Home(int64_t id) const {
    uint64_t h = static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull;
    return static_cast<int64_t>(h >> 17) & mask_;
  }

  struct Entry {
    int64_t key;
    int32_t slot;
    uint32_t stamp;
  };
  std::vector<Entry> entries_;
  uint32_t gen_ = 0;
  int64_t mask_ = 0;
};

inline IdMap& ThreadIdMap() {
  thread_local IdMap map;
  return map;
}

// Scratch buffers reused between calls, one per (type, use) and thread.
enum Scratch {
  kGroups, kApplyRows, kApplyIds, kParts, kSquares, kBagRows, kParamRow
};

template <typename T, Scratch use>
std::vector<T>& ThreadScratch() {
  thread_local std::vector<T> v;
  return v;
}

// How many rows ahead the loops over random table/state rows prefetch: a
// row of a large table is a cache (and TLB) miss; the loops' own work per
// row is short, so they wait on memory without it.
constexpr int64_t kPrefetch = 8;

// Slots [lo, hi) of `n` in the unit u of `units` (contiguous ranges).
inline int64_t UnitBegin(int64_t u, int64_t units, int64_t n) { return u * n / units; }

// Prefetch the cache lines of one row of `n` entries (for writing if `write`).
template <typename T>
inline void PrefetchRow(const T* p, int64_t n, bool write) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) {
    if (write) {
      __builtin_prefetch(c + b, 1, 3);
    } else {
      __builtin_prefetch(c + b, 0, 3);
    }
  }
}

// Sum of squares of x[0:n], in 8 interleaved partial sums (a plain `s +=
// x * x` loop cannot be vectorised: float addition is not associative).
inline float SumSquares(const float* x, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) part[j] += x[k + j] * x[k + j];
  }
  float s = 0.f;
  for (; k < n; ++k) s += x[k] * x[k];
  for (int j = 0; j < 8; ++j) s += part[j];
  return s;
}

// acc[0:R] (+)= f * x[0:R]
inline void Axpy(float* acc, const float* x, float f, int64_t r, bool first) {
  if (first) {
    for (int64_t k = 0; k < r; ++k) acc[k] = f * x[k];
  } else {
    for (int64_t k = 0; k < r; ++k) acc[k] += f * x[k];
  }
}

// ------------------------------------------- bfloat16 and float16 tables
//
// A table (and the parameters a rule reads) may be float32, bfloat16 or
// float16; every sum and rule runs in float32. A low-precision entry is read
// by widening its bits (exact) and written back rounded once, either to
// nearest (ties to even, as XLA's convert) or stochastically, bit for bit as
// jaxslices/_rounding.py (its docstring is the specification): the 32 random
// bits of the entry in column c of table row r whose float32 value has bits
// b are Mix32(RowNoise(Mix32(seed), r) ^ (c * 0x9E3779B9) ^ b), with Mix32
// MurmurHash3's finaliser (Austin Appleby, public domain) and RowNoise
// mixing the row's two 32-bit words in: independent per entry and, with the
// seed mixing in the optimizer's step, per step. Only integer operations
// and one float comparison whose every term is exact (no product is added
// to anything, so no FMA contraction can change it).

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

inline float BitsFloat(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

inline float Widen(float x) { return x; }
inline float Widen(Bf16 x) { return BitsFloat(static_cast<uint32_t>(x.bits) << 16); }
inline float Widen(F16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t mag = x.bits & 0x7FFFu;
  if (mag >= 0x7C00u) {  // inf, NaN (payload kept)
    return BitsFloat(sign | 0x7F800000u | ((mag & 0x3FFu) << 13));
  }
  if (mag >= 0x0400u) return BitsFloat(sign | ((mag + (112u << 10)) << 13));
  // Zero and subnormals: mag * 2^-24, exact in float32.
  return BitsFloat(sign | FloatBits(static_cast<float>(mag) * 0x1p-24f));
}

// float32 -> bfloat16, to nearest (ties to even); NaN stays a (quiet) NaN.
inline uint16_t NearestBf16(float x) {
  const uint32_t b = FloatBits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// float32 -> float16, to nearest (ties to even), overflow to inf, subnormals
// rounded on their 2^-24 grid; NaN stays a (quiet) NaN.
inline uint16_t NearestF16(float x) {
  const uint32_t b = FloatBits(x);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520
  if (a >= 0x38800000u) {  // a normal float16 (>= 2^-14): rebias, round 13 bits
    const uint32_t r = a - (112u << 23);
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  const uint32_t e = a >> 23;
  if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25: zero
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14 .. 24: units of 2^-24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

inline uint32_t Mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// The noise seed of table row r (seed_mixed = Mix32(seed)).
inline uint32_t RowNoise(uint32_t seed_mixed, int64_t r) {
  const uint64_t u = static_cast<uint64_t>(r);
  return Mix32(Mix32(seed_mixed ^ static_cast<uint32_t>(u)) ^
               static_cast<uint32_t>(u >> 32));
}

// The noise of the entry in column k of a row (row_noise = RowNoise(...))
// whose float32 value is x.
inline uint32_t EntryNoise(uint32_t row_noise, int64_t k, float x) {
  return Mix32(row_noise ^ (static_cast<uint32_t>(k) * 0x9E3779B9u) ^ FloatBits(x));
}

// Stochastic rounding of a finite x (non-finite values round to nearest:
// the caller's RoundInto). bfloat16: the top half of |x| + (h & 0xFFFF),
// never past the largest finite value.
inline uint16_t StochasticBf16(float x, uint32_t h) {
  const uint32_t b = FloatBits(x);
  uint32_t up = ((b & 0x7FFFFFFFu) + (h & 0xFFFFu)) >> 16;
  if (up > 0x7F7Fu) up = 0x7F7Fu;
  return static_cast<uint16_t>(((b >> 16) & 0x8000u) | up);
}

// float16: up to the neighbour away from zero when u * (hi - lo) < |x| - lo,
// u = (h >> 8) / 2^24 (hi - lo a power of two, |x| - lo exact: Sterbenz).
inline uint16_t StochasticF16(float x, uint32_t h) {
  const uint16_t nb = NearestF16(x);
  const uint16_t sign = nb & 0x8000u;
  const uint16_t mag = nb & 0x7FFFu;
  const float ax = std::fabs(x);
  const bool away = std::fabs(Widen(F16{nb})) > ax;
  const uint16_t lo_mag = (away && mag != 0) ? static_cast<uint16_t>(mag - 1) : mag;
  const uint16_t hi_mag = static_cast<uint16_t>(lo_mag + 1);
  const float lo = Widen(F16{lo_mag}), hi = Widen(F16{hi_mag});
  const float u = static_cast<float>(h >> 8) * 0x1p-24f;
  const float step = u * (hi - lo);
  const bool take_hi = step < ax - lo && hi_mag < 0x7C00u;
  return static_cast<uint16_t>(sign | (take_hi ? hi_mag : lo_mag));
}

// Write float32 x into a table entry: to nearest, or stochastically with
// the entry's noise h (then non-finite values to nearest: inf stays inf).
inline void RoundInto(float* out, float x, bool, uint32_t) { *out = x; }
inline void RoundInto(Bf16* out, float x, bool stochastic, uint32_t h) {
  out->bits = stochastic && std::isfinite(x) ? StochasticBf16(x, h) : NearestBf16(x);
}
inline void RoundInto(F16* out, float x, bool stochastic, uint32_t h) {
  out->bits = stochastic && std::isfinite(x) ? StochasticF16(x, h) : NearestF16(x);
}

// row[0:R] = round(row + a), each entry as RoundInto with its EntryNoise
// (row_noise: RowNoise of the row).
template <typename T>
inline void AddRoundRow(T* row, const float* a, int64_t R, bool stochastic,
                        uint32_t row_noise) {
  for (int64_t k = 0; k < R; ++k) {
    const float x = Widen(row[k]) + a[k];
    RoundInto(row + k, x, stochastic, stochastic ? EntryNoise(row_noise, k, x) : 0u);
  }
}

// bfloat16, stochastically: the same bits, without branches (the loop
// vectorises: measured 2.7x faster than entry by entry on 16K Zipf ids).
inline void AddRoundRow(Bf16* row, const float* a, int64_t R, bool stochastic,
                        uint32_t row_noise) {
  if (!stochastic) {
    for (int64_t k = 0; k < R; ++k) row[k].bits = NearestBf16(Widen(row[k]) + a[k]);
    return;
  }
  for (int64_t k = 0; k < R; ++k) {
    const uint32_t b = FloatBits(Widen(row[k]) + a[k]);
    const uint32_t mag = b & 0x7FFFFFFFu;
    const uint32_t h = Mix32(row_noise ^ (static_cast<uint32_t>(k) * 0x9E3779B9u) ^ b);
    uint32_t up = (mag + (h & 0xFFFFu)) >> 16;
    up = up < 0x7F7Fu ? up : 0x7F7Fu;  // a finite value never to infinity
    const uint32_t rounded = ((b >> 16) & 0x8000u) | up;
    // Non-finite: to nearest (NearestBf16: inf stays, NaN made quiet).
    const uint32_t special = mag > 0x7F800000u ? ((b >> 16) | 0x40u) : (b >> 16);
    row[k].bits = static_cast<uint16_t>(mag >= 0x7F800000u ? special : rounded);
  }
}

// acc[0:R] (+)= f * x[0:R] for rows of any table type (read in float32).
template <typename T>
inline void AxpyFrom(float* acc, const T* x, float f, int64_t r, bool first) {
  if (first) {
    for (int64_t k = 0; k < r; ++k) acc[k] = f * Widen(x[k]);
  } else {
    for (int64_t k = 0; k < r; ++k) acc[k] += f * Widen(x[k]);
  }
}

// Call f(T{}) with T the table type of `type` (float, Bf16, F16), or refuse.
template <typename F>
ffi::Error WithTableType(const char* kernel, ffi::DataType type, F&& f) {
  switch (type) {
    case ffi::DataType::F32: return f(float{});
    case ffi::DataType::BF16: return f(Bf16{});
    case ffi::DataType::F16: return f(F16{});
    default:
      return Invalid(kernel, "a table of element type " +
                                 std::to_string(static_cast<int>(type)) +
                                 " (the kernels take float32, bfloat16 and float16)");
  }
}

// The output that aliases `in`, its data as T*, for every buffer type (typed
// or AnyBuffer): the wrappers always alias it; should XLA have copied the
// input anyway, the output starts as that copy.
template <typename T, typename In, typename Out>
T* InPlaceAny(const In& in, ffi::Result<Out>& out) {
  if (in.untyped_data() != out->untyped_data() && in.size_bytes() > 0) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  return static_cast<T*>(out->untyped_data());
}

// Sum each id's slots (grouped by `start`/`order`) into its row: row j goes
// to rows[dest[j]] (rows[j] without dest), and on_row(j) is called after
// each. W > 0: the row width at compile time, so that the sum stays in
// registers and each row is written once; W = 0: any width.
template <int W, typename Id, typename OnRow>
void SumGroups(const Recipe<Id>& r, int64_t j0, int64_t count,
               const int32_t* start, const int32_t* order,
               const int32_t* src_row, const int32_t* dest, float* rows,
               OnRow&& on_row) {
  const int64_t R = W > 0 ? W : r.row;
  int64_t begin = j0 == 0 ? 0 : start[j0 - 1];
  for (int64_t j = j0; j < count; ++j) {
    float* out = rows + (dest ? static_cast<int64_t>(dest[j]) : j) * R;
    if constexpr (W > 0) {
      float acc[W > 0 ? W : 1];
      for (int64_t k = 0; k < W; ++k) acc[k] = 0.f;
      for (int64_t q = begin; q < start[j]; ++q) {
        int32_t s = order[q];
        if (src_row[s] < 0) continue;
        const float* x = r.src + static_cast<int64_t>(src_row[s]) * W;
        float f = r.factor(s);
        for (int64_t k = 0; k < W; ++k) acc[k] += f * x[k];
      }
      for (int64_t k = 0; k < W; ++k) out[k] = acc[k];
    } else {
      bool first = true;
      for (int64_t q = begin; q < start[j]; ++q) {
        int32_t s = order[q];
        if (src_row[s] < 0) continue;
        Axpy(out, r.src + static_cast<int64_t>(src_row[s]) * R, r.factor(s), R,
             first);
        first = false;
      }
      if (first) std::memset(out, 0, sizeof(float) * R);
    }
    on_row(j);
    begin = start[j];
  }
}

// Groups j0 .. count - 1 (the slots of group j end at start[j]).
template <typename Id, typename OnRow>
void SumGroupsAnyWidth(const Recipe<Id>& r, int64_t j0, int64_t count,
                       const int32_t* start, const int32_t* order,
                       const int32_t* src_row, const int32_t* dest, float* rows,
                       OnRow&& on_row) {
  auto g = [&](auto width) {
    SumGroups<decltype(width)::value>(r, j0, count, start, order, src_row, dest,
                                      rows, on_row);
  };
  switch (r.row) {  // rows of a fixed width are summed in registers
    case 16: return g(std::integral_constant<int, 16>{});
    case 32: return g(std::integral_constant<int, 32>{});
    case 64: return g(std::integral_constant<int, 64>{});
    case 128: return g(std::integral_constant<int, 128>{});
    default: return g(std::integral_constant<int, 0>{});
  }
}

// Group slots by a key in [0, count) (key[s] < 0: no group), keeping slot
// order within a group: start[j] becomes the end of group j's slots in
// order (start has count + 1 entries). `slots` lists the slots to group
// (null: 0 .. n - 1).
inline void GroupSlots(const int32_t* key, const int32_t* slots, int64_t n,
                       int64_t count, int32_t* start, int32_t* order) {
  std::fill(start, start + count + 1, 0);
  for (int64_t q = 0; q < n; ++q) {
    int32_t j = key[slots ? slots[q] : q];
    if (j >= 0) ++start[j + 1];
  }
  for (int64_t j = 0; j < count; ++j) start[j + 1] += start[j];
  for (int64_t q = 0; q < n; ++q) {
    int32_t s = slots ? slots[q] : static_cast<int32_t>(q);
    int32_t j = key[s];
    if (j >= 0) order[start[j]++] = s;
  }
}

// The coalesced case of Coalesce (the valid ids are distinct: one row per
// valid slot, in slot order), its slots split in ranges between threads,
// each range starting at the output row its first valid slot takes.
template <typename Id, typename OnRow>
int64_t CoalesceDistinct(const Recipe<Id>& r, int64_t num_rows,
                         int64_t capacity, float* rows, Id* uids,
                         int64_t* total, OnRow&& on_row, const Threads* t,
                         int64_t threads) {
  const int64_t n = r.num_slots;
  if (t == nullptr) threads = 1;
  const int64_t units = UnitsFor(threads, n);
  std::vector<int32_t>& first_row = ThreadScratch<int32_t, kParts>();
  if (static_cast<int64_t>(first_row.size()) < units + 1) first_row.resize(units + 1);
  int64_t count = 0;
  for (int64_t u = 0; u < units; ++u) {
    first_row[u] = static_cast<int32_t>(count);
    for (int64_t s = UnitBegin(u, units, n); s < UnitBegin(u + 1, units, n); ++s) {
      Id id = r.ids[s];
      count += (id >= 0 && id < num_rows);
    }
  }
  *total = count;
  if (count > capacity) return -1;
  auto copy = [&](int64_t u) {
    const int64_t lo = UnitBegin(u, units, n), hi = UnitBegin(u + 1, units, n);
    auto rows_of = r.cursor_at(lo);
    int64_t j = first_row[u];
    for (int64_t s = lo; s < hi; ++s) {
      const float* x = rows_of.next();
      Id id = r.ids[s];
      if (id < 0 || id >= num_rows) continue;
      uids[j] = id;
      float* acc = rows + j * r.row;
      if (x) Axpy(acc, x, r.factor(s), r.row, true);
      else std::memset(acc, 0, sizeof(float) * r.row);
      on_row(j);
      ++j;
    }
  };
  if (threads <= 1) {
    copy(0);
  } else {
    ParallelFor(*t, threads, units, copy);
  }
  return count;
}

// Sum the recipe's rows per distinct valid id, in order of first appearance:
// rows[j] (R floats each) and uids[j] for j < count, calling on_row(j) as
// soon as row j is complete (the caller applies its rule while the row is in
// cache). Returns count, or -1 if more than `capacity` distinct ids were
// found: then on_row is never called, nothing is written past `capacity`,
// and `*total` holds the true count.
//
// With `threads` > 1 (and `t`), the distinct ids' sums and on_row calls are
// split between threads in ranges of j (each id's slots summed by one
// thread, in slot order; on_row(j) then runs on any thread, each j once).
template <typename Id, typename OnRow>
int64_t Coalesce(const Recipe<Id>& r, int64_t num_rows, bool coalesced,
                 int64_t capacity, float* rows, Id* uids, int64_t* total,
                 OnRow&& on_row, const Threads* t = nullptr,
                 int64_t threads = 1) {
  const int64_t n = r.num_slots;
  int64_t count = 0;
  auto rows_of = r.cursor();
  if (coalesced) {
    return CoalesceDistinct(r, num_rows, capacity, rows, uids, total, on_row, t,
                            threads);
  }
  // Three passes over the slots' integers, then one over the rows: each
  // distinct id's slots are summed together and its row written once
  // (summing straight into the rows would read and write a random row of a
  // megabyte-sized buffer per slot). Within an id, slots are summed in their
  // order (as a sequential sum would).
  IdMap& map = ThreadIdMap();
  map.Reset(n);
  std::vector<int32_t>& group = ThreadScratch<int32_t, kGroups>();
  if (static_cast<int64_t>(group.size()) < 4 * n + 1) group.resize(4 * n + 1);
  int32_t* slot_j = group.data();  // slot -> its id's position j (-1: none)
  int32_t* src_row = slot_j + n;   // slot -> its source row (-1: none)
  int32_t* order = src_row + n;    // the slots, grouped by j
  int32_t* start = order + n;      // count + 1 entries (count <= n)
  constexpr int64_t kAhead = 16;   // hash entries loaded this many slots ahead
  for (int64_t s = 0; s < n; ++s) {
    if (s + kAhead < n) {
      Id ahead = r.ids[s + kAhead];
      if (ahead >= 0 && ahead < num_rows) map.Prefetch(ahead);
    }
    src_row[s] = static_cast<int32_t>(rows_of.next_index());
    Id id = r.ids[s];
    if (id < 0 || id >= num_rows) {
      slot_j[s] = -1;
      continue;
    }
    bool inserted;
    int64_t j = map.FindOrInsert(static_cast<int64_t>(id), count, &inserted);
    if (inserted) {
      if (count < capacity) uids[count] = id;
      ++count;
    }
    slot_j[s] = static_cast<int32_t>(j);
  }
  *total = count;
  if (count > capacity) return -1;
  GroupSlots(slot_j, nullptr, n, count, start, order);
  if (t == nullptr || threads <= 1) {
    SumGroupsAnyWidth(r, 0, count, start, order, src_row, nullptr, rows, on_row);
    return count;
  }
  const int64_t units = UnitsFor(threads, count);
  ParallelFor(*t, threads, units, [&](int64_t u) {
    SumGroupsAnyWidth(r, UnitBegin(u, units, count), UnitBegin(u + 1, units, count),
                      start, order, src_row, nullptr, rows, on_row);
  });
  return count;
}

// ----------------------------------------------------- on several threads
//
// The threaded versions compute what the one-thread loops compute, bit for
// bit. Coalesce hashes on the calling thread, then splits the distinct ids
// in ranges (each id's slots summed by one thread, in slot order). SGD's
// update buckets its slots by the partition (PartOf) that owns their row, so
// that each row's additions run in slot order on one thread. The units
// depend on the thread count, the results do not.

// The slots of a recipe bucketed by the partition owning their row: the
// slots of partition p are by_part[begin(p) .. end[p]), in slot order;
// src_row[s] is slot s's source row (-1: none); part[s] its partition (-1:
// an id out of [0, V)).
struct Buckets {
  int64_t parts;
  int32_t* part;
  int32_t* src_row;
  int32_t* by_part;
  int32_t* end;  // parts + 1 entries
  int64_t begin(int64_t p) const { return p == 0 ? 0 : end[p - 1]; }
};

// The int32 entries of scratch Bucket uses.
inline int64_t BucketsSize(int64_t n, int64_t parts) { return 3 * n + parts + 1; }

template <typename Id>
Buckets Bucket(const Recipe<Id>& r, int64_t num_rows, int64_t parts,
               int32_t* scratch) {
  const int64_t n = r.num_slots;
  Buckets b{parts, scratch, scratch + n, scratch + 2 * n, scratch + 3 * n};
  auto rows_of = r.cursor();
  for (int64_t s = 0; s < n; ++s) {
    b.src_row[s] = static_cast<int32_t>(rows_of.next_index());
    Id id = r.ids[s];
    b.part[s] = (id >= 0 && id < num_rows)
                    ? PartOf(static_cast<int64_t>(id), parts)
                    : -1;
  }
  GroupSlots(b.part, nullptr, n, parts, b.end, b.by_part);
  return b;
}

}  // namespace jaxslices
