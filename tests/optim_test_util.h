#pragma once
// Shared pieces of the optimizer tests: a fixed problem (parameters of odd sizes in two groups,
// gradients drawn once per step, one parameter without a gradient every third step), a runner
// that feeds it to a FLAME optimizer, and an independent float64 implementation of every
// optimizer written from the PyTorch documentation formulas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "flame/flame.h"
#include "flame/optim/optimizers.h"

namespace flame::test::optim_ref {

using Vec = std::vector<double>;

struct Problem {
  std::vector<Shape> shapes;
  std::vector<Vec> init;
  std::vector<std::vector<Vec>> grads;  // [step][param]; empty: no gradient in that step
  int steps = 0;
};

inline int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Parameters 0, 1 form group 0; 2, 3 group 1. Parameter 3 has no gradient in steps 1, 4, 7, ...
inline Problem make_problem(int steps = 20, uint64_t seed = 7, bool round_bf16 = false) {
  Problem pb;
  pb.shapes = {{7}, {5, 3}, {2, 3, 5}, {3, 4}};
  pb.steps = steps;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  auto draw = [&](const Shape& s, double scale) {
    Vec v(static_cast<std::size_t>(numel_of(s)));
    for (double& x : v) {
      x = scale * nd(rng);
      if (round_bf16) x = static_cast<double>(static_cast<float>(bfloat16(static_cast<float>(x))));
    }
    return v;
  };
  for (const Shape& s : pb.shapes) pb.init.push_back(draw(s, 1.0));
  for (int t = 0; t < steps; ++t) {
    std::vector<Vec> g;
    for (std::size_t i = 0; i < pb.shapes.size(); ++i)
      g.push_back(i == 3 && t % 3 == 1 ? Vec{} : draw(pb.shapes[i], 0.5 + 0.25 * static_cast<double>(i)));
    pb.grads.push_back(std::move(g));
  }
  return pb;
}

// Hyperparameters of one reference run; per-group values in [g].
struct Config {
  double lr[2] = {1e-2, 3e-2};
  double wd[2] = {0.0, 0.0};
  double momentum[2] = {0.0, 0.0};
  double dampening[2] = {0.0, 0.0};
  double beta1[2] = {0.9, 0.9};
  double beta2[2] = {0.999, 0.999};
  double eps[2] = {1e-8, 1e-8};
  double beta2_decay = -0.8, d = 1.0, eps1 = 1e-30;  // Adafactor (eps is eps2)
  bool nesterov = false, maximize = false, amsgrad = false;
};

enum class Kind { sgd, adam, adamw, lion, adafactor };

inline int group_of(std::size_t i) { return i < 2 ? 0 : 1; }

// Runs the problem through the float64 reference; returns the parameters after pb.steps steps.
inline std::vector<Vec> reference(Kind kind, const Config& c, const Problem& pb, int steps = -1) {
  if (steps < 0) steps = pb.steps;
  const std::size_t n = pb.shapes.size();
  std::vector<Vec> p = pb.init, m(n), v(n), vmax(n), row(n), col(n);
  std::vector<int> t(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    m[i] = v[i] = vmax[i] = Vec(p[i].size(), 0.0);
  }
  for (int s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < n; ++i) {
      if (pb.grads[s][i].empty()) continue;
      const int gi = group_of(i);
      const double lr = c.lr[gi], wd = c.wd[gi];
      ++t[i];
      Vec g = pb.grads[s][i];
      if (c.maximize)
        for (double& x : g) x = -x;
      const std::size_t N = g.size();
      if (kind == Kind::sgd) {
        for (std::size_t k = 0; k < N; ++k) {
          double d = g[k] + wd * p[i][k];
          if (c.momentum[gi] != 0.0) {
            m[i][k] = t[i] == 1 ? d : c.momentum[gi] * m[i][k] + (1.0 - c.dampening[gi]) * d;
            d = c.nesterov ? d + c.momentum[gi] * m[i][k] : m[i][k];
          }
          p[i][k] -= lr * d;
        }
      } else if (kind == Kind::adam || kind == Kind::adamw) {
        const double b1 = c.beta1[gi], b2 = c.beta2[gi];
        const double bc1 = 1.0 - std::pow(b1, t[i]), bc2 = 1.0 - std::pow(b2, t[i]);
        for (std::size_t k = 0; k < N; ++k) {
          double d = g[k];
          if (kind == Kind::adamw) p[i][k] *= 1.0 - lr * wd;
          else d += wd * p[i][k];
          m[i][k] = b1 * m[i][k] + (1.0 - b1) * d;
          v[i][k] = b2 * v[i][k] + (1.0 - b2) * d * d;
          vmax[i][k] = std::max(vmax[i][k], v[i][k]);
          const double vv = c.amsgrad ? vmax[i][k] : v[i][k];
          p[i][k] -= lr * (m[i][k] / bc1) / (std::sqrt(vv / bc2) + c.eps[gi]);
        }
      } else if (kind == Kind::lion) {
        const double b1 = c.beta1[gi], b2 = c.beta2[gi];
        for (std::size_t k = 0; k < N; ++k) {
          p[i][k] *= 1.0 - lr * wd;
          const double u = b1 * m[i][k] + (1.0 - b1) * g[k];
          p[i][k] -= lr * (u > 0 ? 1.0 : (u < 0 ? -1.0 : 0.0));
          m[i][k] = b2 * m[i][k] + (1.0 - b2) * g[k];
        }
      } else {  // Adafactor, torch.optim.Adafactor's documented algorithm
        const double beta = std::pow(static_cast<double>(t[i]), c.beta2_decay);  // 1 - beta2_t
        const double rho = std::min(lr, 1.0 / std::sqrt(static_cast<double>(t[i])));
        double ss = 0;
        for (double x : p[i]) ss += x * x;
        const double alpha = std::max(c.eps[gi], std::sqrt(ss / static_cast<double>(N))) * rho;
        for (double& x : p[i]) x *= 1.0 - lr * wd;
        Vec est(N);
        const Shape& sh = pb.shapes[i];
        if (sh.size() >= 2) {
          const int64_t R = sh[sh.size() - 2], C = sh.back(), B = static_cast<int64_t>(N) / (R * C);
          if (row[i].empty()) {
            row[i] = Vec(static_cast<std::size_t>(B * R), 0.0);
            col[i] = Vec(static_cast<std::size_t>(B * C), 0.0);
          }
          for (int64_t b = 0; b < B; ++b) {
            for (int64_t r = 0; r < R; ++r) {
              double acc = 0;
              for (int64_t q = 0; q < C; ++q) acc += g[(b * R + r) * C + q] * g[(b * R + r) * C + q];
              double& rv = row[i][b * R + r];
              rv = (1.0 - beta) * rv + beta * (acc / static_cast<double>(C));
            }
            for (int64_t q = 0; q < C; ++q) {
              double acc = 0;
              for (int64_t r = 0; r < R; ++r) acc += g[(b * R + r) * C + q] * g[(b * R + r) * C + q];
              double& cv = col[i][b * C + q];
              cv = (1.0 - beta) * cv + beta * (acc / static_cast<double>(R));
            }
            double row_mean = 0;
            for (int64_t r = 0; r < R; ++r) row_mean += row[i][b * R + r];
            row_mean = std::max(row_mean / static_cast<double>(R), c.eps1);
            for (int64_t r = 0; r < R; ++r)
              for (int64_t q = 0; q < C; ++q)
                est[(b * R + r) * C + q] = row[i][b * R + r] * col[i][b * C + q] / row_mean;
          }
        } else {
          for (std::size_t k = 0; k < N; ++k) {
            v[i][k] = (1.0 - beta) * v[i][k] + beta * g[k] * g[k];
            est[k] = v[i][k];
          }
        }
        Vec u(N);
        double us = 0;
        for (std::size_t k = 0; k < N; ++k) {
          u[k] = g[k] / std::sqrt(std::max(est[k], c.eps1 * c.eps1));
          us += u[k] * u[k];
        }
        const double denom = std::max(1.0, std::sqrt(us / static_cast<double>(N)) / c.d);
        for (std::size_t k = 0; k < N; ++k) p[i][k] -= alpha * u[k] / denom;
      }
    }
  }
  return p;
}

// The problem's parameters as FLAME tensors (requires_grad, so gradient stores can key them).
inline TensorList make_params(const Problem& pb, DType dtype, Device device) {
  TensorList ps;
  for (std::size_t i = 0; i < pb.shapes.size(); ++i) {
    Tensor t = Tensor::from_vec(pb.init[i], pb.shapes[i]).to(dtype, device);
    t.requires_grad_(true);
    ps.push_back(t);
  }
  return ps;
}

inline Gradients grads_at(const Problem& pb, const TensorList& ps, int step) {
  Gradients gs;
  for (std::size_t i = 0; i < ps.size(); ++i) {
    if (pb.grads[step][i].empty()) continue;
    gs.set(ps[i], Tensor::from_vec(pb.grads[step][i], pb.shapes[i]).to(ps[i].dtype(), ps[i].device()));
  }
  return gs;
}

// The two FLAME parameter groups of a config.
inline std::vector<optim::ParamGroup> groups_of(Kind kind, const Config& c, const TensorList& ps) {
  std::vector<optim::ParamGroup> gs(2);
  for (int g = 0; g < 2; ++g) {
    optim::ParamGroup& pg = gs[g];
    pg.params = g == 0 ? TensorList{ps[0], ps[1]} : TensorList{ps[2], ps[3]};
    pg.lr = c.lr[g];
    pg.weight_decay = c.wd[g];
    pg.momentum = c.momentum[g];
    pg.dampening = c.dampening[g];
    pg.beta1 = c.beta1[g];
    pg.beta2 = c.beta2[g];
    pg.eps = c.eps[g];
    pg.beta2_decay = c.beta2_decay;
    pg.d = c.d;
    pg.eps1 = c.eps1;
  }
  (void)kind;
  return gs;
}

struct Precision {
  bool master_weights = true;
  bool stochastic_rounding = false;
  uint64_t seed = 0;
};

inline std::unique_ptr<optim::FusedOptimizer> make_optimizer(Kind kind, const Config& c, const TensorList& ps,
                                                             Precision pr = {}) {
  auto groups = groups_of(kind, c, ps);
  switch (kind) {
    case Kind::sgd:
      return std::make_unique<optim::SGD>(groups, optim::SGDOptions{.nesterov = c.nesterov,
                                                                    .maximize = c.maximize,
                                                                    .master_weights = pr.master_weights,
                                                                    .stochastic_rounding = pr.stochastic_rounding,
                                                                    .seed = pr.seed});
    case Kind::adam:
      return std::make_unique<optim::Adam>(groups, optim::AdamOptions{.amsgrad = c.amsgrad,
                                                                      .maximize = c.maximize,
                                                                      .master_weights = pr.master_weights,
                                                                      .stochastic_rounding = pr.stochastic_rounding,
                                                                      .seed = pr.seed});
    case Kind::adamw:
      return std::make_unique<optim::AdamW>(groups, optim::AdamWOptions{.amsgrad = c.amsgrad,
                                                                        .maximize = c.maximize,
                                                                        .master_weights = pr.master_weights,
                                                                        .stochastic_rounding = pr.stochastic_rounding,
                                                                        .seed = pr.seed});
    case Kind::lion:
      return std::make_unique<optim::Lion>(groups, optim::LionOptions{.maximize = c.maximize,
                                                                      .master_weights = pr.master_weights,
                                                                      .stochastic_rounding = pr.stochastic_rounding,
                                                                      .seed = pr.seed});
    case Kind::adafactor:
      return std::make_unique<optim::Adafactor>(
          groups, optim::AdafactorOptions{.maximize = c.maximize, .master_weights = pr.master_weights});
  }
  return nullptr;
}

inline void run_steps(optim::Optimizer& opt, const Problem& pb, const TensorList& ps, int from, int to) {
  for (int s = from; s < to; ++s) opt.step(grads_at(pb, ps, s));
}

// Named configurations covering every option.
struct Case {
  const char* name;
  Kind kind;
  Config config;
};

inline std::vector<Case> cases() {
  std::vector<Case> cs;
  Config c;
  c.momentum[0] = 0.9;
  c.momentum[1] = 0.5;
  c.dampening[0] = 0.1;
  c.wd[0] = 0.01;
  c.wd[1] = 0.05;
  cs.push_back({"sgd_momentum", Kind::sgd, c});
  Config n;
  n.momentum[0] = 0.9;
  n.momentum[1] = 0.8;
  n.wd[1] = 0.02;
  n.nesterov = true;
  cs.push_back({"sgd_nesterov", Kind::sgd, n});
  Config plain;
  plain.wd[0] = 0.1;
  plain.maximize = true;
  cs.push_back({"sgd_plain_maximize", Kind::sgd, plain});
  Config a;
  a.wd[0] = 0.01;
  a.beta1[1] = 0.8;
  a.beta2[1] = 0.99;
  a.eps[1] = 1e-6;
  cs.push_back({"adam", Kind::adam, a});
  Config am = a;
  am.amsgrad = true;
  cs.push_back({"adam_amsgrad", Kind::adam, am});
  Config w;
  w.wd[0] = 0.1;
  w.wd[1] = 0.01;
  w.beta1[0] = 0.85;
  cs.push_back({"adamw", Kind::adamw, w});
  Config wm = w;
  wm.maximize = true;
  wm.amsgrad = true;
  cs.push_back({"adamw_amsgrad_maximize", Kind::adamw, wm});
  Config l;
  l.lr[0] = 1e-3;
  l.lr[1] = 3e-4;
  l.wd[0] = 0.1;
  l.beta2[0] = 0.99;
  l.beta1[1] = 0.95;
  l.beta2[1] = 0.98;
  cs.push_back({"lion", Kind::lion, l});
  Config f;
  f.lr[0] = 1e-2;
  f.lr[1] = 0.5;  // capped by 1/sqrt(t): exercises the relative step
  f.wd[0] = 0.01;
  f.eps[0] = f.eps[1] = 1e-3;
  f.d = 1.0;
  cs.push_back({"adafactor", Kind::adafactor, f});
  return cs;
}

}  // namespace flame::test::optim_ref
