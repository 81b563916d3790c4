#!/usr/bin/env python3
"""diffusers' SD3Transformer2DModel (SD3 / SD3.5 MMDiT) as the reference of FLAME's models/sd3.

Needs torch, diffusers (0.42), peft and safetensors. Two modes.

Reference files (the CPU tests read the reduced ones; tools/sd3_parity reads any):
  python3 apps/diffusion/reference/models_sd3.py --config tiny-sd3 --out apps/diffusion/tests/data/models/sd3-tiny
  python3 apps/diffusion/reference/models_sd3.py --config tiny-sd35m --out apps/diffusion/tests/data/models/sd3-tiny35m
  python3 apps/diffusion/reference/models_sd3.py --config sd3.5-large --latent 128 --text 333 --dtype bf16 --out /tmp/sd35l
builds the model with a fixed seed (PyTorch's default init, then N(0, 0.02) added to every
parameter so the zero-initialised and constant layers take part; pos_embed is diffusers' fixed
sin-cos table and stays as it is), and writes into OUT:
  transformer/config.json, transformer/diffusion_pytorch_model*.safetensors
                              diffusers' save_pretrained, sharded with its .index.json (--shard)
  sd3_original.safetensors    the same tensors under the SD3/SD3.5 single-file names
                              (model.diffusion_model.joint_blocks.N.{x_block,context_block}...,
                              converted here from the facts of diffusers'
                              convert_sd3_transformer_checkpoint_to_diffusers, in the other
                              direction), plus two keys of another model (a ComfyUI full checkpoint)
  sd3_fp8.safetensors         bare original names (no prefix), every 2-d weight stored F8_E4M3
  sd3_fp8_scaled.safetensors  prefixed original names, 2-d weights F8_E4M3 with a per-tensor f32
                              .scale_weight and the scaled_fp8 marker (ComfyUI's fp8_scaled files)
  reference.safetensors       input.hidden_states / encoder_hidden_states / pooled_projections /
                              timestep / target; output.sample (no adapter); output.fp8_sample and
                              output.fp8_scaled_sample (the same model with the fp8 files'
                              dequantised weights); then with a PEFT LoRA (rank r on to_q, to_k,
                              to_v, to_out.0 -- attn and, in dual-attention blocks, attn2; lora_B
                              drawn N(0, 0.05), not zero): output.lora_sample, output.loss =
                              mse(output, target), and per adapter tensor
                              lora.<module>.lora_{A,B}.weight and grad.<same>.
                              Metadata: lora_rank, lora_alpha, dtype, config, versions.
Reduced configs run on the CPU in f32 (with the fp8 files); real ones on --device (cuda) in --dtype,
TF32 off, with the fp8 files when --fp8 is given.

Timing (the SD3 LoRA r16 training step, as sd3_parity time: bf16 autocast, bf16 weights, f32
adapters, AdamW, mse loss):
  python3 apps/diffusion/reference/models_sd3.py --config sd3.5-large --time --latent 128 --text 333
prints one JSON line per checkpointing setting: median step ms over --steps after --warmup, peak
allocated GiB. --compile runs the transformer through torch.compile (default mode).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# PyTorch's cuDNN attention faults (illegal memory access) on the 4096+512-token bf16 attention of
# FLUX on Hopper; the reference uses its flash / memory-efficient kernels instead.
torch.backends.cuda.enable_cudnn_sdp(False)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_common import add_lora, time_steps  # noqa: E402

# Published configurations (stabilityai/stable-diffusion-3-medium-diffusers, -3.5-medium, -3.5-large).
REAL = {
    "sd3-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                       num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                       pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192),
    "sd3.5-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                         num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384, qk_norm="rms_norm",
                         dual_attention_layers=tuple(range(13))),
    "sd3.5-large": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm"),
}
CONFIGS = dict(REAL)
# Reduced: SD3-Medium's shape (no QK norm) and SD3.5-Medium's (RMS QK norm, dual attention in the
# first blocks, a larger position table than the latent so the crop is off-centre).
CONFIGS["tiny-sd3"] = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                           num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16,
                           pooled_projection_dim=10, out_channels=4, pos_embed_max_size=8)
CONFIGS["tiny-sd35m"] = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
                             num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16,
                             pooled_projection_dim=10, out_channels=4, pos_embed_max_size=11, qk_norm="rms_norm",
                             dual_attention_layers=(0, 1))
TINY = {"tiny-sd3", "tiny-sd35m"}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
PREFIX = "model.diffusion_model."


# ---- diffusers names <-> SD3 single-file names ----
def swap_halves(t):
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def key_map(cfg):
    """[(original name, op, [diffusers names])], op "copy", "qkv" (the three concatenated) or "swap"
    (the two halves exchanged): the facts of diffusers' convert_sd3_transformer_checkpoint_to_diffusers."""
    n, qk, dual = cfg["num_layers"], cfg.get("qk_norm") is not None, set(cfg.get("dual_attention_layers", ()))
    m = [("pos_embed", "copy", ["pos_embed.pos_embed"])]
    for p in ("weight", "bias"):
        m += [(f"x_embedder.proj.{p}", "copy", [f"pos_embed.proj.{p}"]),
              (f"context_embedder.{p}", "copy", [f"context_embedder.{p}"]),
              (f"final_layer.linear.{p}", "copy", [f"proj_out.{p}"]),
              (f"final_layer.adaLN_modulation.1.{p}", "swap", [f"norm_out.linear.{p}"])]
        for src, dst in [("time_text_embed.timestep_embedder", "t_embedder"), ("time_text_embed.text_embedder", "y_embedder")]:
            m += [(f"{dst}.mlp.0.{p}", "copy", [f"{src}.linear_1.{p}"]), (f"{dst}.mlp.2.{p}", "copy", [f"{src}.linear_2.{p}"])]
    for i in range(n):
        t, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        last = i == n - 1
        for p in ("weight", "bias"):
            m += [(x + f"attn.qkv.{p}", "qkv", [t + f"attn.to_{q}.{p}" for q in "qkv"]),
                  (c + f"attn.qkv.{p}", "qkv", [t + f"attn.add_{q}_proj.{p}" for q in "qkv"]),
                  (x + f"attn.proj.{p}", "copy", [t + f"attn.to_out.0.{p}"]),
                  (x + f"adaLN_modulation.1.{p}", "copy", [t + f"norm1.linear.{p}"]),
                  (c + f"adaLN_modulation.1.{p}", "swap" if last else "copy", [t + f"norm1_context.linear.{p}"]),
                  (x + f"mlp.fc1.{p}", "copy", [t + f"ff.net.0.proj.{p}"]),
                  (x + f"mlp.fc2.{p}", "copy", [t + f"ff.net.2.{p}"])]
            if not last:
                m += [(c + f"attn.proj.{p}", "copy", [t + f"attn.to_add_out.{p}"]),
                      (c + f"mlp.fc1.{p}", "copy", [t + f"ff_context.net.0.proj.{p}"]),
                      (c + f"mlp.fc2.{p}", "copy", [t + f"ff_context.net.2.{p}"])]
            if i in dual:
                m += [(x + f"attn2.qkv.{p}", "qkv", [t + f"attn2.to_{q}.{p}" for q in "qkv"]),
                      (x + f"attn2.proj.{p}", "copy", [t + f"attn2.to_out.0.{p}"])]
        if qk:
            m += [(x + "attn.ln_q.weight", "copy", [t + "attn.norm_q.weight"]),
                  (x + "attn.ln_k.weight", "copy", [t + "attn.norm_k.weight"]),
                  (c + "attn.ln_q.weight", "copy", [t + "attn.norm_added_q.weight"]),
                  (c + "attn.ln_k.weight", "copy", [t + "attn.norm_added_k.weight"])]
            if i in dual:
                m += [(x + "attn2.ln_q.weight", "copy", [t + "attn2.norm_q.weight"]),
                      (x + "attn2.ln_k.weight", "copy", [t + "attn2.norm_k.weight"])]
    return m


def to_original(sd, cfg):
    """diffusers state dict -> the original MMDiT names (no prefix), the inverse of diffusers' converter."""
    ops = {"copy": lambda ts: ts[0], "qkv": lambda ts: torch.cat(ts, 0), "swap": lambda ts: swap_halves(ts[0])}
    o = {k: ops[op]([sd[d] for d in ds]) for k, op, ds in key_map(cfg)}
    assert sum(v.numel() for v in o.values()) == sum(v.numel() for v in sd.values())
    return {k: v.detach().cpu().contiguous() for k, v in o.items()}


def from_original(original, cfg):
    """The other direction (to run diffusers on an fp8 file's dequantised weights)."""
    sd = {}
    for k, op, ds in key_map(cfg):
        parts = original[k].chunk(3, 0) if op == "qkv" else [swap_halves(original[k]) if op == "swap" else original[k]]
        sd.update(zip(ds, parts))
    return sd


def fp8_of(original, scaled):
    """(stored tensors, dequantised f32 originals): 2-d weights in F8_E4M3, scaled per tensor when asked."""
    stored, deq = {}, {}
    for k, v in original.items():
        if v.dim() == 2 and k.endswith(".weight"):
            if scaled:
                s = (v.abs().max().float() / 448.0).clamp(min=1e-12).reshape(1)
                q = (v.float() / s).to(torch.float8_e4m3fn)
                stored[k] = q
                stored[k[: -len("weight")] + "scale_weight"] = s
                deq[k] = q.float() * s
            else:
                q = v.float().to(torch.float8_e4m3fn)
                stored[k] = q
                deq[k] = q.float()
        else:
            stored[k] = v
            deq[k] = v.float()
    if scaled:
        stored["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    return stored, deq


# ---- model and inputs ----
def build(name, device, dtype, seed):
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(seed)
    with torch.device(device):
        model = SD3Transformer2DModel(**CONFIGS[name])
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    return model.to(dtype)


def make_inputs(name, batch, height, width, text, device, dtype, seed):
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "hidden_states": torch.randn(batch, cfg["in_channels"], height, width, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, cfg["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(batch, cfg["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([981.0, 17.5, 500.0, 3.0] * batch)[:batch],
        "target": torch.randn(batch, cfg["out_channels"], height, width, generator=g),
    }
    return {k: v.to(device) if k == "timestep" else v.to(device, dtype) for k, v in inputs.items()}


def run(model, x):
    return model(hidden_states=x["hidden_states"], encoder_hidden_states=x["encoder_hidden_states"],
                 pooled_projections=x["pooled_projections"], timestep=x["timestep"]).sample


def write_reference(args):
    from safetensors.torch import save_file
    import diffusers
    name = args.config
    tiny = name in TINY
    cfg = CONFIGS[name]
    device = "cpu" if tiny else args.device
    dtype = torch.float32 if tiny else DTYPES[args.dtype]
    height, width = (8, 12) if tiny else (args.latent, args.latent)
    text = 5 if tiny else args.text
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)

    model = build(name, device, dtype, args.seed)
    model.save_pretrained(os.path.join(args.out, "transformer"), safe_serialization=True,
                          max_shard_size=args.shard or ("40KB" if tiny else "10GB"))
    original = to_original(model.state_dict(), cfg)
    prefixed = {PREFIX + k: v for k, v in original.items()}
    # Another model's keys, as a full (ComfyUI) checkpoint holds them beside the transformer.
    prefixed["first_stage_model.decoder.conv_out.bias"] = torch.zeros(3)
    prefixed["text_encoders.clip_l.transformer.text_model.final_layer_norm.bias"] = torch.zeros(4)
    save_file(prefixed, os.path.join(args.out, "sd3_original.safetensors"))

    x = make_inputs(name, 2 if tiny else args.batch, height, width, text, device, dtype, args.seed + 10)
    ref = {f"input.{k}": v.contiguous() for k, v in x.items()}
    with torch.no_grad():
        ref["output.sample"] = run(model, x).float()
    files = ["sd3_original.safetensors"]
    if tiny or args.fp8:
        for scaled, fname, key in [(False, "sd3_fp8.safetensors", "output.fp8_sample"),
                                   (True, "sd3_fp8_scaled.safetensors", "output.fp8_scaled_sample")]:
            stored, deq = fp8_of(original, scaled)
            if scaled:
                stored = {PREFIX + k: v for k, v in stored.items()}
            save_file(stored, os.path.join(args.out, fname))
            fp8_model = build(name, device, dtype, args.seed)
            fp8_model.load_state_dict(from_original(deq, cfg))
            with torch.no_grad():
                ref[key] = run(fp8_model, x).float()
            files.append(fname)
            del fp8_model, stored, deq
            if device != "cpu":
                torch.cuda.empty_cache()
    rank, alpha = (4, 8.0) if tiny else (args.rank, float(args.rank))
    adapters = add_lora(model, LORA_TARGETS, rank, alpha, args.seed, 0.05, dtype)
    out = run(model, x)
    loss = F.mse_loss(out.float(), x["target"].float())
    loss.backward()
    ref["output.lora_sample"] = out.detach().float()
    ref["output.loss"] = loss.detach().float().reshape(1)
    for n, p in adapters.items():
        ref[f"lora.{n}"] = p.detach().contiguous()
        ref[f"grad.{n}"] = p.grad.detach().float().contiguous()
    ref = {k: v.cpu().contiguous() for k, v in ref.items()}
    meta = {"config": name, "lora_rank": str(rank), "lora_alpha": str(alpha), "dtype": str(dtype).replace("torch.", ""),
            "height": str(height), "width": str(width), "text": str(text), "device": str(device),
            "torch": torch.__version__, "diffusers": diffusers.__version__}
    save_file(ref, os.path.join(args.out, "reference.safetensors"), metadata=meta)
    sizes = {f: os.path.getsize(os.path.join(args.out, f)) for f in files + ["reference.safetensors"]}
    print(json.dumps({"config": name, "out": args.out, "loss": loss.item(), "adapters": len(adapters),
                      "parameters": sum(p.numel() for p in model.parameters()), "bytes": sizes}))


def time_training(args):
    name = args.config
    device = args.device
    for ckpt in [c == "1" for c in args.checkpointing.split(",")]:
        torch.cuda.empty_cache()
        model = build(name, device, torch.bfloat16, args.seed)
        add_lora(model, LORA_TARGETS, args.rank, float(args.rank), args.seed, 0.0, torch.float32)
        if ckpt:
            model.enable_gradient_checkpointing()
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        x = make_inputs(name, args.batch, args.latent, args.latent, args.text, device, torch.bfloat16, args.seed + 10)
        net = torch.compile(model) if args.compile else model

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = run(net, x)
            loss = F.mse_loss(out.float(), x["target"].float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = time_steps(step, args.warmup, args.steps)
        print(json.dumps({"impl": "diffusers+peft" + ("+torch.compile" if args.compile else ""),
                          "work": f"{name}_lora_r{args.rank}_step", "latent": args.latent, "text": args.text,
                          "batch": args.batch, "checkpointing": ckpt, **t, "gpu": torch.cuda.get_device_name()}), flush=True)
        del model, opt, params, x, net


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--out", help="output folder (reference mode)")
    ap.add_argument("--latent", type=int, default=128, help="latent size of real configs (1024² images: 128; tiny: 8x12)")
    ap.add_argument("--text", type=int, default=333,
                    help="text tokens of real configs (SD3 pipelines: 77 CLIP + 256 T5 = 333, or 77 + 77 = 154)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1, help="batch of a real config (tiny: 2)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of real configs (alpha = rank; tiny: 4, alpha 8)")
    ap.add_argument("--fp8", action="store_true", help="also write the fp8 files for a real config (tiny: always)")
    ap.add_argument("--shard", default="", help="save_pretrained max_shard_size (tiny: 40KB, so the folder is sharded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="timing mode (bf16 autocast LoRA training step)")
    ap.add_argument("--checkpointing", default="0,1", help="timing: 0 and/or 1")
    ap.add_argument("--compile", action="store_true", help="timing: torch.compile the transformer (default mode)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.time:
        time_training(args)
    else:
        if not args.out:
            sys.exit("--out is required (reference mode)")
        write_reference(args)


if __name__ == "__main__":
    main()
