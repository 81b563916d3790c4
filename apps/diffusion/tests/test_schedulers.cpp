// models/schedulers.h against diffusers 0.42 (issue #31, item 5): every case of
// apps/diffusion/reference/schedulers.py (FLUX.1-dev's and SD3.5's flow-match Euler, SDXL's Euler,
// Euler-ancestral and DPM++ 2M with and without Karras sigmas, epsilon and v-prediction, leading,
// trailing and linspace spacing) replayed with the same fake model outputs and noise: timesteps,
// sigmas, init_noise_sigma, scaled inputs and the sample after every step. Suite Schedulers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/io/safetensors.h>

#include "model_test_util.h"
#include "models/schedulers.h"

namespace {

namespace fm = flame_diffusion::models;
using flame::Tensor;

struct Case {
  std::string name, sampler, settings;
  int64_t steps = 0;
};

struct Reference {
  flame::StateDict t;
  std::vector<Case> cases;
  const Tensor& operator[](const std::string& k) const { return t.at(k); }
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, sep)) out.push_back(item);
  if (!s.empty() && s.back() == sep) out.emplace_back();
  return out;
}

const Reference& reference() {
  static const Reference r = [] {
    const std::string path = (std::filesystem::path(__FILE__).parent_path() / "data" / "models" / "schedulers" /
                              "reference.safetensors")
                                 .string();
    Reference ref{flame::io::load_safetensors(path), {}};
    for (const std::string& c : split(flame::io::load_safetensors_metadata(path).at("cases"), '|')) {
      std::vector<std::string> f = split(c, ':');
      EXPECT_EQ(f.size(), 4u) << c;
      ref.cases.push_back({f[0], f[1], f.size() > 3 ? f[3] : "", std::stoll(f[2])});
    }
    return ref;
  }();
  return r;
}

std::map<std::string, std::string> settings_of(const std::string& s) {
  std::map<std::string, std::string> out;
  for (const std::string& kv : split(s, ';')) {
    if (kv.empty()) continue;
    const auto eq = kv.find('=');
    out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

std::unique_ptr<fm::Scheduler> make(const Case& c) {
  const auto set = settings_of(c.settings);
  if (c.sampler == "flux") {
    auto s = std::make_unique<fm::FlowMatchEulerDiscreteScheduler>(fm::flux_scheduler_config());
    s->set_flux_timesteps(c.steps, std::stoll(set.at("seq")));
    return s;
  }
  if (c.sampler == "sd3") {
    auto s = std::make_unique<fm::FlowMatchEulerDiscreteScheduler>(fm::sd3_scheduler_config());
    s->set_timesteps(c.steps);
    return s;
  }
  fm::DiscreteSchedulerConfig config = fm::sdxl_scheduler_config();
  if (set.count("prediction_type")) config.prediction_type = set.at("prediction_type");
  if (set.count("timestep_spacing")) config.timestep_spacing = set.at("timestep_spacing");
  auto s = fm::make_discrete_scheduler(c.sampler, config);
  s->set_timesteps(c.steps);
  return s;
}

// Relative max error of `got` against `want` (by want's largest magnitude).
double rel_err(const Tensor& got, const Tensor& want) {
  return fd_test::max_abs_diff(got, want) / std::max(fd_test::max_abs(want), 1e-30);
}

Tensor vec_tensor(const std::vector<float>& v) { return Tensor::from_vec(v, {static_cast<int64_t>(v.size())}); }

// Replays one case; returns the largest relative error of the samples.
double replay(const Case& c) {
  const Reference& r = reference();
  SCOPED_TRACE(c.name);
  std::unique_ptr<fm::Scheduler> s = make(c);
  const Tensor want_t = r[c.name + ".timesteps"], want_s = r[c.name + ".sigmas"];
  EXPECT_EQ(s->num_steps(), c.steps);
  EXPECT_LE(rel_err(vec_tensor(s->timesteps()), want_t), 2e-6) << c.name << " timesteps";
  EXPECT_LE(rel_err(vec_tensor(s->sigmas()), want_s), 2e-6) << c.name << " sigmas";
  EXPECT_NEAR(s->init_noise_sigma(), r[c.name + ".init_noise_sigma"].item<double>(),
              2e-6 * r[c.name + ".init_noise_sigma"].item<double>());
  const Tensor inputs = r[c.name + ".inputs"], samples = r[c.name + ".samples"];
  Tensor x = r["noise"] * static_cast<float>(s->init_noise_sigma());
  double worst = rel_err(x, samples.select(0, 0));
  for (int64_t i = 0; i < c.steps; ++i) {
    const Tensor in = s->scale_model_input(x);
    EXPECT_LE(rel_err(in, inputs.select(0, i)), 4e-6) << c.name << " input of step " << i;
    const Tensor noise = s->needs_noise() ? r["ancestral_noise"].select(0, i) : Tensor();
    x = s->step(r["model_outputs"].select(0, i), x, noise);
    worst = std::max(worst, rel_err(x, samples.select(0, i + 1)));
  }
  EXPECT_EQ(s->step_index(), c.steps);
  return worst;
}

// Every case of the given samplers.
void replay_all(const std::vector<std::string>& samplers, double tol) {
  int cases = 0;
  for (const Case& c : reference().cases) {
    if (std::find(samplers.begin(), samplers.end(), c.sampler) == samplers.end()) continue;
    const double err = replay(c);
    ++cases;
    EXPECT_LE(err, tol) << c.name << ": samples' max relative error";
    std::printf("  %-22s %2lld steps: samples' max relative error %.2e\n", c.name.c_str(),
                static_cast<long long>(c.steps), err);
  }
  EXPECT_GT(cases, 0) << "no reference case for " << samplers.front();
}

TEST(Schedulers, FlowMatchEulerMatchesDiffusersForFluxAndSD35) {
  replay_all({"flux", "sd3"}, 2e-6);
}

TEST(Schedulers, EulerDiscreteMatchesDiffusers) { replay_all({"euler", "euler-karras"}, 2e-6); }

TEST(Schedulers, EulerAncestralMatchesDiffusers) { replay_all({"euler-a"}, 2e-6); }

TEST(Schedulers, DPMSolverMultistepMatchesDiffusers) { replay_all({"dpm++2m", "dpm++2m-karras"}, 2e-6); }

// calculate_shift is linear: base_shift at 256 tokens, max_shift at 4096 (a 1024^2 FLUX image).
TEST(Schedulers, FluxMuIsLinearInTheImageTokens) {
  const fm::FlowMatchConfig c = fm::flux_scheduler_config();
  EXPECT_NEAR(fm::flux_mu(256, c), 0.5, 1e-12);
  EXPECT_NEAR(fm::flux_mu(4096, c), 1.15, 1e-12);
  EXPECT_NEAR(fm::flux_mu(2176, c), 0.825, 1e-12);
  // With mu, the first sigma stays 1 and the shifted sigma is exp(mu) / (exp(mu) + 1/s - 1).
  fm::FlowMatchEulerDiscreteScheduler s(c);
  s.set_timesteps(std::vector<double>{1.0, 0.5}, 1.0);
  EXPECT_FLOAT_EQ(s.sigmas()[0], 1.0f);
  EXPECT_NEAR(s.sigmas()[1], std::exp(1.0) / (std::exp(1.0) + 1.0), 1e-7);
  EXPECT_FLOAT_EQ(s.timesteps()[1], s.sigmas()[1] * 1000.0f);
}

TEST(Schedulers, BadInputNamesTheProblem) {
  fm::FlowMatchEulerDiscreteScheduler flux(fm::flux_scheduler_config());
  EXPECT_NE(fd_test::error_of([&] { flux.set_timesteps(4); }).find("mu"), std::string::npos);
  fm::EulerDiscreteScheduler euler;
  const Tensor x = Tensor::zeros({1, 4, 2, 2});
  EXPECT_NE(fd_test::error_of([&] { euler.step(x, x); }).find("set_timesteps"), std::string::npos);
  euler.set_timesteps(2);
  EXPECT_NE(fd_test::error_of([&] { euler.step(Tensor::zeros({1, 4, 2, 3}), x); }).find("same shape"),
            std::string::npos);
  euler.step(x, x);
  euler.step(x, x);
  EXPECT_NE(fd_test::error_of([&] { euler.step(x, x); }).find("steps are done"), std::string::npos);
  fm::EulerAncestralDiscreteScheduler ancestral;
  ancestral.set_timesteps(3);
  EXPECT_NE(fd_test::error_of([&] { ancestral.step(x, x); }).find("needs noise"), std::string::npos);
  EXPECT_NE(fd_test::error_of([&] { euler.set_timesteps(0); }).find("num_inference_steps is 0"), std::string::npos);
  EXPECT_NE(fd_test::error_of([&] { fm::make_discrete_scheduler("ddim", {}); }).find("dpm++2m-karras"),
            std::string::npos);
  fm::DiscreteSchedulerConfig bad;
  bad.prediction_type = "sample";
  EXPECT_NE(fd_test::error_of([&] { fm::EulerDiscreteScheduler e(bad); }).find("prediction_type"), std::string::npos);
}

}  // namespace
