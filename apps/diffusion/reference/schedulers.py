#!/usr/bin/env python3
"""Reference runs of diffusers 0.42's schedulers for FLAME's models/schedulers.h.

For each case (scheduler class, configuration, step count) this script records diffusers' timesteps,
sigmas, init_noise_sigma, the scaled model input of every step and the sample after every step,
driven by a fixed sequence of fake model outputs and fixed initial noise (and, for the ancestral
scheduler, fixed per-step noise), into
  apps/diffusion/tests/data/models/schedulers/reference.safetensors
(f32). Keys: "model_outputs" [30, 1, 4, 4, 4] (step i uses row i), "noise" [1, 4, 4, 4],
"ancestral_noise" [30, 1, 4, 4, 4], and per case "<case>.timesteps", "<case>.sigmas",
"<case>.init_noise_sigma" [1], "<case>.inputs" [N, ...] (scale_model_input) and "<case>.samples"
[N + 1, ...] (the initial sample noise * init_noise_sigma, then each step's). Metadata "cases" lists
"<case>:<sampler>:<steps>:<settings>" for the C++ test (Schedulers.* in test_schedulers.cpp).

The configurations are the shipped scheduler_config.json files: FLUX.1-dev (FlowMatchEuler, shift 3,
dynamic shifting 0.5..1.15 over 256..4096 tokens; the FLUX pipeline passes sigmas linspace(1, 1/N, N)
and mu), SD3.5 (FlowMatchEuler, shift 3) and SDXL base 1.0 (scaled-linear 0.00085..0.012, epsilon,
leading spacing, steps_offset 1), from which Euler, Euler-ancestral and DPM++ 2M (Karras) are made
with from_config as users do.

Usage: python schedulers.py [--out DIR]   (needs torch, numpy, diffusers, safetensors; CPU)
"""
import argparse
import os

import numpy as np
import torch
from diffusers import (DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                       FlowMatchEulerDiscreteScheduler)
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "tests", "data", "models", "schedulers")

FLUX = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)
SD35 = dict(num_train_timesteps=1000, shift=3.0)
SDXL = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            prediction_type="epsilon", timestep_spacing="leading", steps_offset=1, interpolation_type="linear",
            use_karras_sigmas=False, clip_sample=False, sample_max_value=1.0, set_alpha_to_one=False,
            skip_prk_steps=True)
SHAPE = (1, 4, 4, 4)
MAX_STEPS = 30

# (case, sampler, steps, settings): settings are "seq=<image tokens>" for FLUX, else overrides of
# the SDXL configuration written key=value joined by ";" (the C++ test applies the same).
CASES = [
    ("flux_4", "flux", 4, "seq=256"),
    ("flux_28", "flux", 28, "seq=4096"),
    ("flux_9", "flux", 9, "seq=1024"),
    ("sd3_5", "sd3", 5, ""),
    ("sd3_28", "sd3", 28, ""),
    ("euler_5", "euler", 5, ""),
    ("euler_30", "euler", 30, ""),
    ("euler_v_trailing_7", "euler", 7, "prediction_type=v_prediction;timestep_spacing=trailing"),
    ("euler_karras_10", "euler-karras", 10, ""),
    ("euler_linspace_6", "euler", 6, "timestep_spacing=linspace"),
    ("euler_a_6", "euler-a", 6, ""),
    ("euler_a_v_12", "euler-a", 12, "prediction_type=v_prediction;timestep_spacing=trailing"),
    ("dpm_8", "dpm++2m", 8, ""),
    ("dpm_karras_10", "dpm++2m-karras", 10, ""),
    ("dpm_karras_25", "dpm++2m-karras", 25, ""),
    ("dpm_v_linspace_6", "dpm++2m", 6, "prediction_type=v_prediction;timestep_spacing=linspace"),
    ("dpm_trailing_16", "dpm++2m", 16, "timestep_spacing=trailing"),
]


def overrides(settings):
    out = {}
    for item in filter(None, settings.split(";")):
        k, v = item.split("=")
        out[k] = v
    return out


def make(sampler, settings):
    if sampler == "flux":
        return FlowMatchEulerDiscreteScheduler(**FLUX)
    if sampler == "sd3":
        return FlowMatchEulerDiscreteScheduler(**SD35)
    cfg = dict(SDXL)  # the shipped file's keys; from_config ignores those a class does not take
    cfg.update(overrides(settings))
    if sampler in ("euler", "euler-karras"):
        return EulerDiscreteScheduler.from_config(cfg, use_karras_sigmas=sampler == "euler-karras")
    if sampler == "euler-a":
        return EulerAncestralDiscreteScheduler.from_config(cfg)
    return DPMSolverMultistepScheduler.from_config(cfg, algorithm_type="dpmsolver++", solver_order=2,
                                                   use_karras_sigmas=sampler == "dpm++2m-karras")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(31)
    model_outputs = torch.randn((MAX_STEPS,) + SHAPE, generator=g)
    noise = torch.randn(SHAPE, generator=g)
    ancestral_noise = torch.randn((MAX_STEPS,) + SHAPE, generator=g)
    tensors = {"model_outputs": model_outputs, "noise": noise, "ancestral_noise": ancestral_noise}
    names = []
    for case, sampler, n, settings in CASES:
        s = make(sampler, settings)
        if sampler == "flux":
            seq = int(overrides(settings)["seq"])
            mu = calculate_shift(seq, FLUX["base_image_seq_len"], FLUX["max_image_seq_len"], FLUX["base_shift"],
                                 FLUX["max_shift"])
            s.set_timesteps(n, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        else:
            s.set_timesteps(n)
        init = getattr(s, "init_noise_sigma", 1.0)
        init = torch.as_tensor(init, dtype=torch.float32).reshape(1)
        sample = noise * init
        samples, inputs = [sample], []
        for i, t in enumerate(s.timesteps):
            x_in = sample if sampler in ("flux", "sd3") else s.scale_model_input(sample, t)
            inputs.append(x_in)
            if sampler == "euler-a":
                sample = ancestral_step(s, model_outputs[i], t, sample, ancestral_noise[i])
            else:
                sample = s.step(model_outputs[i], t, sample).prev_sample
            samples.append(sample)
        tensors[f"{case}.timesteps"] = s.timesteps.to(torch.float32).contiguous()
        tensors[f"{case}.sigmas"] = s.sigmas.to(torch.float32).contiguous()
        tensors[f"{case}.init_noise_sigma"] = init
        tensors[f"{case}.inputs"] = torch.stack(inputs).contiguous()
        tensors[f"{case}.samples"] = torch.stack(samples).contiguous()
        names.append(f"{case}:{sampler}:{n}:{settings}")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "reference.safetensors")
    save_file(tensors, path, metadata={"cases": "|".join(names), "diffusers": __import__("diffusers").__version__})
    print(f"wrote {path}: {len(CASES)} cases, {os.path.getsize(path)} bytes")


def ancestral_step(s, model_output, t, sample, noise):
    """EulerAncestralDiscreteScheduler.step with its noise given: diffusers' step draws it from
    randn_tensor(shape, generator=...); patch that draw to return `noise`, then run the real step."""
    import diffusers.schedulers.scheduling_euler_ancestral_discrete as mod
    original = mod.randn_tensor
    mod.randn_tensor = lambda *args, **kwargs: noise.clone()
    try:
        return s.step(model_output, t, sample).prev_sample
    finally:
        mod.randn_tensor = original


if __name__ == "__main__":
    main()
