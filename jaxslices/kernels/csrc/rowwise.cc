// Row-wise optimizer rules on a sparse gradient given as a recipe
// (common.h): duplicate ids are summed (in order of first appearance), then
// each distinct row's rule runs once, reading and writing that row's
// optimizer state in place. Outputs: the distinct ids (then V), the rule's
// output rows (rows past the count are left unwritten: the wrapper masks
// them), the count, and optionally the squared norm of the summed rows.
//
// The rules mirror jaxslices' XLA rules (jaxslices/transforms) one for one;
// the Python reference of each is what the tests compare with. The
// parameters a rule reads (FTRL, weight decay) may be a bfloat16 or float16
// table: each row is read in float32; the state and the output rows are
// float32 (the update is rounded into the table once, by the apply kernel).
#include "common.h"

namespace jaxslices {

// The "rule" attribute. jaxslices/kernels/_ops.py's Rule holds the same
// names and numbers (tests/lib/test_kernels_boundary.py reads this enum).
enum class Rule : int32_t {
  kCoalesce = 0,     // out = g
  kClip = 1,         // out = clip(g, -d, d)                      hp: d
  kRowNorm = 2,      // out = g * min(1, m / |g|)                 hp: m
  kRss = 3,          // Adagrad:  acc += g^2                      hp: eps
  kRowwiseRss = 4,   // row-wise Adagrad: acc += mean(g^2)        hp: eps
  kAdam = 5,         // lazy Adam, mu|nu packed per row           hp: 9, below
  kTrace = 6,        // momentum: t = g + decay * t               hp: decay
  kDecay = 7,        // weight decay: out = g + wd * p            hp: wd
  kFtrl = 8,         // FTRL-proximal, n|z packed per row         hp: 6, below
  kMaxNorm = 9,      // PyTorch's max_norm on the state (a table)  hp: 3, below
};

}  // namespace jaxslices

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jaxslices::Rule);

namespace jaxslices {

// What a rule reads besides the gradient: its number of hyperparameters, its
// state row's width in gradient rows (-1: one float per row; 0: no state)
// and whether it reads the parameters. The handler checks the buffers
// against it before any row is touched.
struct RuleShape {
  const char* name;  // as jaxslices/kernels/_ops.py's RuleSpec.kind
  int64_t num_hp;
  int64_t state_rows;
  bool uses_params;
};

static RuleShape ShapeOf(Rule rule) {
  switch (rule) {
    case Rule::kCoalesce: return {"coalesce", 0, 0, false};
    case Rule::kClip: return {"clip", 1, 0, false};
    case Rule::kRowNorm: return {"row_norm", 1, 0, false};
    case Rule::kRss: return {"rss", 1, 1, false};
    case Rule::kRowwiseRss: return {"rowwise_rss", 1, -1, false};
    case Rule::kAdam: return {"adam", 9, 2, false};
    case Rule::kTrace: return {"trace", 1, 1, false};
    case Rule::kDecay: return {"decay", 1, 0, true};
    case Rule::kFtrl: return {"ftrl", 6, 2, true};
    case Rule::kMaxNorm: return {"max_norm", 3, 1, false};
  }
  return {nullptr, -1, 0, false};
}

// clip(x, -d, d) that keeps NaN (as jnp.clip; fmin/fmax would drop it).
static inline float Clip(float x, float d) {
  return x < -d ? -d : (x > d ? d : x);
}

struct Ctx {
  int64_t row;
  const float* hp;
  bool nesterov;    // the momentum rules' Nesterov variant
  bool sqrt_power;  // FTRL: the power is 0.5 (a square root)
};

// One distinct row: g (summed gradient, overwritten by the output), its
// state row(s) st, its parameter row p.
static inline void ApplyRule(Rule rule, const Ctx& c, float* g, float* st,
                             const float* p) {
  const int64_t R = c.row;
  const float* hp = c.hp;
  switch (rule) {
    case Rule::kCoalesce:
      return;
    case Rule::kClip: {
      float d = hp[0];
      for (int64_t k = 0; k < R; ++k) g[k] = Clip(g[k], d);
      return;
    }
    case Rule::kRowNorm: {
      float m = hp[0];
      float norm = std::sqrt(SumSquares(g, R));
      if (norm > m) {
        float f = m / norm;
        for (int64_t k = 0; k < R; ++k) g[k] *= f;
      }
      return;
    }
    case Rule::kRss: {
      float eps = hp[0];
      for (int64_t k = 0; k < R; ++k) {
        float acc = g[k] * g[k] + st[k];
        st[k] = acc;
        // As the XLA rule: (acc > 0 ? rsqrt(acc + eps) : 0) * g, so that a
        // NaN accumulator gives a NaN update (0 * NaN), as Optax does.
        float f = acc > 0.f ? 1.f / std::sqrt(acc + eps) : 0.f;
        g[k] = f * g[k];
      }
      return;
    }
    case Rule::kRowwiseRss: {
      float eps = hp[0];
      float acc = st[0] + SumSquares(g, R) / static_cast<float>(R);
      st[0] = acc;
      float denom = acc > 0.f ? std::sqrt(acc) + eps : 1.f;
      for (int64_t k = 0; k < R; ++k) g[k] = g[k] / denom;
      return;
    }
    case Rule::kAdam: {
      // hp: b1, b2, eps, eps_root, bc_mu, bc_nu, bc_mu_next, 1 - b1, 1 - b2
      float b1 = hp[0], b2 = hp[1], eps = hp[2], eps_root = hp[3];
      float bc_mu = hp[4], bc_nu = hp[5], bc_next = hp[6];
      float c1 = hp[7], c2 = hp[8];
      bool nesterov = c.nesterov;
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
    case Rule::kTrace: {
      float decay = hp[0];
      bool nesterov = c.nesterov;
      for (int64_t k = 0; k < R; ++k) {
        float t = g[k] + decay * st[k];
        st[k] = t;
        g[k] = nesterov ? g[k] + decay * t : t;
      }
      return;
    }
    case Rule::kDecay: {
      float wd = hp[0];
      for (int64_t k = 0; k < R; ++k) g[k] = g[k] + wd * p[k];
      return;
    }
    case Rule::kFtrl: {
      // hp: lr, power k (= -learning_rate_power), l1, l2, l2_shrinkage, beta
      float lr = hp[0], pw = hp[1], l1 = hp[2], l2 = hp[3], l2s = hp[4];
      float beta = hp[5];
      bool sqrt_power = c.sqrt_power;
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
    case Rule::kMaxNorm: {
      // hp: max_norm, norm_type (p; inf: the largest entry), eps (1e-7).
      // The state is the table itself: its row is scaled in place.
      float m = hp[0], p_type = hp[1], eps = hp[2];
      float norm = 0.f;
      if (std::isinf(p_type)) {
        // NaN wins, as jnp.max (std::fmax would drop it).
        for (int64_t k = 0; k < R; ++k) {
          float a = std::fabs(st[k]);
          if (a > norm || std::isnan(a)) norm = a;  // NaN stays
        }
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

// Row `id` of the parameters in float32: in place for a float32 table,
// else widened into this thread's scratch row.
template <typename P>
static inline const float* ParamRow(const P* params, int64_t id, int64_t row) {
  if constexpr (std::is_same_v<P, float>) {
    return params + id * row;
  } else {
    std::vector<float>& buf = ThreadScratch<float, kParamRow>();
    if (static_cast<int64_t>(buf.size()) < row) buf.resize(row);
    const P* p = params + id * row;
    for (int64_t k = 0; k < row; ++k) buf[k] = Widen(p[k]);
    return buf.data();
  }
}

template <typename IdT, typename P>
static void Rowwise(const Recipe<IdT>& r, Rule rule, const Ctx& c,
                    bool coalesced, bool want_sumsq, int64_t num_rows,
                    const P* params, float* state, int64_t state_row,
                    IdT* uids, float* rows, int64_t capacity,
                    int32_t* count_out, float* sumsq_out, const Threads& t) {
  int64_t total = 0;
  double ss = 0.0;
  const int64_t threads = t.For(r.num_slots);
  // With several threads each row's square sum is kept, then summed in row
  // order below: the same double sum as one thread's.
  std::vector<float>& squares = ThreadScratch<float, kSquares>();
  if (threads > 1 && want_sumsq &&
      static_cast<int64_t>(squares.size()) < capacity) {
    squares.resize(capacity);
  }
  auto rule_of = [&](int64_t j) {
    float* g = rows + j * r.row;
    if (want_sumsq) {
      float sq = SumSquares(g, r.row);
      if (threads > 1) squares[j] = sq;
      else ss += sq;
    }
    if (rule == Rule::kCoalesce) return;
    int64_t id = static_cast<int64_t>(uids[j]);
    float* st = state ? state + id * state_row : nullptr;
    const float* p = params ? ParamRow(params, id, r.row) : nullptr;
    ApplyRule(rule, c, g, st, p);
  };
  // Prefetch the state (and params) rows of distinct id j: known once the
  // ids are hashed, i.e. in the pass that sums the rows.
  auto ahead = [&](int64_t j) {
    int64_t id = static_cast<int64_t>(uids[j]);
    if (state) PrefetchRow(state + id * state_row, state_row, true);
    if (params) PrefetchRow(params + id * r.row, r.row, false);
  };
  auto on_row_prefetching = [&](int64_t j) {
    if (j + kPrefetch < total && j + kPrefetch < capacity) ahead(j + kPrefetch);
    rule_of(j);
  };
  int64_t count;
  if (coalesced) {
    count = Coalesce(r, num_rows, true, capacity, rows, uids, &total, rule_of,
                     &t, threads);
  } else if (threads > 1) {
    count = Coalesce(r, num_rows, false, capacity, rows, uids, &total,
                     on_row_prefetching, &t, threads);
  } else {
    count = Coalesce(r, num_rows, false, capacity, rows, uids, &total,
                     on_row_prefetching);
  }
  *count_out = static_cast<int32_t>(total);
  if (count < 0) {  // over capacity: the wrapper raises; nothing changed
    count = 0;
    ss = 0.0;
  } else if (threads > 1 && want_sumsq) {
    for (int64_t j = 0; j < count; ++j) ss += squares[j];
  }
  *sumsq_out = static_cast<float>(ss);
  for (int64_t j = count; j < capacity; ++j) uids[j] = static_cast<IdT>(num_rows);
}

// The state and parameter buffers against the rule's shape: [V, width]
// (width as RuleShape says; absent: an empty buffer).
static ffi::Error CheckRuleBuffers(Rule rule, int64_t row, int64_t num_rows,
                                   const F32Vector& hp,
                                   const ffi::AnyBuffer& params,
                                   const ffi::Buffer<ffi::F32>& state) {
  constexpr const char* kKernel = "rowwise";
  const RuleShape shape = ShapeOf(rule);
  if (shape.num_hp < 0) {
    return Invalid(kKernel, "unknown rule " + Str(static_cast<int32_t>(rule)));
  }
  const std::string name = std::string("rule ") + shape.name;
  if (static_cast<int64_t>(hp.element_count()) != shape.num_hp) {
    return Invalid(kKernel, name + " takes " + Str(shape.num_hp) +
                                " hyperparameters, got " +
                                Str(hp.element_count()));
  }
  if (shape.state_rows != 0) {
    const int64_t width = shape.state_rows < 0 ? 1 : shape.state_rows * row;
    if (NumRows(state) != num_rows || RowWidth(state) != width) {
      return Invalid(kKernel, name + " needs a state of " + Str(num_rows) +
                                  " rows of " + Str(width) +
                                  " floats, got " + Str(NumRows(state)) +
                                  " rows of " + Str(RowWidth(state)));
    }
  }
  if (shape.uses_params &&
      (NumRows(params) != num_rows || RowWidth(params) != row)) {
    return Invalid(kKernel, name + " needs parameters of " + Str(num_rows) +
                                " rows of " + Str(row) + " floats, got " +
                                Str(NumRows(params)) + " rows of " +
                                Str(RowWidth(params)));
  }
  return ffi::Error::Success();
}

template <ffi::DataType kId>
static ffi::Error RowwiseImpl(
    ffi::ThreadPool pool, F32Rows src, IdVector<kId> ids, BagVector bag, F32Vector weight,
    ffi::BufferR0<ffi::F32> scale, F32Vector hp, ffi::AnyBuffer params,
    ffi::Buffer<ffi::F32> state, ffi::Result<ffi::Buffer<ffi::F32>> state_out,
    ffi::ResultBufferR1<kId> uids, ffi::ResultBufferR2<ffi::F32> rows,
    ffi::ResultBufferR0<ffi::S32> count, ffi::ResultBufferR0<ffi::F32> sumsq,
    Rule rule, bool has_bag, bool has_weight, bool coalesced, bool want_sumsq,
    bool nesterov, bool sqrt_power, int64_t length, int64_t num_rows,
    int64_t threads, int64_t min_slots) {
  constexpr const char* kKernel = "rowwise";
  const int64_t row = src.dimensions()[1];
  const int64_t capacity = rows->dimensions()[0];
  if (rows->dimensions()[1] != row ||
      static_cast<int64_t>(uids->element_count()) != capacity) {
    return Invalid(kKernel, "outputs of " + Str(uids->element_count()) +
                                " ids and " + Str(capacity) + " rows of " +
                                Str(rows->dimensions()[1]) +
                                " floats for gradient rows of " + Str(row));
  }
  if (capacity > static_cast<int64_t>(ids.element_count())) {
    return Invalid(kKernel, "capacity " + Str(capacity) + " > " +
                                Str(ids.element_count()) + " ids");
  }
  if (auto e = CheckRuleBuffers(rule, row, num_rows, hp, params, state);
      !e.success()) {
    return e;
  }
  Recipe<IdOf<kId>> r{};
  if (auto e = MakeRecipe(kKernel, src, ids, bag, weight, *scale.typed_data(),
                          has_bag, has_weight, length, &r);
      !e.success()) {
    return e;
  }
  const RuleShape shape = ShapeOf(rule);
  float* st = shape.state_rows != 0 ? InPlaceAny<float>(state, state_out) : nullptr;
  Ctx c{row, hp.typed_data(), nesterov, sqrt_power};
  return WithTableType(kKernel, params.element_type(), [&](auto tag) {
    using P = decltype(tag);
    Rowwise(r, rule, c, coalesced, want_sumsq, num_rows,
            shape.uses_params ? static_cast<const P*>(params.untyped_data()) : nullptr,
            st, st ? RowWidth(state) : 0, uids->typed_data(), rows->typed_data(),
            capacity, count->typed_data(), sumsq->typed_data(),
            Threads{&pool, threads, min_slots});
    return ffi::Error::Success();
  });
}

template <ffi::DataType kId>
static auto RowwiseBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()          // XLA's intra-op pool
      .Arg<F32Rows>()                  // src [M, R]
      .Arg<IdVector<kId>>()            // ids [N]
      .template Arg<BagVector>()                // bag [N] or []
      .template Arg<F32Vector>()                // weight [N] or []
      .template Arg<ffi::BufferR0<ffi::F32>>()  // scale
      .template Arg<F32Vector>()                // hp [H]
      .template Arg<ffi::AnyBuffer>()           // params [V, *row] (f32, bf16, f16) or []
      .template Arg<ffi::Buffer<ffi::F32>>()    // state [V, *srow] or []
      .template Ret<ffi::Buffer<ffi::F32>>()    // state (aliased)
      .template Ret<ffi::BufferR1<kId>>()       // uids [K]
      .template Ret<ffi::BufferR2<ffi::F32>>()  // rows [K, R]
      .template Ret<ffi::BufferR0<ffi::S32>>()  // count
      .template Ret<ffi::BufferR0<ffi::F32>>()  // sumsq
      .template Attr<Rule>("rule")
      .template Attr<bool>("has_bag")
      .template Attr<bool>("has_weight")
      .template Attr<bool>("coalesced")
      .template Attr<bool>("want_sumsq")
      .template Attr<bool>("nesterov")
      .template Attr<bool>("sqrt_power")
      .template Attr<int64_t>("length")
      .template Attr<int64_t>("num_rows")
      .template Attr<int64_t>("threads")
      .template Attr<int64_t>("min_slots");
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesRowwiseS32,
                              jaxslices::RowwiseImpl<xla::ffi::S32>,
                              jaxslices::RowwiseBinding<xla::ffi::S32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesRowwiseS64,
                              jaxslices::RowwiseImpl<xla::ffi::S64>,
                              jaxslices::RowwiseBinding<xla::ffi::S64>());
