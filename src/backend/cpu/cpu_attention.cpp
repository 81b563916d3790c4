// CPU reference of the fused scaled dot-product attention contract (Backend::sdpa_forward /
// sdpa_backward): plain loops in double, one query row at a time, probabilities rebuilt from the
// saved logsumexp in backward exactly as a flash kernel does. It exists so the fused path's
// plumbing (stats, padding and kv-chunk routes, the gradient rule) is tested on machines without a
// GPU, against the math path and by float64 gradcheck; it is not meant to be fast.
#include <cmath>
#include <limits>
#include <vector>

#include "flame/grad_mode.h"
#include "src/backend/cpu/cpu_backend.h"

namespace flame::backend::cpu {

namespace {

// A [B, H, N, D] operand as contiguous doubles (bias: expanded to [B, H, L, S] first).
struct Dense {
  std::vector<double> v;
  int64_t n = 0, d = 0;  // rows per head, row length
  const double* row(int64_t bh, int64_t i) const { return v.data() + (bh * n + i) * d; }
};

Dense dense(const Tensor& t) {
  NoGradGuard no_grad;
  const Tensor c = t.to(DType::f64).contiguous();
  Dense r;
  r.n = t.size(2);
  r.d = t.size(3);
  const double* p = static_cast<const double*>(c.data_ptr());
  r.v.assign(p, p + c.numel());
  return r;
}

// Writes doubles laid out as [B, H, N, D] into `dst` (any strides and floating dtype).
void store(CpuBackend& be, const Tensor& dst, const std::vector<double>& values) {
  const Tensor src = Tensor::from_vec(values, dst.sizes());
  be.copy(dst, src);
}

struct Problem {
  int64_t bh, l, s, e, ev;
  Dense q, k, v, bias;
  bool has_bias;
  double scale;
  bool causal;

  Problem(const Tensor& tq, const Tensor& tk, const Tensor& tv, const Tensor& tbias, double sc, bool ca)
      : q(dense(tq)), k(dense(tk)), v(dense(tv)), has_bias(tbias.defined()), scale(sc), causal(ca) {
    bh = tq.size(0) * tq.size(1);
    l = tq.size(2);
    s = tk.size(2);
    e = tq.size(3);
    ev = tv.size(3);
    if (has_bias) bias = dense(tbias.expand({tq.size(0), tq.size(1), l, s}));
  }
  // Scaled, biased score of query i and key j of head h (-inf where the causal mask hides j).
  double score(int64_t h, int64_t i, int64_t j) const {
    if (causal && j > i) return -std::numeric_limits<double>::infinity();
    const double* qi = q.row(h, i);
    const double* kj = k.row(h, j);
    double acc = 0;
    for (int64_t c = 0; c < e; ++c) acc += qi[c] * kj[c];
    acc *= scale;
    if (has_bias) acc += bias.row(h, i)[j];
    return acc;
  }
};

}  // namespace

void CpuBackend::sdpa_forward(const Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& bias, double scale, bool causal) {
  const Problem p(q, k, v, bias, scale, causal);
  std::vector<double> o(static_cast<std::size_t>(p.bh * p.l * p.ev), 0.0);
  std::vector<double> lse(static_cast<std::size_t>(p.bh * p.l), 0.0);
  std::vector<double> sc(static_cast<std::size_t>(p.s));
  for (int64_t h = 0; h < p.bh; ++h) {
    for (int64_t i = 0; i < p.l; ++i) {
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < p.s; ++j) m = std::max(m, sc[j] = p.score(h, i, j));
      double* oi = o.data() + (h * p.l + i) * p.ev;
      if (std::isinf(m) && m < 0) {  // every key hidden: output 0, stats -inf
        lse[h * p.l + i] = m;
        continue;
      }
      double z = 0;
      for (int64_t j = 0; j < p.s; ++j) z += std::exp(sc[j] - m);
      const double l = m + std::log(z);
      lse[h * p.l + i] = l;
      for (int64_t j = 0; j < p.s; ++j) {
        const double pj = std::exp(sc[j] - l);
        const double* vj = p.v.row(h, j);
        for (int64_t c = 0; c < p.ev; ++c) oi[c] += pj * vj[c];
      }
    }
  }
  store(*this, out, o);
  store(*this, stats, lse);
}

void CpuBackend::sdpa_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& stats,
                               const Tensor& bias, double scale, bool causal, Tensor* /*column_sums*/) {
  const Problem p(q, k, v, bias, scale, causal);
  const Dense o = dense(out), g = dense(dout), st = dense(stats);
  std::vector<double> gq(static_cast<std::size_t>(p.bh * p.l * p.e), 0.0);
  std::vector<double> gk(static_cast<std::size_t>(p.bh * p.s * p.e), 0.0);
  std::vector<double> gv(static_cast<std::size_t>(p.bh * p.s * p.ev), 0.0);
  for (int64_t h = 0; h < p.bh; ++h) {
    for (int64_t i = 0; i < p.l; ++i) {
      const double lse = st.row(h, i)[0];
      if (std::isinf(lse) && lse < 0) continue;  // a fully hidden row has no gradient
      const double* gi = g.row(h, i);
      const double* oi = o.row(h, i);
      double delta = 0;  // rowsum(dO * O): the softmax backward's correction term
      for (int64_t c = 0; c < p.ev; ++c) delta += gi[c] * oi[c];
      const double* qi = p.q.row(h, i);
      double* gqi = gq.data() + (h * p.l + i) * p.e;
      for (int64_t j = 0; j < p.s; ++j) {
        const double pj = std::exp(p.score(h, i, j) - lse);
        if (pj == 0) continue;
        const double* vj = p.v.row(h, j);
        double dp = 0;
        for (int64_t c = 0; c < p.ev; ++c) dp += gi[c] * vj[c];
        const double ds = pj * (dp - delta) * scale;
        double* gvj = gv.data() + (h * p.s + j) * p.ev;
        for (int64_t c = 0; c < p.ev; ++c) gvj[c] += pj * gi[c];
        const double* kj = p.k.row(h, j);
        double* gkj = gk.data() + (h * p.s + j) * p.e;
        for (int64_t c = 0; c < p.e; ++c) {
          gqi[c] += ds * kj[c];
          gkj[c] += ds * qi[c];
        }
      }
    }
  }
  store(*this, dq, gq);
  store(*this, dk, gk);
  store(*this, dv, gv);
}

}  // namespace flame::backend::cpu
