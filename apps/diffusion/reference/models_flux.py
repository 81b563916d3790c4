#!/usr/bin/env python3
"""diffusers' FluxTransformer2DModel (FLUX.1) as the reference of FLAME's models/flux.

Needs torch, diffusers (0.42), peft and safetensors. Two modes.

Reference files (the CPU tests read the reduced one; tools/flux_parity reads any):
  python3 apps/diffusion/reference/models_flux.py --config tiny-flux --out apps/diffusion/tests/data/models/flux-tiny
  python3 apps/diffusion/reference/models_flux.py --config flux-dev-d2 --dtype bf16 --out /tmp/flux-d2
builds the model with a fixed seed (PyTorch's default init, then N(0, 0.02) added to every
parameter so the zero-initialised layers take part) and writes into OUT:
  transformer/config.json, transformer/diffusion_pytorch_model*.safetensors
                              diffusers' save_pretrained, sharded with its .index.json
  flux_original.safetensors   the same tensors under BFL's names (img_in, double_blocks.N.img_attn.qkv,
                              single_blocks.N.linear1, final_layer.adaLN_modulation.1 with shift and
                              scale in BFL's order ...), converted here in the other direction from the
                              facts of diffusers' convert_flux_transformer_checkpoint_to_diffusers
  flux_comfy_fp8.safetensors  (reduced configs, and real ones with --fp8) BFL names under "model.diffusion_model.", every 2-d
                              weight F8_E4M3, plus two keys of other models (a ComfyUI full checkpoint)
  flux_fp8_scaled.safetensors (the same) bare BFL names, 2-d weights F8_E4M3 with a one-element
                              f32 .scale_weight each, .scale_input keys and the scaled_fp8 marker
  reference.safetensors       input.latents [B, C, H, W], input.hidden_states (FluxPipeline._pack_latents
                              of them), input.encoder_hidden_states, input.pooled_projections,
                              input.timestep, input.guidance, input.img_ids
                              (FluxPipeline._prepare_latent_image_ids), input.txt_ids, input.target;
                              rope.cos / rope.sin (FluxPosEmbed over cat(txt_ids, img_ids));
                              output.sample; output.fp8_sample and output.fp8_scaled_sample (the model
                              with each fp8 file's dequantised weights); then with a PEFT LoRA (rank r
                              on to_q, to_k, to_v, to_out.0; lora_B drawn N(0, 0.05), not zero):
                              output.lora_sample, output.loss = mse(output, target), and per adapter
                              lora.<module>.lora_{A,B}.weight and grad.<same>.
                              Metadata: config, lora_rank, lora_alpha, dtype, height, width, text.
Reduced configs run on the CPU in f32; real ones on --device (cuda) in --dtype, TF32 off.

Timing (the FLUX LoRA r16 training step, as flux_parity time: bf16 autocast, bf16 weights, f32
adapters, AdamW, mse loss; 1024² = 4096 image tokens, 512 text tokens):
  python3 apps/diffusion/reference/models_flux.py --config flux-dev --time [--compile] [--fp8-storage]
prints one JSON line per checkpointing setting: median step ms (CUDA events) and peak GiB.
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

BASE = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
            axes_dims_rope=(16, 56, 56))
CONFIGS = {
    "flux-dev": dict(BASE, guidance_embeds=True),
    "flux-schnell": dict(BASE, guidance_embeds=False),
    "flux-dev-d2": dict(BASE, guidance_embeds=True, num_layers=2, num_single_layers=2),
    "tiny-flux": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
                      num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True,
                      axes_dims_rope=(2, 2, 4)),
}
TINY = {"tiny-flux"}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
PREFIX = "model.diffusion_model."


# ---- the BFL layout (facts of diffusers' convert_flux_transformer_checkpoint_to_diffusers) ----
def swap_halves(t):
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _linear_pairs(cfg):
    """(diffusers module, BFL module) for every plain Linear."""
    pairs = [("x_embedder", "img_in"), ("context_embedder", "txt_in"),
             ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
             ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
             ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
             ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
             ("proj_out", "final_layer.linear")]
    if cfg["guidance_embeds"]:
        pairs += [("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
                  ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer")]
    for i in range(cfg["num_layers"]):
        t, s = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        pairs += [(t + "norm1.linear", s + "img_mod.lin"), (t + "norm1_context.linear", s + "txt_mod.lin"),
                  (t + "attn.to_out.0", s + "img_attn.proj"), (t + "attn.to_add_out", s + "txt_attn.proj"),
                  (t + "ff.net.0.proj", s + "img_mlp.0"), (t + "ff.net.2", s + "img_mlp.2"),
                  (t + "ff_context.net.0.proj", s + "txt_mlp.0"), (t + "ff_context.net.2", s + "txt_mlp.2")]
    for i in range(cfg["num_single_layers"]):
        t, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        pairs += [(t + "norm.linear", s + "modulation.lin"), (t + "proj_out", s + "linear2")]
    return pairs


def _norm_pairs(cfg):
    pairs = []
    for i in range(cfg["num_layers"]):
        t, s = f"transformer_blocks.{i}.attn.", f"double_blocks.{i}."
        pairs += [(t + "norm_q", s + "img_attn.norm.query_norm"), (t + "norm_k", s + "img_attn.norm.key_norm"),
                  (t + "norm_added_q", s + "txt_attn.norm.query_norm"),
                  (t + "norm_added_k", s + "txt_attn.norm.key_norm")]
    for i in range(cfg["num_single_layers"]):
        t, s = f"single_transformer_blocks.{i}.attn.", f"single_blocks.{i}."
        pairs += [(t + "norm_q", s + "norm.query_norm"), (t + "norm_k", s + "norm.key_norm")]
    return pairs


def to_original(sd, cfg):
    """diffusers state dict -> BFL names."""
    o = {}
    for d, b in _linear_pairs(cfg):
        for p in ("weight", "bias"):
            o[f"{b}.{p}"] = sd[f"{d}.{p}"]
    for d, b in _norm_pairs(cfg):
        o[f"{b}.scale"] = sd[f"{d}.weight"]
    for i in range(cfg["num_layers"]):
        t, s = f"transformer_blocks.{i}.attn.", f"double_blocks.{i}."
        for p in ("weight", "bias"):
            o[f"{s}img_attn.qkv.{p}"] = torch.cat([sd[f"{t}to_{q}.{p}"] for q in "qkv"], 0)
            o[f"{s}txt_attn.qkv.{p}"] = torch.cat([sd[f"{t}add_{q}_proj.{p}"] for q in "qkv"], 0)
    for i in range(cfg["num_single_layers"]):
        t, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for p in ("weight", "bias"):
            o[f"{s}linear1.{p}"] = torch.cat([sd[f"{t}attn.to_{q}.{p}"] for q in "qkv"] + [sd[f"{t}proj_mlp.{p}"]], 0)
    for p in ("weight", "bias"):
        o[f"final_layer.adaLN_modulation.1.{p}"] = swap_halves(sd[f"norm_out.linear.{p}"])
    return {k: v.detach().cpu().contiguous() for k, v in o.items()}


def from_original(o, cfg):
    """The inverse of to_original (to run diffusers on an fp8 file's dequantised weights)."""
    sd = {}
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    for d, b in _linear_pairs(cfg):
        for p in ("weight", "bias"):
            sd[f"{d}.{p}"] = o[f"{b}.{p}"]
    for d, b in _norm_pairs(cfg):
        sd[f"{d}.weight"] = o[f"{b}.scale"]
    for i in range(cfg["num_layers"]):
        t, s = f"transformer_blocks.{i}.attn.", f"double_blocks.{i}."
        for p in ("weight", "bias"):
            for q, part in zip("qkv", o[f"{s}img_attn.qkv.{p}"].chunk(3, 0)):
                sd[f"{t}to_{q}.{p}"] = part
            for q, part in zip("qkv", o[f"{s}txt_attn.qkv.{p}"].chunk(3, 0)):
                sd[f"{t}add_{q}_proj.{p}"] = part
    for i in range(cfg["num_single_layers"]):
        t, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for p in ("weight", "bias"):
            q, k, v, mlp = o[f"{s}linear1.{p}"].split([inner, inner, inner, 4 * inner], 0)
            sd[f"{t}attn.to_q.{p}"], sd[f"{t}attn.to_k.{p}"], sd[f"{t}attn.to_v.{p}"] = q, k, v
            sd[f"{t}proj_mlp.{p}"] = mlp
    for p in ("weight", "bias"):
        sd[f"norm_out.linear.{p}"] = swap_halves(o[f"final_layer.adaLN_modulation.1.{p}"])
    return sd


def fp8_of(original, scaled):
    """(stored tensors, dequantised f32 tensors): 2-d weights in F8_E4M3, scaled per tensor when asked."""
    stored, deq = {}, {}
    for k, v in original.items():
        if v.dim() == 2 and k.endswith(".weight"):
            if scaled:
                s = (v.abs().max().float() / 448.0).clamp(min=1e-12).reshape(1)
                q = (v.float() / s).to(torch.float8_e4m3fn)
                stored[k], stored[k[: -len("weight")] + "scale_weight"] = q, s
                stored[k[: -len("weight")] + "scale_input"] = torch.ones(1)
                deq[k] = q.float() * s
            else:
                q = v.float().to(torch.float8_e4m3fn)
                stored[k], deq[k] = q, q.float()
        else:
            stored[k], deq[k] = v, v.float()
    if scaled:
        stored["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    return stored, deq


# ---- model and inputs ----
def build(name, device, dtype, seed):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(seed)
    with torch.device(device):
        model = FluxTransformer2DModel(**CONFIGS[name])
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    return model.to(dtype)


def make_inputs(name, batch, height, width, text, device, dtype, seed):
    from diffusers import FluxPipeline
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(seed)
    c = cfg["in_channels"] // 4
    latents = torch.randn(batch, c, height, width, generator=g)
    x = {
        "latents": latents,
        "hidden_states": FluxPipeline._pack_latents(latents, batch, c, height, width),
        "encoder_hidden_states": torch.randn(batch, text, cfg["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(batch, cfg["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([0.981, 0.0175, 0.5, 0.003] * batch)[:batch],
        "guidance": torch.tensor([3.5, 1.0, 7.0, 0.0] * batch)[:batch],
        "img_ids": FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, "cpu", torch.float32),
        "txt_ids": torch.zeros(text, 3),
        "target": torch.randn(batch, (height // 2) * (width // 2), cfg["in_channels"], generator=g),
    }
    keep = {"timestep", "guidance", "img_ids", "txt_ids"}
    return {k: v.to(device) if k in keep else v.to(device, dtype) for k, v in x.items()}


def run(model, x, guidance):
    return model(hidden_states=x["hidden_states"], encoder_hidden_states=x["encoder_hidden_states"],
                 pooled_projections=x["pooled_projections"], timestep=x["timestep"], img_ids=x["img_ids"],
                 txt_ids=x["txt_ids"], guidance=x["guidance"] if guidance else None).sample


def write_reference(args):
    from safetensors.torch import save_file
    import diffusers
    name = args.config
    tiny = name in TINY
    cfg = CONFIGS[name]
    guidance = cfg["guidance_embeds"]
    device = "cpu" if tiny else args.device
    dtype = torch.float32 if tiny else DTYPES[args.dtype]
    height, width = (8, 12) if tiny else (args.latent, args.latent)
    text = 5 if tiny else args.text
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)

    model = build(name, device, dtype, args.seed)
    model.save_pretrained(os.path.join(args.out, "transformer"), safe_serialization=True,
                          max_shard_size=args.shard or ("60KB" if tiny else "10GB"))
    original = to_original(model.state_dict(), cfg)
    save_file(original, os.path.join(args.out, "flux_original.safetensors"))
    files = ["flux_original.safetensors"]

    x = make_inputs(name, 2 if tiny else args.batch, height, width, text, device, dtype, args.seed + 10)
    ref = {f"input.{k}": v.contiguous() for k, v in x.items()}
    ids = torch.cat([x["txt_ids"], x["img_ids"]], 0)
    ref["rope.cos"], ref["rope.sin"] = model.pos_embed(ids)
    with torch.no_grad():
        ref["output.sample"] = run(model, x, guidance).float()
    if tiny or args.fp8:
        for scaled, fname, key in [(False, "flux_comfy_fp8.safetensors", "output.fp8_sample"),
                                   (True, "flux_fp8_scaled.safetensors", "output.fp8_scaled_sample")]:
            stored, deq = fp8_of(original, scaled)
            if not scaled:  # a ComfyUI full checkpoint: prefixed, with other models' keys beside it
                stored = {PREFIX + k: v for k, v in stored.items()}
                stored["vae.decoder.conv_out.bias"] = torch.zeros(3)
                stored["text_encoders.clip_l.transformer.text_model.final_layer_norm.bias"] = torch.zeros(4)
            save_file(stored, os.path.join(args.out, fname))
            fp8_model = build(name, device, dtype, args.seed)
            fp8_model.load_state_dict(from_original(deq, cfg))
            with torch.no_grad():
                ref[key] = run(fp8_model, x, guidance).float()
            files.append(fname)
    rank, alpha = (4, 8.0) if tiny else (args.rank, float(args.rank))
    adapters = add_lora(model, LORA_TARGETS, rank, alpha, args.seed, 0.05, dtype)
    out = run(model, x, guidance)
    loss = F.mse_loss(out.float(), x["target"].float())
    loss.backward()
    ref["output.lora_sample"] = out.detach().float()
    ref["output.loss"] = loss.detach().float().reshape(1)
    for n, p in adapters.items():
        ref[f"lora.{n}"] = p.detach().contiguous()
        ref[f"grad.{n}"] = p.grad.detach().float().contiguous()
    ref = {k: v.detach().cpu().contiguous() for k, v in ref.items()}
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
    guidance = CONFIGS[name]["guidance_embeds"]
    for ckpt in [c == "1" for c in args.checkpointing.split(",")]:
        torch.cuda.empty_cache()
        model = build(name, device, torch.bfloat16, args.seed)
        if args.fp8_storage:
            # The base's weights stored in float8_e4m3fn, cast to bf16 layer by layer as they run
            # (diffusers' layerwise casting, the fp8_base users have in diffusers); before the
            # adapters, so they stay f32.
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
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
                out = run(net, x, guidance)
            loss = F.mse_loss(out.float(), x["target"].float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = time_steps(step, args.warmup, args.steps)
        print(json.dumps({"impl": "diffusers+peft" + ("+torch.compile" if args.compile else "") +
                          ("+fp8_storage" if args.fp8_storage else ""),
                          "work": f"{name}_lora_r{args.rank}_step", "latent": args.latent, "text": args.text,
                          "batch": args.batch, "checkpointing": ckpt, **t, "gpu": torch.cuda.get_device_name()}), flush=True)
        del model, opt, params, x, net


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--out", help="output folder (reference mode)")
    ap.add_argument("--latent", type=int, default=128, help="latent size of real configs (1024² images: 128; tiny: 8x12)")
    ap.add_argument("--text", type=int, default=512, help="text tokens of real configs (FLUX.1-dev pipelines: 512)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1, help="batch of a real config (tiny: 2)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of real configs (alpha = rank; tiny: 4, alpha 8)")
    ap.add_argument("--shard", default="", help="save_pretrained max_shard_size (tiny: 60KB, so the folder is sharded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="timing mode (bf16 autocast LoRA training step)")
    ap.add_argument("--checkpointing", default="0,1", help="timing: 0 and/or 1")
    ap.add_argument("--compile", action="store_true", help="timing: torch.compile the transformer (default mode)")
    ap.add_argument("--fp8", action="store_true", help="also write the fp8 files for a real config (tiny: always)")
    ap.add_argument("--fp8-storage", action="store_true",
                    help="timing: the base stored in float8_e4m3fn, cast per layer (enable_layerwise_casting)")
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
