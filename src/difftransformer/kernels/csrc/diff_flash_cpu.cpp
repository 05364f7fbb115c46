// Fused differential flash attention for CPU, fp32: forward and backward in one pass each.
//
// Why: PyTorch's CPU flash kernel needs q, k and v to share one head dim, so the `sdpa` backend
// zero-pads q/k (dim d) to v's dim 2d and pays 2x the baseline's attention FLOPs. Here each
// (batch, DIFF head, query block) keeps two online-softmax states and multiplies both maps with
// one read of each V tile; the backward uses dP2 = -lam * dP1 and dV = (A1 - lam A2)^T dO, so it
// costs what one baseline backward costs. Block products go to the BLAS ATen uses (MKL here),
// the row-wise softmax work is vectorised with ATen's Vectorized<float>.
//
// Layout (B batch, h DIFF heads, h_kv kv groups, n_rep = h / h_kv, T queries, S keys, d):
//   q (B, 2h, T, d) striped: component c of head i at 2i + c;  k (B, 2h_kv, S, d);  v (B, h_kv, S, 2d)
//   out, o2 (B, h, T, 2d): out = A1 V - lam A2 V, o2 = A2 V (saved for the backward)
// Any strides are read in place as long as the last dim is dense (the layer's q, k, v are
// transposed views of the projections).
//   lse1, lse2 (B, h, T): log-sum-exp of each map's scaled scores; +inf for a row that sees no key
// Causal masks are bottom-right aligned: query t sees keys j <= t + S - T. key_mask (B, S) bool,
// True = keep. A query that sees no key outputs zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The BLAS PyTorch is linked against (MKL on x86 wheels) exports the Fortran sgemm_; ATen's own
// float gemm wrapper is not exported to extensions. Weak, so a build without it still loads and
// falls back to at::mm on the same memory.
extern "C" __attribute__((weak)) void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                                             const int* k, const float* alpha, const float* a, const int* lda,
                                             const float* b, const int* ldb, const float* beta, float* c,
                                             const int* ldc);

// Row-major C (M x N) = alpha * op(A) op(B) + beta * C, through column-major BLAS (C^T = B^T A^T).
inline void mm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (sgemm_ != nullptr) {
    const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    sgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return;
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto a = trans_a ? at::from_blob(const_cast<float*>(A), {K, M}, {lda, 1}, opts).t()
                   : at::from_blob(const_cast<float*>(A), {M, K}, {lda, 1}, opts);
  auto b = trans_b ? at::from_blob(const_cast<float*>(B), {N, K}, {ldb, 1}, opts).t()
                   : at::from_blob(const_cast<float*>(B), {K, N}, {ldb, 1}, opts);
  auto c = at::from_blob(C, {M, N}, {ldc, 1}, opts);
  if (beta == 0.f) {
    at::mm_out(c, a, b);
    if (alpha != 1.f) c.mul_(alpha);
  } else {
    c.addmm_(a, b, beta, alpha);
  }
}

inline float row_max(const float* x, int64_t n) {
  int64_t j = 0;
  float m = kNegInf;
  if (n >= Vec::size()) {
    Vec vm(kNegInf);
    for (; j + Vec::size() <= n; j += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + j));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// x = exp(x - m) in place; returns the sum. Entries at -inf become 0.
inline float exp_sub_sum(float* x, int64_t n, float m) {
  const Vec vm(m);
  Vec vs(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec e = (Vec::loadu(x + j) - vm).exp_u20();
    e.store(x + j);
    vs = vs + e;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vs);
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    s += x[j];
  }
  return s;
}

// x = exp(x - m) in place (no sum), m may be +inf (row sees nothing): then all zeros.
inline void exp_sub(float* x, int64_t n, float m) {
  if (m == kInf) {
    std::fill(x, x + n, 0.f);
    return;
  }
  const Vec vm(m);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) - vm).exp_u20().store(x + j);
  for (; j < n; ++j) x[j] = std::exp(x[j] - m);
}

inline void scale_row(float* x, int64_t n, float a) {
  const Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * va).store(x + j);
  for (; j < n; ++j) x[j] *= a;
}

// Number of keys in [j0, j0 + bk) that query t may see (causal part only).
inline int64_t causal_visible(bool causal, int64_t t, int64_t T, int64_t S, int64_t j0, int64_t bk) {
  if (!causal) return bk;
  return std::clamp<int64_t>(t + S - T + 1 - j0, 0, bk);
}

// Set the scores of invisible keys of one row (bk scores for keys j0..j0+bk) to -inf.
inline void mask_row(float* row, int64_t nvis, int64_t bk, const bool* keep, int64_t j0) {
  std::fill(row + nvis, row + bk, kNegInf);
  if (keep != nullptr)
    for (int64_t j = 0; j < nvis; ++j)
      if (!keep[j0 + j]) row[j] = kNegInf;
}

// One past the last key any query in [t0, t0 + bq) may see.
inline int64_t key_end(bool causal, int64_t t0, int64_t bq, int64_t T, int64_t S) {
  return causal ? std::clamp<int64_t>(t0 + bq + S - T, 0, S) : S;
}

// Strides (in elements) of a (batch, head, length, dim) tensor whose last dim is dense.
struct Strides {
  int64_t b, h, t;
  explicit Strides(const at::Tensor& x) : b(x.stride(0)), h(x.stride(1)), t(x.stride(2)) {}
  int64_t at(int64_t bi, int64_t hi, int64_t ti) const { return bi * b + hi * h + ti * t; }
};

struct Shape {
  int64_t B, h, h_kv, n_rep, T, S, d;
};

inline bool rows_dense(const at::Tensor& x) { return x.size(-1) <= 1 || x.stride(-1) == 1; }

Shape check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& key_mask) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "diff_flash_cpu: q, k, v must be CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "diff_flash_cpu: q, k, v must be float32 (the Python wrapper upcasts other dtypes)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "diff_flash_cpu: q, k, v must be 4-D");
  TORCH_CHECK(rows_dense(q) && rows_dense(k) && rows_dense(v),
              "diff_flash_cpu: the last dim of q, k, v must be contiguous (stride 1)");
  Shape s{q.size(0), q.size(1) / 2, k.size(1) / 2, 0, q.size(2), k.size(2), q.size(3)};
  TORCH_CHECK(q.size(1) % 2 == 0 && k.size(1) % 2 == 0 && s.h_kv > 0 && s.h % s.h_kv == 0,
              "diff_flash_cpu: head axes must be even and h must split evenly over h_kv");
  TORCH_CHECK(k.size(0) == s.B && k.size(3) == s.d && v.size(0) == s.B && v.size(1) == s.h_kv &&
                  v.size(2) == s.S && v.size(3) == 2 * s.d,
              "diff_flash_cpu: expected k (B, 2h_kv, S, d) and v (B, h_kv, S, 2d)");
  if (key_mask.has_value()) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->is_contiguous() && key_mask->dim() == 2 &&
                    key_mask->size(0) == s.B && key_mask->size(1) == s.S,
                "diff_flash_cpu: key_mask must be a contiguous bool (B, S) tensor");
  }
  s.n_rep = s.h / s.h_kv;
  return s;
}

// (B, h, T, 2d) stored as (B, T, h, 2d): the layer's transpose(1, 2).reshape(B, T, h * 2d)
// before the output projection is then free.
at::Tensor new_out(const Shape& s, const at::TensorOptions& opts) {
  return at::empty({s.B, s.T, s.h, 2 * s.d}, opts).transpose(1, 2);
}

// Query and key block sizes: large enough for efficient BLAS calls, small enough that the
// score tiles of both maps (2 * BQ * BK floats) stay in L2.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 256;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> diff_flash_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lam, bool causal,
    double scale, const std::optional<at::Tensor>& key_mask) {
  const Shape s = check_inputs(q, k, v, key_mask);
  const int64_t d = s.d, dv = 2 * s.d, T = s.T, S = s.S;
  auto out = new_out(s, q.options());
  auto o2 = new_out(s, q.options());
  auto lse1 = at::empty({s.B, s.h, T}, q.options());
  auto lse2 = at::empty({s.B, s.h, T}, q.options());
  if (out.numel() == 0) {
    lse1.fill_(kInf);
    lse2.fill_(kInf);
    return {out.zero_(), o2.zero_(), lse1, lse2};
  }
  const float lambda = lam.item<float>();
  const float sc = static_cast<float>(scale);
  const Strides sq(q), sk(k), sv(v), so(out);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = key_mask.has_value() ? key_mask->data_ptr<bool>() : nullptr;
  float* outp = out.data_ptr<float>();
  float* o2p = o2.data_ptr<float>();
  float* lse1p = lse1.data_ptr<float>();
  float* lse2p = lse2.data_ptr<float>();
  const int64_t nqb = (T + kBlockQ - 1) / kBlockQ;

  at::parallel_for(0, s.B * s.h * nqb, 1, [&](int64_t begin, int64_t end) {
    // Scores of both maps as one (2 bq, BK) matrix and both accumulators as one (2 bq, 2d)
    // matrix, so that P V is a single BLAS call per key block.
    std::vector<float> sbuf(2 * kBlockQ * kBlockK), acc(2 * kBlockQ * dv), mrow(2 * kBlockQ), lrow(2 * kBlockQ);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / (s.h * nqb), i = (idx / nqb) % s.h, t0 = (idx % nqb) * kBlockQ;
      const int64_t bq = std::min(kBlockQ, T - t0), g = i / s.n_rep;
      const float* q1 = qp + sq.at(b, 2 * i, t0);
      const float* q2 = qp + sq.at(b, 2 * i + 1, t0);
      const float* k1 = kp + sk.at(b, 2 * g, 0);
      const float* k2 = kp + sk.at(b, 2 * g + 1, 0);
      const float* vv = vp + sv.at(b, g, 0);
      const bool* keep = mp == nullptr ? nullptr : mp + b * S;
      std::fill(mrow.begin(), mrow.begin() + 2 * bq, kNegInf);
      std::fill(lrow.begin(), lrow.begin() + 2 * bq, 0.f);
      std::fill(acc.begin(), acc.begin() + 2 * bq * dv, 0.f);
      const int64_t kend = key_end(causal, t0, bq, T, S);
      for (int64_t j0 = 0; j0 < kend; j0 += kBlockK) {
        const int64_t bk = std::min(kBlockK, kend - j0);
        float* s1 = sbuf.data();
        float* s2 = s1 + bq * kBlockK;
        mm(false, true, bq, bk, d, sc, q1, sq.t, k1 + j0 * sk.t, sk.t, 0.f, s1, kBlockK);
        mm(false, true, bq, bk, d, sc, q2, sq.t, k2 + j0 * sk.t, sk.t, 0.f, s2, kBlockK);
        for (int64_t r = 0; r < 2 * bq; ++r) {
          float* row = sbuf.data() + r * kBlockK;
          const int64_t t = t0 + (r % bq);
          const int64_t nvis = causal_visible(causal, t, T, S, j0, bk);
          if (nvis < bk || keep != nullptr) mask_row(row, nvis, bk, keep, j0);
          const float m_new = std::max(mrow[r], row_max(row, bk));
          if (m_new == kNegInf) {  // nothing visible to this row so far
            std::fill(row, row + bk, 0.f);
            continue;
          }
          const float rescale = std::exp(mrow[r] - m_new);
          lrow[r] = lrow[r] * rescale + exp_sub_sum(row, bk, m_new);
          if (rescale != 1.f) scale_row(acc.data() + r * dv, dv, rescale);
          mrow[r] = m_new;
        }
        mm(false, false, 2 * bq, dv, bk, 1.f, sbuf.data(), kBlockK, vv + j0 * sv.t, sv.t, 1.f, acc.data(), dv);
      }
      float* l1 = lse1p + (b * s.h + i) * T + t0;
      float* l2 = lse2p + (b * s.h + i) * T + t0;
      for (int64_t r = 0; r < bq; ++r) {
        const float inv1 = lrow[r] > 0.f ? 1.f / lrow[r] : 0.f;
        const float inv2 = lrow[bq + r] > 0.f ? 1.f / lrow[bq + r] : 0.f;
        l1[r] = lrow[r] > 0.f ? mrow[r] + std::log(lrow[r]) : kInf;
        l2[r] = lrow[bq + r] > 0.f ? mrow[bq + r] + std::log(lrow[bq + r]) : kInf;
        const float* a1 = acc.data() + r * dv;
        const float* a2 = acc.data() + (bq + r) * dv;
        float* o = outp + so.at(b, i, t0 + r);
        float* o2r = o2p + so.at(b, i, t0 + r);
        const Vec vi1(inv1), vi2(inv2), vl(lambda);
        int64_t c = 0;
        for (; c + Vec::size() <= dv; c += Vec::size()) {
          const Vec x2 = Vec::loadu(a2 + c) * vi2;
          x2.store(o2r + c);
          (Vec::loadu(a1 + c) * vi1 - vl * x2).store(o + c);
        }
        for (; c < dv; ++c) {
          o2r[c] = a2[c] * inv2;
          o[c] = a1[c] * inv1 - lambda * o2r[c];
        }
      }
    }
  });
  return {out, o2, lse1, lse2};
}

// Gradients of q, and of k and v per DIFF head (dk_h (B, h, 2, S, d), dv_h (B, h, S, 2d)):
// each (batch, head) task owns its slices, so there are no races and the result is deterministic;
// the caller sums dk_h and dv_h over the n_rep heads of a kv group.
// d1 = rowsum(dO * A1 V), d2 = rowsum(dO * A2 V), each (B, h, T) contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> diff_flash_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& lam, const at::Tensor& lse1, const at::Tensor& lse2, const at::Tensor& d1,
    const at::Tensor& d2, bool causal, double scale, const std::optional<at::Tensor>& key_mask) {
  const Shape s = check_inputs(q, k, v, key_mask);
  const int64_t d = s.d, dv = 2 * s.d, T = s.T, S = s.S;
  TORCH_CHECK(dout.scalar_type() == at::kFloat && dout.dim() == 4 && rows_dense(dout) && dout.size(0) == s.B &&
                  dout.size(1) == s.h && dout.size(2) == T && dout.size(3) == dv,
              "diff_flash_cpu: dout must be float32 (B, h, T, 2d) with a contiguous last dim");
  TORCH_CHECK(lse1.is_contiguous() && lse2.is_contiguous() && d1.is_contiguous() && d2.is_contiguous(),
              "diff_flash_cpu: row statistics must be contiguous");
  auto dq = at::empty({s.B, T, 2 * s.h, d}, q.options()).transpose(1, 2);  // the layer's q layout
  auto dk = at::zeros({s.B, s.h, 2, S, d}, q.options());
  auto dvh = at::zeros({s.B, s.h, S, dv}, q.options());
  dq.zero_();
  if (dq.numel() == 0 || dk.numel() == 0) return {dq, dk, dvh};
  const float lambda = lam.item<float>();
  const float sc = static_cast<float>(scale);
  const Strides sq(q), sk(k), sv(v), sdo(dout), sdq(dq);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* dop = dout.data_ptr<float>();
  const float* lse1p = lse1.data_ptr<float>();
  const float* lse2p = lse2.data_ptr<float>();
  const float* d1p = d1.data_ptr<float>();
  const float* d2p = d2.data_ptr<float>();
  const bool* mp = key_mask.has_value() ? key_mask->data_ptr<bool>() : nullptr;
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dvh.data_ptr<float>();

  at::parallel_for(0, s.B * s.h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(2 * kBlockQ * kBlockK), dp(kBlockQ * kBlockK), pd(kBlockQ * kBlockK);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / s.h, i = idx % s.h, g = i / s.n_rep;
      const float* k1 = kp + sk.at(b, 2 * g, 0);
      const float* k2 = kp + sk.at(b, 2 * g + 1, 0);
      const float* vv = vp + sv.at(b, g, 0);
      float* dk1 = dkp + (b * s.h + i) * 2 * S * d;
      float* dk2 = dk1 + S * d;
      float* dvv = dvp + (b * s.h + i) * S * dv;
      const bool* keep = mp == nullptr ? nullptr : mp + b * S;
      for (int64_t t0 = 0; t0 < T; t0 += kBlockQ) {
        const int64_t bq = std::min(kBlockQ, T - t0);
        const float* q1 = qp + sq.at(b, 2 * i, t0);
        const float* q2 = qp + sq.at(b, 2 * i + 1, t0);
        float* dq1 = dqp + sdq.at(b, 2 * i, t0);
        float* dq2 = dqp + sdq.at(b, 2 * i + 1, t0);
        const float* dO = dop + sdo.at(b, i, t0);
        const int64_t row0 = (b * s.h + i) * T + t0;
        const int64_t kend = key_end(causal, t0, bq, T, S);
        for (int64_t j0 = 0; j0 < kend; j0 += kBlockK) {
          const int64_t bk = std::min(kBlockK, kend - j0);
          float* p1 = p.data();
          float* p2 = p1 + kBlockQ * kBlockK;
          const float* k1b = k1 + j0 * sk.t;
          const float* k2b = k2 + j0 * sk.t;
          mm(false, true, bq, bk, d, sc, q1, sq.t, k1b, sk.t, 0.f, p1, kBlockK);
          mm(false, true, bq, bk, d, sc, q2, sq.t, k2b, sk.t, 0.f, p2, kBlockK);
          mm(false, true, bq, bk, dv, 1.f, dO, sdo.t, vv + j0 * sv.t, sv.t, 0.f, dp.data(), kBlockK);
          for (int64_t r = 0; r < bq; ++r) {
            const int64_t nvis = causal_visible(causal, t0 + r, T, S, j0, bk);
            float* r1 = p1 + r * kBlockK;
            float* r2 = p2 + r * kBlockK;
            if (nvis < bk || keep != nullptr) {
              mask_row(r1, nvis, bk, keep, j0);
              mask_row(r2, nvis, bk, keep, j0);
            }
            exp_sub(r1, bk, lse1p[row0 + r]);
            exp_sub(r2, bk, lse2p[row0 + r]);
            // pd = P1 - lam P2 (for dV); then P1 <- dS1 = P1 (dP - D1), P2 <- dS2 = -lam P2 (dP - D2)
            float* rpd = pd.data() + r * kBlockK;
            const float* rdp = dp.data() + r * kBlockK;
            const float d1r = d1p[row0 + r], d2r = d2p[row0 + r];
            const Vec vl(lambda), vd1(d1r), vd2(d2r), vnl(-lambda);
            int64_t j = 0;
            for (; j + Vec::size() <= bk; j += Vec::size()) {
              const Vec a1 = Vec::loadu(r1 + j), a2 = Vec::loadu(r2 + j), gr = Vec::loadu(rdp + j);
              (a1 - vl * a2).store(rpd + j);
              (a1 * (gr - vd1)).store(r1 + j);
              (vnl * a2 * (gr - vd2)).store(r2 + j);
            }
            for (; j < bk; ++j) {
              const float a1 = r1[j], a2 = r2[j], gr = rdp[j];
              rpd[j] = a1 - lambda * a2;
              r1[j] = a1 * (gr - d1r);
              r2[j] = -lambda * a2 * (gr - d2r);
            }
          }
          mm(true, false, bk, dv, bq, 1.f, pd.data(), kBlockK, dO, sdo.t, 1.f, dvv + j0 * dv, dv);
          mm(false, false, bq, d, bk, sc, p1, kBlockK, k1b, sk.t, 1.f, dq1, sdq.t);
          mm(false, false, bq, d, bk, sc, p2, kBlockK, k2b, sk.t, 1.f, dq2, sdq.t);
          mm(true, false, bk, d, bq, sc, p1, kBlockK, q1, sq.t, 1.f, dk1 + j0 * d, d);
          mm(true, false, bk, d, bq, sc, p2, kBlockK, q2, sq.t, 1.f, dk2 + j0 * d, d);
        }
      }
    }
  });
  return {dq, dk, dvh};
}

}  // namespace

TORCH_LIBRARY(difftransformer_cpu, m) {
  m.def("diff_flash_fwd(Tensor q, Tensor k, Tensor v, Tensor lam, bool causal, float scale, Tensor? key_mask)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("diff_flash_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor lam, Tensor lse1, Tensor lse2,"
        " Tensor d1, Tensor d2, bool causal, float scale, Tensor? key_mask) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(difftransformer_cpu, CPU, m) {
  m.impl("diff_flash_fwd", &diff_flash_fwd);
  m.impl("diff_flash_bwd", &diff_flash_bwd);
}
