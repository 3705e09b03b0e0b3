// Row-wise optimizer rules on a sparse gradient given as a recipe
// (common.h): duplicate ids are summed (in order of first appearance), then
// each distinct row's rule runs once, reading and writing that row's
// optimizer state in place. Outputs: the distinct ids (then V), the rule's
// output rows (rows past the count are left unwritten: the wrapper masks
// them), the count, and optionally the squared norm of the summed rows.
//
// The rules mirror jaxslices' XLA rules (jaxslices/transforms) one for one;
// the Python reference of each is what the tests compare with.
#include "common.h"

namespace jaxslices {

enum Rule : int64_t {
  kCoalesce = 0,     // out = g
  kClip = 1,         // out = clip(g, -d, d)                      hp: d
  kRowNorm = 2,      // out = g * min(1, m / |g|)                 hp: m
  kRss = 3,          // Adagrad:  acc += g^2                      hp: eps
  kRowwiseRss = 4,   // row-wise Adagrad: acc += mean(g^2)        hp: eps
  kAdam = 5,         // lazy Adam, mu|nu packed per row           hp: below
  kTrace = 6,        // momentum: t = g + decay * t               hp: decay
  kDecay = 7,        // weight decay: out = g + wd * p            hp: wd
  kFtrl = 8,         // FTRL-proximal, n|z packed per row         hp: below
  kMaxNorm = 9,      // PyTorch's max_norm on the state (a table)  hp: below
};

// clip(x, -d, d) that keeps NaN (as jnp.clip; fmin/fmax would drop it).
static inline float Clip(float x, float d) {
  return x < -d ? -d : (x > d ? d : x);
}

struct Ctx {
  int64_t row;
  const float* hp;
  int64_t flags;
};

// One distinct row: g (summed gradient, overwritten by the output), its
// state row(s) st, its parameter row p.
static inline void ApplyRule(int64_t rule, const Ctx& c, float* g, float* st,
                             const float* p) {
  const int64_t R = c.row;
  const float* hp = c.hp;
  switch (rule) {
    case kCoalesce:
      return;
    case kClip: {
      float d = hp[0];
      for (int64_t k = 0; k < R; ++k) g[k] = Clip(g[k], d);
      return;
    }
    case kRowNorm: {
      float m = hp[0];
      float norm = std::sqrt(SumSquares(g, R));
      if (norm > m) {
        float f = m / norm;
        for (int64_t k = 0; k < R; ++k) g[k] *= f;
      }
      return;
    }
    case kRss: {
      float eps = hp[0];
      for (int64_t k = 0; k < R; ++k) {
        float acc = g[k] * g[k] + st[k];
        st[k] = acc;
        g[k] = acc > 0.f ? g[k] / std::sqrt(acc + eps) : 0.f;
      }
      return;
    }
    case kRowwiseRss: {
      float eps = hp[0];
      float acc = st[0] + SumSquares(g, R) / static_cast<float>(R);
      st[0] = acc;
      float denom = acc > 0.f ? std::sqrt(acc) + eps : 1.f;
      for (int64_t k = 0; k < R; ++k) g[k] = g[k] / denom;
      return;
    }
    case kAdam: {
      // hp: b1, b2, eps, eps_root, bc_mu, bc_nu, bc_mu_next, 1 - b1, 1 - b2
      float b1 = hp[0], b2 = hp[1], eps = hp[2], eps_root = hp[3];
      float bc_mu = hp[4], bc_nu = hp[5], bc_next = hp[6];
      float c1 = hp[7], c2 = hp[8];
      bool nesterov = c.flags & kNesterov;
      float* mu = st;
      float* nu = st + R;
      for (int64_t k = 0; k < R; ++k) {
        float gk = g[k];
        float m = c1 * gk + b1 * mu[k];
        float v = c2 * (gk * gk) + b2 * nu[k];
        mu[k] = m;
        nu[k] = v;
        float mu_hat = nesterov ? b1 * (m / bc_next) + c1 * (gk / bc_mu)
                                : m / bc_mu;
        g[k] = mu_hat / (std::sqrt(v / bc_nu + eps_root) + eps);
      }
      return;
    }
    case kTrace: {
      float decay = hp[0];
      bool nesterov = c.flags & kNesterov;
      for (int64_t k = 0; k < R; ++k) {
        float t = g[k] + decay * st[k];
        st[k] = t;
        g[k] = nesterov ? g[k] + decay * t : t;
      }
      return;
    }
    case kDecay: {
      float wd = hp[0];
      for (int64_t k = 0; k < R; ++k) g[k] = g[k] + wd * p[k];
      return;
    }
    case kFtrl: {
      // hp: lr, power k (= -learning_rate_power), l1, l2, l2_shrinkage, beta
      float lr = hp[0], pw = hp[1], l1 = hp[2], l2 = hp[3], l2s = hp[4];
      float beta = hp[5];
      bool sqrt_power = c.flags & kSqrtPower;
      float* n = st;
      float* z = st + R;
      float l2_total = 2.f * (l2 + beta / (2.f * lr));
      for (int64_t k = 0; k < R; ++k) {
        float gk = g[k], pk = p[k];
        float n_new = n[k] + gk * gk;
        float pow_new = sqrt_power ? std::sqrt(n_new) : std::pow(n_new, pw);
        float pow_old = sqrt_power ? std::sqrt(n[k]) : std::pow(n[k], pw);
        float sigma_p = (pow_new - pow_old) / lr * pk;
        float z_new = z[k] + (gk + 2.f * l2s * pk) - sigma_p;
        float q = pow_new / lr + l2_total;
        float clipped = Clip(z_new, l1);
        float p_new = (clipped - z_new) / q;
        n[k] = n_new;
        z[k] = z_new;
        g[k] = p_new - pk;
      }
      return;
    }
    case kMaxNorm: {
      // hp: max_norm, norm_type (p; inf: the largest entry), eps (1e-7).
      // The state is the table itself: its row is scaled in place.
      float m = hp[0], p_type = hp[1], eps = hp[2];
      float norm = 0.f;
      if (std::isinf(p_type)) {
        for (int64_t k = 0; k < R; ++k) norm = std::fmax(norm, std::fabs(st[k]));
      } else if (p_type == 2.f) {
        norm = std::sqrt(SumSquares(st, R));
      } else if (p_type == 1.f) {
        for (int64_t k = 0; k < R; ++k) norm += std::fabs(st[k]);
      } else {
        for (int64_t k = 0; k < R; ++k) norm += std::pow(std::fabs(st[k]), p_type);
        norm = std::pow(norm, 1.f / p_type);
      }
      if (norm > m) {
        float f = m / (norm + eps);
        for (int64_t k = 0; k < R; ++k) st[k] *= f;
      }
      return;
    }
  }
}

template <typename Id>
static ffi::Error Rowwise(const Recipe<Id>& r, int64_t rule, int64_t flags,
                          int64_t num_rows, const float* hp, const float* params,
                          float* state, int64_t state_row, Id* uids,
                          float* rows, int64_t capacity, int32_t* count_out,
                          float* sumsq_out) {
  int64_t total = 0;
  Ctx c{r.row, hp, flags};
  const bool want_sumsq = flags & kWantSumSq;
  double ss = 0.0;
  auto on_row = [&](int64_t j) {
    float* g = rows + j * r.row;
    if (want_sumsq) ss += SumSquares(g, r.row);
    if (rule == kCoalesce) return;
    int64_t id = static_cast<int64_t>(uids[j]);
    float* st = state ? state + id * state_row : nullptr;
    const float* p = params ? params + id * r.row : nullptr;
    ApplyRule(rule, c, g, st, p);
  };
  // Prefetch the state (and params) rows of the ids a few rows ahead: known
  // once the ids are hashed, i.e. in the pass that sums the rows.
  auto on_row_prefetching = [&](int64_t j) {
    if (j + kPrefetch < total && j + kPrefetch < capacity) {
      int64_t ahead = static_cast<int64_t>(uids[j + kPrefetch]);
      if (state) PrefetchRow(state + ahead * state_row, state_row, true);
      if (params) PrefetchRow(params + ahead * r.row, r.row, false);
    }
    on_row(j);
  };
  const bool coalesced = flags & kCoalesced;
  int64_t count = coalesced
                      ? Coalesce(r, num_rows, true, capacity, rows, uids, &total, on_row)
                      : Coalesce(r, num_rows, false, capacity, rows, uids, &total,
                                 on_row_prefetching);
  *count_out = static_cast<int32_t>(total);
  if (count < 0) {  // over capacity: the wrapper raises; nothing changed
    for (int64_t j = 0; j < capacity; ++j) uids[j] = static_cast<Id>(num_rows);
    *sumsq_out = 0.f;
    return ffi::Error::Success();
  }
  *sumsq_out = static_cast<float>(ss);
  for (int64_t j = count; j < capacity; ++j) uids[j] = static_cast<Id>(num_rows);
  return ffi::Error::Success();
}

static ffi::Error RowwiseImpl(
    ffi::AnyBuffer src, ffi::AnyBuffer ids, ffi::AnyBuffer bag,
    ffi::AnyBuffer weight, ffi::AnyBuffer scale, ffi::AnyBuffer hp,
    ffi::AnyBuffer params, ffi::AnyBuffer state,
    ffi::Result<ffi::AnyBuffer> state_out, ffi::Result<ffi::AnyBuffer> uids,
    ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> count,
    ffi::Result<ffi::AnyBuffer> sumsq, int64_t rule, int64_t flags,
    int64_t length, int64_t num_rows, int64_t uses_state,
    int64_t uses_params) {
  if (auto e = CheckF32(src, "gradient rows"); !e.success()) return e;
  if (uses_state && state.untyped_data() != state_out->untyped_data()) {
    // Not aliased (the wrapper always aliases; XLA may still have copied):
    // work on the output, a copy of the input.
    std::memcpy(state_out->untyped_data(), state.untyped_data(),
                state.size_bytes());
  }
  float* st = uses_state ? F32(state_out) : nullptr;
  int64_t state_row = uses_state ? RowSize(state) : 0;
  const float* p = uses_params ? F32(params) : nullptr;
  int64_t capacity = Leading(*uids);
  float scale_v = F32(scale)[0];
  const int32_t* bag_p =
      (flags & kHasBag) ? reinterpret_cast<const int32_t*>(bag.untyped_data())
                        : nullptr;
  const float* w = (flags & kHasWeight) ? F32(weight) : nullptr;
  int64_t row = RowSize(*rows);
  if (ids.element_type() != uids->element_type()) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxslices rowwise kernel: ids and uids dtypes differ");
  }
  int32_t* count_p = reinterpret_cast<int32_t*>(count->untyped_data());
  switch (ids.element_type()) {
    case ffi::DataType::S32: {
      Recipe<int32_t> r{F32(src), IdData<int32_t>(ids), bag_p, length, w, scale_v,
                        static_cast<int64_t>(ids.element_count()), Leading(src),
                        row};
      return Rowwise(r, rule, flags, num_rows, F32(hp), p, st, state_row,
                     IdData<int32_t>(uids), F32(rows), capacity, count_p,
                     F32(sumsq));
    }
    case ffi::DataType::S64: {
      Recipe<int64_t> r{F32(src), IdData<int64_t>(ids), bag_p, length, w, scale_v,
                        static_cast<int64_t>(ids.element_count()), Leading(src),
                        row};
      return Rowwise(r, rule, flags, num_rows, F32(hp), p, st, state_row,
                     IdData<int64_t>(uids), F32(rows), capacity, count_p,
                     F32(sumsq));
    }
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "jaxslices rowwise kernel: ids must be int32 or int64");
  }
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesRowwise, jaxslices::RowwiseImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // src
                                  .Arg<xla::ffi::AnyBuffer>()  // ids
                                  .Arg<xla::ffi::AnyBuffer>()  // bag
                                  .Arg<xla::ffi::AnyBuffer>()  // weight
                                  .Arg<xla::ffi::AnyBuffer>()  // scale
                                  .Arg<xla::ffi::AnyBuffer>()  // hp
                                  .Arg<xla::ffi::AnyBuffer>()  // params
                                  .Arg<xla::ffi::AnyBuffer>()  // state
                                  .Ret<xla::ffi::AnyBuffer>()  // state (alias)
                                  .Ret<xla::ffi::AnyBuffer>()  // uids
                                  .Ret<xla::ffi::AnyBuffer>()  // rows
                                  .Ret<xla::ffi::AnyBuffer>()  // count
                                  .Ret<xla::ffi::AnyBuffer>()  // sumsq
                                  .Attr<int64_t>("rule")
                                  .Attr<int64_t>("flags")
                                  .Attr<int64_t>("length")
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("uses_state")
                                  .Attr<int64_t>("uses_params"));
