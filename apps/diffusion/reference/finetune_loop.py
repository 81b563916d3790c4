#!/usr/bin/env python3
"""The LoRA fine-tuning loop of diffusers' training scripts, step by step, as the reference for
FLAME's (apps/diffusion/models/finetune.h).

Written like train_dreambooth_lora_flux.py / train_dreambooth_lora_sd3.py (flow matching: density
sampling of u, the scheduler's sigma table, (1 - sigma) x + sigma noise, target noise - x, the SD3
loss weighting) and train_text_to_image_lora_sdxl.py (DDPM add_noise with the scaled-linear betas,
epsilon or v-prediction targets, min-SNR-gamma weighting), with PEFT LoRA r on to_q/k/v/out.0,
AdamW on the adapters. Everything random (latents, text states, noise, u, timesteps) is drawn here
and saved, so FLAME runs the same steps; the file then holds the loss of every step and the
adapters after the last.

    python3 finetune_loop.py --family flux --model-dir tests/data/models/flux-tiny/transformer --out DIR
    python3 finetune_loop.py --family sd3  --model-dir tests/data/models/sd3-tiny/transformer --out DIR
    python3 finetune_loop.py --family sdxl --model-dir tests/data/models/unet2d-tiny-xl/unet --out DIR
    # a real configuration on the GPU (the model folder as models_flux.py writes it), mixed precision:
    python3 finetune_loop.py --family flux --config flux-dev --model-dir /tmp/fluxdev --device cuda --dtype bf16 \
        --latent 128 --text 512 --batch 1 --steps 20 --rank 16 --alpha 16 --lr 1e-4 --out /tmp/ft_fluxdev
    finetune_parity check --reference /tmp/ft_fluxdev/finetune_reference.safetensors --model-dir /tmp/fluxdev

Writes DIR/finetune_reference.safetensors (inputs per step, losses, initial and final adapters;
metadata: the settings).
"""
import argparse
import json
import math
import os
import sys

# cuBLAS is deterministic on CUDA only with a fixed workspace; set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_common import add_lora  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def density_u(scheme, batch, gen, logit_mean=0.0, logit_std=1.0, mode_scale=1.29):
    """training_utils.compute_density_for_timestep_sampling (facts), from a seeded generator."""
    if scheme == "logit_normal":
        return torch.sigmoid(torch.normal(logit_mean, logit_std, size=(batch,), generator=gen))
    if scheme == "mode":
        u = torch.rand(batch, generator=gen)
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return torch.rand(batch, generator=gen)


def loss_weighting(scheme, sigmas):
    """training_utils.compute_loss_weighting_for_sd3 (facts)."""
    if scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if scheme == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas ** 2
        return 2 / (math.pi * bot)
    return torch.ones_like(sigmas)


def flow_sigma_table(n, shift):
    """FlowMatchEulerDiscreteScheduler(num_train_timesteps=n, shift=shift) at init, without dynamic
    shifting: sigmas descending from 1, timesteps = sigmas * n."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=n, shift=shift)
    return s.sigmas[:n].clone().float(), s.timesteps.clone().float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=["flux", "sd3", "sdxl"], required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--latent", type=int, default=8, help="latent height = width")
    ap.add_argument("--text", type=int, default=7, help="text tokens")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weighting", default="none", help="flow: none|sigma_sqrt|cosmap")
    ap.add_argument("--sampling", default="logit_normal", help="flow: logit_normal|mode|uniform")
    ap.add_argument("--shift", type=float, default=None, help="flow: the scheduler's static shift (sd3 3.0, flux 1.0)")
    ap.add_argument("--guidance", type=float, default=3.5, help="flux: the guidance input")
    ap.add_argument("--prediction", default="epsilon", help="sdxl: epsilon|v_prediction")
    ap.add_argument("--snr-gamma", type=float, default=5.0, help="sdxl: min-SNR gamma (0: plain mse)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="bf16: the model's weights in bf16, f32 adapters, bf16 autocast (the scripts' mixed precision)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", default=None,
                    help="when --model-dir does not exist: build this configuration (models_flux/sd3/unet.py's "
                         "CONFIGS, e.g. flux-dev, sd3.5-large, sdxl) with random weights and save it there")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    # Every input and random draw is saved, so determinism only makes reruns repeat themselves;
    # attention's CUDA backward has no deterministic kernel, so there it warns instead of failing.
    torch.use_deterministic_algorithms(True, warn_only=a.device != "cpu")
    gen = torch.Generator().manual_seed(a.seed + 10)

    if not os.path.isdir(a.model_dir):
        if not a.config:
            sys.exit(f"finetune_loop: {a.model_dir} does not exist (give --config to build a model there)")
        import importlib
        ref = importlib.import_module({"flux": "models_flux", "sd3": "models_sd3", "sdxl": "models_unet"}[a.family])
        ref.build(a.config, a.device, torch.float32 if a.dtype == "f32" else torch.bfloat16,
                  a.seed).save_pretrained(a.model_dir)
    wdt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.family == "flux":
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel.from_pretrained(a.model_dir, torch_dtype=wdt)
        chans = model.config.in_channels // 4  # packed 2x2 patches
    elif a.family == "sd3":
        from diffusers import SD3Transformer2DModel
        model = SD3Transformer2DModel.from_pretrained(a.model_dir, torch_dtype=wdt)
        chans = model.config.in_channels
    else:
        from diffusers import UNet2DConditionModel
        model = UNet2DConditionModel.from_pretrained(a.model_dir, torch_dtype=wdt)
        chans = model.config.in_channels
    dev = torch.device(a.device)
    model.to(dev, wdt)
    model.train()
    adapters = add_lora(model, TARGETS, a.rank, a.alpha, a.seed, 0.05, torch.float32)
    names = sorted(adapters)
    out = {f"init.{n}": adapters[n].detach().clone() for n in names}
    opt = torch.optim.AdamW([adapters[n] for n in names], lr=a.lr, weight_decay=1e-2)
    cfg = model.config
    shift = a.shift if a.shift is not None else (3.0 if a.family == "sd3" else 1.0)
    if a.family in ("flux", "sd3"):
        sig_table, ts_table = flow_sigma_table(1000, shift)
    else:
        from diffusers import DDPMScheduler
        from diffusers.training_utils import compute_snr
        ddpm = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                             beta_schedule="scaled_linear")

    B, H, W, T = a.batch, a.latent, a.latent, a.text
    losses = []

    def fwd(fn):  # the forward under the scripts' mixed precision
        if a.dtype == "bf16":
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                return fn()
        return fn()

    for step in range(a.steps):
        x0 = torch.randn(B, chans, H, W, generator=gen)
        noise = torch.randn(B, chans, H, W, generator=gen)
        out[f"step{step}.latents"] = x0
        out[f"step{step}.noise"] = noise
        if a.family == "flux":
            ctx = torch.randn(B, T, cfg.joint_attention_dim, generator=gen)
            pooled = torch.randn(B, cfg.pooled_projection_dim, generator=gen)
        elif a.family == "sd3":
            ctx = torch.randn(B, T, cfg.joint_attention_dim, generator=gen)
            pooled = torch.randn(B, cfg.pooled_projection_dim, generator=gen)
        else:
            ctx = torch.randn(B, T, cfg.cross_attention_dim, generator=gen)
            n_ids = 6
            pooled = torch.randn(B, cfg.projection_class_embeddings_input_dim - n_ids * cfg.addition_time_embed_dim,
                                 generator=gen)
            time_ids = torch.tensor([[H * 8, W * 8, 0, 0, H * 8, W * 8]], dtype=torch.float32).repeat(B, 1)
            out[f"step{step}.time_ids"] = time_ids
        out[f"step{step}.text"] = ctx
        out[f"step{step}.pooled"] = pooled
        # The model dtype's values (as the scripts cast latents and states to weight_dtype), kept as f32.
        for k in ("latents", "noise", "text", "pooled"):
            out[f"step{step}.{k}"] = out[f"step{step}.{k}"].to(wdt).float()
        x0, noise = out[f"step{step}.latents"].to(dev, wdt), out[f"step{step}.noise"].to(dev, wdt)
        ctx, pooled = out[f"step{step}.text"].to(dev, wdt), out[f"step{step}.pooled"].to(dev, wdt)
        if a.family == "sdxl":
            time_ids = time_ids.to(dev, wdt)

        if a.family in ("flux", "sd3"):
            u = density_u(a.sampling, B, gen)
            out[f"step{step}.u"] = u
            idx = (u * 1000).long()
            timesteps = ts_table[idx].to(dev)
            sigmas = sig_table[idx].to(dev)
            s4 = sigmas.view(B, 1, 1, 1).to(wdt)
            noisy = (1.0 - s4) * x0 + s4 * noise
            if a.family == "flux":
                from diffusers import FluxPipeline
                packed = FluxPipeline._pack_latents(noisy, B, chans, H, W)
                img_ids = FluxPipeline._prepare_latent_image_ids(B, H // 2, W // 2, dev, wdt)
                txt_ids = torch.zeros(T, 3, device=dev, dtype=wdt)
                guidance = torch.full((B,), a.guidance, device=dev) if cfg.guidance_embeds else None
                pred = fwd(lambda: model(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                                         pooled_projections=pooled, encoder_hidden_states=ctx, txt_ids=txt_ids,
                                         img_ids=img_ids, return_dict=False)[0])
                pred = FluxPipeline._unpack_latents(pred, H * 8, W * 8, 8)  # vae_scale_factor 8: latent H
            else:
                pred = fwd(lambda: model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=ctx,
                                         pooled_projections=pooled, return_dict=False)[0])
            target = noise - x0
            wgt = loss_weighting(a.weighting, sigmas.float()).view(B, 1, 1, 1)
            loss = torch.mean((wgt.float() * (pred.float() - target.float()) ** 2).reshape(B, -1), 1).mean()
        else:
            t = torch.randint(0, 1000, (B,), generator=gen)
            out[f"step{step}.timesteps"] = t.float()
            t = t.to(dev)
            noisy = ddpm.add_noise(x0, noise, t)
            target = noise if a.prediction == "epsilon" else ddpm.get_velocity(x0, noise, t)
            pred = fwd(lambda: model(noisy, t, ctx, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids},
                                     return_dict=False)[0])
            if a.snr_gamma <= 0:
                loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
            else:
                snr = compute_snr(ddpm, t)
                w = torch.stack([snr, a.snr_gamma * torch.ones_like(t, dtype=snr.dtype)], dim=1).min(dim=1)[0]
                w = w / snr if a.prediction == "epsilon" else w / (snr + 1)
                loss = F.mse_loss(pred.float(), target.float(), reduction="none")
                loss = (loss.mean(dim=list(range(1, loss.dim()))) * w).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.8f}")
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    for n in names:
        out[f"final.{n}"] = adapters[n].detach().clone()
    out = {k: v.detach().cpu() for k, v in out.items()}
    meta = {k: str(v) for k, v in vars(a).items()}
    meta.update(shift=str(shift), adapters=json.dumps(names), torch=torch.__version__)
    os.makedirs(a.out, exist_ok=True)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(a.out, "finetune_reference.safetensors"),
              metadata=meta)
    print(json.dumps({"family": a.family, "losses": losses, "adapters": len(names)}))


if __name__ == "__main__":
    main()
