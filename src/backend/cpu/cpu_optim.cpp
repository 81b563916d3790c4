// CPU reference of the fused optimizer and EMA updates: a plain loop per tensor over the shared
// element math (Note [Optimizer element math] in src/backend/optim_math.h). Tensors arrive dense
// and in one layout per entry, so each is walked as a flat array of numel slots.
#include <atomic>

#include "src/backend/fused/multi_tensor.h"
#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/optim_math.h"

namespace flame::backend {

namespace {
std::atomic<int64_t> g_launches{0};
}  // namespace

void optim_count_launch() { g_launches.fetch_add(1, std::memory_order_relaxed); }
int64_t optim_launch_count() { return g_launches.load(std::memory_order_relaxed); }

namespace cpu {

namespace {

template <class T>
T* slots(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

// P: parameter element type; S: state (and master) element type; C: compute type.
template <class P, class S>
void optim_tensor(const optim_math::Hyper<compute_t<S>>& h, const OptimHyper& raw, const OptimTensor& e) {
  using C = compute_t<S>;
  const int64_t n = e.param.numel();
  P* param = slots<P>(e.param);
  const P* grad = slots<P>(e.grad);
  S* master = slots<S>(e.master);
  S* s0 = slots<S>(e.state[0]);
  S* s1 = slots<S>(e.state[1]);
  S* s2 = slots<S>(e.state[2]);
  const optim_math::StepScalars sc = optim_math::step_scalars(raw, e);
  const C step_size = static_cast<C>(sc.step_size), bias2_sqrt = static_cast<C>(sc.bias2_sqrt);
  for (int64_t i = 0; i < n; ++i) {
    C p = master ? convert<C>(master[i]) : convert<C>(param[i]);
    const C g = convert<C>(grad[i]);
    switch (h.kind) {
      case OptimKind::sgd: {
        C buf = s0 && !e.first ? convert<C>(s0[i]) : C(0);
        optim_math::sgd_update(h, e.first, p, g, buf);
        if (s0) s0[i] = convert<S>(buf);
        break;
      }
      case OptimKind::adam: {
        C m = convert<C>(s0[i]), v = convert<C>(s1[i]), vmax = s2 ? convert<C>(s2[i]) : C(0);
        optim_math::adam_update(h, step_size, bias2_sqrt, p, g, m, v, vmax);
        s0[i] = convert<S>(m);
        s1[i] = convert<S>(v);
        if (s2) s2[i] = convert<S>(vmax);
        break;
      }
      case OptimKind::lion: {
        C m = convert<C>(s0[i]);
        optim_math::lion_update(h, p, g, m);
        s0[i] = convert<S>(m);
        break;
      }
    }
    if (master) {
      master[i] = convert<S>(p);
      if constexpr (std::is_same_v<P, bfloat16>) {
        if (raw.stochastic_rounding) {
          const uint32_t bits = optim_math::rounding_bits(raw.seed, e.rng_index + static_cast<uint64_t>(i),
                                                          sc.rng_offset);
          param[i] = optim_math::stochastic_round_bf16(static_cast<float>(master[i]), bits);
          continue;
        }
      }
    }
    param[i] = convert<P>(p);
  }
  if constexpr (std::is_same_v<P, float>) {
    if (e.low.defined()) {
      dispatch_floating(e.low.dtype(), "optim_step", [&](auto ltag) {
        using L = typename decltype(ltag)::type;
        L* low = slots<L>(e.low);
        for (int64_t i = 0; i < n; ++i) low[i] = convert<L>(param[i]);
      });
    }
  }
}

}  // namespace

static void optim_step_cpu(const OptimHyper& h, const std::vector<OptimTensor>& tensors) {
  if (tensors.empty()) return;
  optim_count_launch();
  const DType pdt = tensors.front().param.dtype();
  const Tensor& probe = tensors.front().master.defined() ? tensors.front().master : tensors.front().state[0];
  const DType sdt = probe.defined() ? probe.dtype() : pdt;
  dispatch_floating(pdt, "optim_step", [&](auto ptag) {
    using P = typename decltype(ptag)::type;
    const OptimHyper raw = optim_math::resolve_hyper(h);  // capturable calls read their scalars now
    auto run = [&](auto stag) {
      using S = typename decltype(stag)::type;
      const auto hyper = optim_math::make_hyper<compute_t<S>>(raw);
      for (const OptimTensor& e : tensors) optim_tensor<P, S>(hyper, raw, e);
    };
    if (sdt == pdt) {
      run(type_tag<P>{});
    } else {
      FLAME_CHECK(sdt == DType::f32, "optim_step", "state dtype ", dtype_name(sdt), " for parameters of dtype ",
                  dtype_name(pdt), " (expected the parameter dtype or f32)");
      run(type_tag<float>{});
    }
  });
}

static void ema_update_cpu(const TensorList& shadow, const TensorList& params, double weight) {
  if (shadow.empty()) return;
  optim_count_launch();
  dispatch_floating(shadow.front().dtype(), "ema_update", [&](auto stag) {
    using S = typename decltype(stag)::type;
    using C = compute_t<S>;
    dispatch_floating(params.front().dtype(), "ema_update", [&](auto ptag) {
      using P = typename decltype(ptag)::type;
      const C w = static_cast<C>(weight);
      for (std::size_t k = 0; k < shadow.size(); ++k) {
        S* s = slots<S>(shadow[k]);
        const P* p = slots<P>(params[k]);
        const int64_t n = shadow[k].numel();
        for (int64_t i = 0; i < n; ++i) {
          const C sv = convert<C>(s[i]);
          s[i] = convert<S>(sv + w * (convert<C>(p[i]) - sv));
        }
      }
    });
  });
}

void register_cpu_optim_kernels() {
  fused::optim_step.define(DeviceType::cpu, &optim_step_cpu);
  fused::ema_update.define(DeviceType::cpu, &ema_update_cpu);
}

}  // namespace cpu
}  // namespace flame::backend
