#!/usr/bin/env python3
"""diffusers' UNet2DConditionModel as the reference of FLAME's models/unet2d.

Needs torch, diffusers (0.42), peft and safetensors. Two modes.

Reference files (the CPU tests read the reduced ones; tools/unet_parity reads any):
  python3 apps/diffusion/reference/models_unet.py --config tiny-xl --out apps/diffusion/tests/data/models/unet2d-tiny-xl
  python3 apps/diffusion/reference/models_unet.py --config tiny-sd --out apps/diffusion/tests/data/models/unet2d-tiny-sd
  python3 apps/diffusion/reference/models_unet.py --config sdxl --latent 128 --dtype f32 --out /tmp/unet-sdxl-f32
builds the model with a fixed seed (PyTorch's default init, then N(0, 0.02) added to every
parameter so the norms' ones and zeros take part), and writes into OUT:
  unet/config.json, unet/diffusion_pytorch_model.safetensors   diffusers' save_pretrained (one file)
  unet_original.safetensors   the same tensors under the original single-file names
                              (model.diffusion_model.input_blocks..., converted here from the facts
                              of diffusers' convert_ldm_unet_checkpoint, in the other direction)
  reference.safetensors       input.sample / timestep / encoder_hidden_states / text_embeds /
                              time_ids / target; output.sample (no adapter); then with a PEFT LoRA
                              (rank r on to_q, to_k, to_v, to_out.0; lora_B drawn N(0, 0.05), not
                              zero): output.lora_sample, output.loss = mse(output, target), and per
                              adapter tensor lora.<module>.lora_{A,B}.weight and grad.<same>.
                              Metadata: lora_rank, lora_alpha, dtype, config, versions.
Reduced configs run on the CPU in f32; real ones on --device (cuda) in --dtype, TF32 off.

Timing (bf16, the SDXL LoRA r16 training step; the same step as unet_parity time):
  python3 apps/diffusion/reference/models_unet.py --config sdxl --time --latent 128 --batch 1,4
prints one JSON line per (batch, checkpointing): median step ms over --steps after --warmup, peak
allocated GiB. AdamW on the adapter parameters; loss mse(output.float(), target). --compile runs
the UNet through torch.compile (default mode; warmup_s includes the compilation).
"""
import argparse
import time
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_common import time_steps  # noqa: E402

CONFIGS = {
    # SDXL's shape at toy size: DownBlock2D first, linear projections, text_time (10 + 6 * 4 = 34).
    "tiny-xl": dict(
        sample_size=16, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], block_out_channels=[8, 16], layers_per_block=1,
        transformer_layers_per_block=[1, 2], cross_attention_dim=12, attention_head_dim=[2, 2], norm_num_groups=4,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=34),
    # SD 1.5's shape: cross-attention blocks first, 1x1 conv projections, no added embedding.
    "tiny-sd": dict(
        sample_size=16, down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], block_out_channels=[8, 16], layers_per_block=2,
        transformer_layers_per_block=1, cross_attention_dim=12, attention_head_dim=2, norm_num_groups=4,
        use_linear_projection=False),
    "sdxl": dict(
        sample_size=128, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], block_out_channels=[320, 640, 1280],
        layers_per_block=2, transformer_layers_per_block=[1, 2, 10], cross_attention_dim=2048,
        attention_head_dim=[5, 10, 20], use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816),
    "sd15": dict(
        sample_size=64, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2, cross_attention_dim=768,
        attention_head_dim=8),
    "sd21": dict(
        sample_size=96, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2, cross_attention_dim=1024,
        attention_head_dim=[5, 10, 20, 20], use_linear_projection=True, upcast_attention=True),
}
TINY = {"tiny-xl", "tiny-sd"}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


# ---- diffusers names -> original single-file names ----
RESNET = [("norm1.", "in_layers.0."), ("conv1.", "in_layers.2."), ("time_emb_proj.", "emb_layers.1."),
          ("norm2.", "out_layers.0."), ("conv2.", "out_layers.3."), ("conv_shortcut.", "skip_connection.")]
TOP = [("conv_in.", "input_blocks.0.0."), ("time_embedding.linear_1.", "time_embed.0."),
       ("time_embedding.linear_2.", "time_embed.2."), ("add_embedding.linear_1.", "label_emb.0.0."),
       ("add_embedding.linear_2.", "label_emb.0.2."), ("conv_norm_out.", "out.0."), ("conv_out.", "out.2.")]


def resnet_name(rest):
    for d, o in RESNET:
        if rest.startswith(d):
            return o + rest[len(d):]
    raise KeyError(rest)


def original_key(key, cfg):
    """down_blocks.b.resnets.j.X -> input_blocks.(1 + sum(L+1 of earlier blocks) + j).0.X, etc."""
    for d, o in TOP:
        if key.startswith(d):
            return "model.diffusion_model." + o + key[len(d):]
    n = len(cfg["block_out_channels"])
    lpb = cfg.get("layers_per_block", 2)
    layers = [lpb] * n if isinstance(lpb, int) else list(lpb)
    up_types = cfg.get("up_block_types", ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"])
    parts = key.split(".")
    if parts[0] == "mid_block":
        kind, j, rest = parts[1], int(parts[2]), ".".join(parts[3:])
        if kind == "resnets":
            return f"model.diffusion_model.middle_block.{2 * j}.{resnet_name(rest)}"
        return f"model.diffusion_model.middle_block.{2 * j + 1}.{rest}"
    group, b, kind, j, rest = parts[0], int(parts[1]), parts[2], int(parts[3]), ".".join(parts[4:])
    if group == "down_blocks":
        first = 1 + sum(layers[q] + 1 for q in range(b))
        if kind == "downsamplers":  # rest = "conv.weight"
            return f"model.diffusion_model.input_blocks.{first + layers[b]}.0.op.{rest[len('conv.'):]}"
        if kind == "resnets":
            return f"model.diffusion_model.input_blocks.{first + j}.0.{resnet_name(rest)}"
        return f"model.diffusion_model.input_blocks.{first + j}.1.{rest}"
    rev = list(reversed(layers))
    first = sum(rev[q] + 1 for q in range(b))
    if kind == "upsamplers":
        pos = 2 if up_types[b] == "CrossAttnUpBlock2D" else 1
        return f"model.diffusion_model.output_blocks.{first + rev[b]}.{pos}.{rest}"
    if kind == "resnets":
        return f"model.diffusion_model.output_blocks.{first + j}.0.{resnet_name(rest)}"
    return f"model.diffusion_model.output_blocks.{first + j}.1.{rest}"


# ---- model and inputs ----
def build(name, device, dtype, seed):
    from diffusers import UNet2DConditionModel
    torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**CONFIGS[name])
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():
            for p in unet.parameters():
                p.add_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    return unet.to(dtype)


def make_inputs(name, batch, latent, device, dtype, seed):
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(seed)
    seq = 7 if name in TINY else 77
    cross = cfg["cross_attention_dim"]
    inputs = {
        "sample": torch.randn(batch, 4, latent, latent, generator=g),
        "timestep": torch.tensor([981.0, 17.0, 500.0, 3.0] * batch)[:batch],
        "encoder_hidden_states": torch.randn(batch, seq, cross, generator=g),
        "target": torch.randn(batch, 4, latent, latent, generator=g),
    }
    if cfg.get("addition_embed_type") == "text_time":
        text = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        inputs["text_embeds"] = torch.randn(batch, text, generator=g)
        size = 8 * latent
        ids = [[size, size, 0, 0, size, size], [size * 3 // 4, size, size // 16, 0, size, size]]
        inputs["time_ids"] = torch.tensor([ids[i % 2] for i in range(batch)], dtype=torch.float32)
    out = {}
    for k, v in inputs.items():
        v = v.to(device)
        out[k] = v if k in ("timestep", "time_ids") else v.to(dtype)
    return out


def run(unet, x):
    added = {"text_embeds": x["text_embeds"], "time_ids": x["time_ids"]} if "text_embeds" in x else None
    return unet(x["sample"], x["timestep"], x["encoder_hidden_states"], added_cond_kwargs=added).sample


def add_lora(unet, rank, alpha, seed, b_std, dtype):
    from peft import LoraConfig
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=True, target_modules=LORA_TARGETS))
    unet.to(dtype)  # the adapters in the model's dtype, as FLAME's (PEFT may have made them f32)
    gen = torch.Generator().manual_seed(seed + 2)
    adapters = {}
    for n, p in unet.named_parameters():
        is_lora = ".lora_A." in n or ".lora_B." in n
        p.requires_grad_(is_lora)
        if is_lora:
            if ".lora_B." in n:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * b_std)
            adapters[n.replace(".default", "")] = p  # PEFT's saved name: no adapter name
    return adapters


def write_reference(args):
    from safetensors.torch import save_file
    import diffusers
    name = args.config
    tiny = name in TINY
    device = "cpu" if tiny else args.device
    dtype = torch.float32 if tiny else DTYPES[args.dtype]
    latent = 16 if tiny else args.latent
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)

    unet = build(name, device, dtype, args.seed)
    unet.save_pretrained(os.path.join(args.out, "unet"), safe_serialization=True, max_shard_size="100GB")
    cfg = CONFIGS[name]
    original = {original_key(k, cfg): v.detach().cpu().contiguous() for k, v in unet.state_dict().items()}
    save_file(original, os.path.join(args.out, "unet_original.safetensors"))

    x = make_inputs(name, args.batch if not tiny else 2, latent, device, dtype, args.seed + 10)
    ref = {f"input.{k}": v.contiguous() for k, v in x.items()}
    with torch.no_grad():
        ref["output.sample"] = run(unet, x).float()
    rank, alpha = (4, 8.0) if tiny else (args.rank, float(args.rank))
    adapters = add_lora(unet, rank, alpha, args.seed, 0.05, dtype)
    out = run(unet, x)
    loss = F.mse_loss(out.float(), x["target"].float())
    loss.backward()
    ref["output.lora_sample"] = out.detach().float()
    ref["output.loss"] = loss.detach().float().reshape(1)
    for n, p in adapters.items():
        ref[f"lora.{n}"] = p.detach().contiguous()
        ref[f"grad.{n}"] = p.grad.detach().float().contiguous()
    ref = {k: v.cpu().contiguous() for k, v in ref.items()}
    meta = {"config": name, "lora_rank": str(rank), "lora_alpha": str(alpha), "dtype": str(dtype).replace("torch.", ""),
            "latent": str(latent), "device": str(device), "torch": torch.__version__, "diffusers": diffusers.__version__}
    save_file(ref, os.path.join(args.out, "reference.safetensors"), metadata=meta)
    sizes = {f: os.path.getsize(os.path.join(args.out, f)) for f in
             ["unet/diffusion_pytorch_model.safetensors", "unet_original.safetensors", "reference.safetensors"]}
    print(json.dumps({"config": name, "out": args.out, "loss": loss.item(), "adapters": len(adapters),
                      "parameters": sum(p.numel() for p in unet.parameters()), "bytes": sizes}))


def time_training(args):
    name = args.config
    device = args.device
    for batch in [int(b) for b in args.batch_list.split(",")]:
        for ckpt in [c == "1" for c in args.checkpointing.split(",")]:
            torch.cuda.empty_cache()
            unet = build(name, device, torch.bfloat16, args.seed)
            adapters = add_lora(unet, args.rank, float(args.rank), args.seed, 0.0, torch.bfloat16)
            f32 = args.adapters == "f32"
            if f32:  # the precision of diffusers' LoRA scripts and of flame-diffusion finetune
                for p in adapters.values():
                    p.data = p.data.float()
            if ckpt:
                unet.enable_gradient_checkpointing()
            unet.train()
            params = [p for p in unet.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-4)
            x = make_inputs(name, batch, args.latent, device, torch.bfloat16, args.seed + 10)
            model = torch.compile(unet) if args.compile else unet

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=f32):
                    loss = F.mse_loss(run(model, x).float(), x["target"].float())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            t = time_steps(step, args.warmup, args.steps)
            print(json.dumps({"impl": "diffusers+peft" + ("+torch.compile" if args.compile else ""), "work": f"{name}_unet_lora_r{args.rank}_step", "latent": args.latent,
                              "batch": batch, "checkpointing": ckpt, "adapters": args.adapters, **t,
                              "gpu": torch.cuda.get_device_name()}), flush=True)
            del unet, opt, params, x


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--out", help="output folder (reference mode)")
    ap.add_argument("--latent", type=int, default=128, help="latent size of real configs (tiny: 16)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1, help="batch of a real-config reference (tiny: 2)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of real configs (alpha = rank; tiny: 4, alpha 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="timing mode (bf16 LoRA training step)")
    ap.add_argument("--batch-list", default="1,4", help="timing: batches")
    ap.add_argument("--checkpointing", default="0,1", help="timing: 0 and/or 1")
    ap.add_argument("--compile", action="store_true", help="timing: torch.compile the UNet (default mode)")
    ap.add_argument("--adapters", choices=["bf16", "f32"], default="bf16",
                    help="timing: bf16 adapters in a bf16 step, or f32 adapters under bf16 autocast (the precision "
                         "of diffusers' LoRA scripts and of flame-diffusion finetune)")
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
