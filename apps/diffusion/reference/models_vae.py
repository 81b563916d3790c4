#!/usr/bin/env python3
"""Reference outputs of diffusers' AutoencoderKL for FLAME's models/vae.h (parity and timing).

Two modes. Both build diffusers.AutoencoderKL at a configuration with a fixed seed (torch's init, then
N(0, 0.05) noise on every 1-d parameter so the norms and biases are not 1/0), round the weights to
the stored dtype, and save
  OUT/diffusers/                 config.json + weights (save_pretrained; the real configurations
                                 sharded at 100 MB, so the shard index is exercised)
  OUT/<single file>              the same weights in the original (LDM) names: SD/SD3 under
                                 "first_stage_model.", SDXL bare as a ComfyUI VAE file, FLUX bare
                                 as ae.safetensors; mid attention q/k/v/proj_out as 1x1 convs
  OUT/reference.safetensors      inputs and diffusers' outputs (f32 copies): image, mean, logvar,
                                 latent, decoded, tiled_image, tiled_mean, tiled_logvar,
                                 tiled_latent, tiled_decoded; metadata: config, dtype, family,
                                 single_file, tile_sample_size

--reduced --out DIR      the CPU-test configurations (DIR/vae_tiny, DIR/vae_tiny16; ~0.5 MB in all,
                         bf16 weights, f32 compute on the CPU). apps/diffusion/tests/test_models_vae.cpp
                         (ModelsVae.MatchesDiffusersReferenceOutputs) reads them from
                         apps/diffusion/tests/data/models.
--config sd|sdxl|sd3|flux --size 256|1024 --dtype f32|bf16 --out DIR [--device cuda] [--time]
                         a real configuration on the GPU (TF32 off for f32); tiles of half the image.
                         --time also times diffusers' encode and decode (CUDA events, 3 warm-ups,
                         median of 10) and peak memory, printed as JSON lines and written to
                         DIR/timing.json. Then: build/apps/diffusion/vae_parity --dir DIR [--time].
                         --compile (with --time) adds rows for torch.compile'd decode and encode
                         (default mode; first_call_s is the compile time).

Needs torch, diffusers (0.42; pure Python: pip install diffusers-0.42*.whl importlib_metadata),
safetensors.
"""
import argparse
import time
import json
import os
import statistics

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

REAL = {
    # block_out_channels, layers_per_block, latent_channels, quant convs, scaling, shift, sample_size
    "sd": dict(latent_channels=4, use_quant_conv=True, scaling_factor=0.18215, shift_factor=None, sample_size=512),
    "sdxl": dict(latent_channels=4, use_quant_conv=True, scaling_factor=0.13025, shift_factor=None, sample_size=1024),
    "sd3": dict(latent_channels=16, use_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609, sample_size=1024),
    "flux": dict(latent_channels=16, use_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159, sample_size=1024),
}
# How each family's single file is usually found: (file name, key prefix).
SINGLE_FILE = {
    "sd": ("v1-5-vae.safetensors", "first_stage_model."),
    "sdxl": ("sdxl_vae.safetensors", ""),
    "sd3": ("sd3_vae.safetensors", "first_stage_model."),
    "flux": ("ae.safetensors", ""),
}


def vae_config(family, block_out=(128, 256, 512, 512), layers=2, groups=32, sample_size=None):
    r = REAL[family]
    n = len(block_out)
    return dict(
        in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * n, up_block_types=["UpDecoderBlock2D"] * n,
        block_out_channels=list(block_out), layers_per_block=layers, act_fn="silu",
        latent_channels=r["latent_channels"], norm_num_groups=groups,
        sample_size=sample_size or r["sample_size"], scaling_factor=r["scaling_factor"],
        shift_factor=r["shift_factor"], force_upcast=True,
        use_quant_conv=r["use_quant_conv"], use_post_quant_conv=r["use_quant_conv"],
        mid_block_add_attention=True)


def to_original(key, levels):
    """diffusers name -> LDM name (the facts of diffusers' convert_ldm_vae_checkpoint, inverted)."""
    parts = key.split(".")
    if parts[0] == "decoder" and parts[1] == "up_blocks":
        parts[1:3] = ["up", str(levels - 1 - int(parts[2]))]
    elif parts[0] == "encoder" and parts[1] == "down_blocks":
        parts[1] = "down"
    k = ".".join(parts)
    for a, b in [(".resnets.", ".block."), (".downsamplers.0.", ".downsample."), (".upsamplers.0.", ".upsample."),
                 ("mid_block.block.0.", "mid.block_1."), ("mid_block.block.1.", "mid.block_2."),
                 ("mid_block.attentions.0.group_norm.", "mid.attn_1.norm."),
                 ("mid_block.attentions.0.to_q.", "mid.attn_1.q."), ("mid_block.attentions.0.to_k.", "mid.attn_1.k."),
                 ("mid_block.attentions.0.to_v.", "mid.attn_1.v."),
                 ("mid_block.attentions.0.to_out.0.", "mid.attn_1.proj_out."),
                 ("conv_shortcut", "nin_shortcut"), ("conv_norm_out", "norm_out")]:
        k = k.replace(a, b)
    return k


def original_state_dict(vae, prefix, dtype):
    levels = len(vae.config.block_out_channels)
    out = {}
    for name, t in vae.state_dict().items():
        k = to_original(name, levels)
        if ".mid.attn_1." in k and k.endswith(".weight") and ".norm." not in k:
            t = t[:, :, None, None]  # the original stores the attention's Linear layers as 1x1 convs
        out[prefix + k] = t.detach().to(dtype).contiguous()
    return out


def build(config, seed, store_dtype):
    torch.manual_seed(seed)
    vae = AutoencoderKL(**config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in vae.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
            p.copy_(p.to(store_dtype).float())  # the stored values are the computed ones
    return vae


def run_outputs(vae, family_cfg, size, tile, device, dtype, seed):
    g = torch.Generator().manual_seed(seed + 2)
    f = 2 ** (len(family_cfg["block_out_channels"]) - 1)
    lat_c = family_cfg["latent_channels"]
    ins = {
        "image": torch.rand(1, 3, size, size, generator=g) * 2 - 1,
        "latent": torch.randn(1, lat_c, size // f, size // f, generator=g),
        "tiled_image": torch.rand(1, 3, 2 * tile, 3 * tile // 2, generator=g) * 2 - 1,
        "tiled_latent": torch.randn(1, lat_c, 2 * tile // f, 3 * tile // 2 // f, generator=g),
    }
    out = dict(ins)
    with torch.no_grad():
        vae.disable_tiling()
        post = vae.encode(ins["image"].to(device, dtype)).latent_dist
        out["mean"], out["logvar"] = post.mean, post.logvar
        out["decoded"] = vae.decode(ins["latent"].to(device, dtype)).sample
        vae.enable_tiling()
        vae.tile_sample_min_size = tile
        vae.tile_latent_min_size = tile // f
        vae.tile_overlap_factor = 0.25
        post = vae.encode(ins["tiled_image"].to(device, dtype)).latent_dist
        out["tiled_mean"], out["tiled_logvar"] = post.mean, post.logvar
        out["tiled_decoded"] = vae.decode(ins["tiled_latent"].to(device, dtype)).sample
        vae.disable_tiling()
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def write_case(out_dir, family, config, size, tile, device, dtype_name, seed, shard):
    store = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    vae = build(config, seed, store)
    os.makedirs(out_dir, exist_ok=True)
    save_kwargs = {"max_shard_size": "100MB"} if shard else {}
    vae.to(store).save_pretrained(os.path.join(out_dir, "diffusers"), safe_serialization=True, **save_kwargs)
    name, prefix = SINGLE_FILE[family]
    save_file(original_state_dict(vae, prefix, store), os.path.join(out_dir, name))
    compute = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    vae = vae.to(device=device, dtype=compute)
    outs = run_outputs(vae, config, size, tile, device, compute, seed)
    meta = {"config": json.dumps(config), "dtype": dtype_name, "family": family, "single_file": name,
            "tile_sample_size": str(tile), "size": str(size)}
    save_file(outs, os.path.join(out_dir, "reference.safetensors"), metadata=meta)
    return vae


def time_ms(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timing(vae, config, size, dtype, device, compiled=False):
    f = 2 ** (len(config["block_out_channels"]) - 1)
    img = torch.rand(1, 3, size, size, device=device, dtype=dtype) * 2 - 1
    lat = torch.randn(1, config["latent_channels"], size // f, size // f, device=device, dtype=dtype)
    rows = []
    impl = "diffusers+torch.compile" if compiled else "diffusers"
    dec, enc = vae.decode, vae.encode
    if compiled:  # torch.compile of the two methods (default mode); the first call compiles
        dec, enc = torch.compile(vae.decode), torch.compile(vae.encode)
    with torch.no_grad():
        for what, fn in [("decode", lambda: dec(lat).sample), ("encode", lambda: enc(img).latent_dist.mean)]:
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            first_s = time.time() - t0
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = time_ms(fn)
            peak = torch.cuda.max_memory_allocated()
            rows.append({"impl": impl, "work": what, "size": size, "ms": round(ms, 3),
                         "peak_gib": round(peak / 2**30, 3), "peak_over_weights_gib": round((peak - base) / 2**30, 3),
                         "first_call_s": round(first_s, 1), "device": torch.cuda.get_device_name()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def tiled_vs_untiled(vae, config, size, dtype, device):
    """diffusers' own tiled decode (tiles of half the image, 0.25 overlap) against its untiled one:
    the seam error that FLAME's tiled_decode reproduces (vae_parity --time prints FLAME's)."""
    f = 2 ** (len(config["block_out_channels"]) - 1)
    g = torch.Generator(device="cpu").manual_seed(5)
    lat = torch.randn(1, config["latent_channels"], size // f, size // f, generator=g).to(device, dtype)
    saved = (vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor)
    vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor = size // 2, size // 2 // f, 0.25
    with torch.no_grad():
        full = vae.decode(lat).sample.float()
        tiled = vae.tiled_decode(lat).sample.float()
    vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor = saved
    d = (tiled - full).abs()
    return {"impl": "diffusers", "work": "tiled_vs_untiled_decode", "size": size, "tile": size // 2,
            "max_abs": float(d.max()), "max_rel": float(d.max() / full.abs().max()), "mean_abs": float(d.mean()),
            "mean_abs_untiled": float(full.abs().mean())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--config", choices=sorted(REAL))
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--compile", action="store_true", help="--time: also torch.compile'd decode and encode")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    if a.reduced:
        # f32 compute on the CPU from bf16-rounded weights stored in bf16 (small files).
        # Two levels of 8 and 16 channels, 4 norm groups, 16-pixel images and tiles (~45k weights each).
        cases = [("vae_tiny", "sdxl", dict(block_out=(8, 16), layers=1, groups=4, sample_size=16)),
                 ("vae_tiny16", "flux", dict(block_out=(8, 16), layers=1, groups=4, sample_size=16))]
        for name, family, kw in cases:
            cfg = vae_config(family, **kw)
            store = torch.bfloat16
            vae = build(cfg, a.seed, store)
            d = os.path.join(a.out, name)
            os.makedirs(d, exist_ok=True)
            vae.to(store).save_pretrained(os.path.join(d, "diffusers"), safe_serialization=True)
            fname, prefix = SINGLE_FILE[family]
            save_file(original_state_dict(vae, prefix, store), os.path.join(d, fname))
            outs = run_outputs(vae.float(), cfg, 16, 16, "cpu", torch.float32, a.seed)
            meta = {"config": json.dumps(cfg), "dtype": "f32", "family": family, "single_file": fname,
                    "tile_sample_size": "16", "size": "16"}
            save_file(outs, os.path.join(d, "reference.safetensors"), metadata=meta)
            total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
            print(f"{d}: {total / 1024:.0f} KiB")
        return

    if not a.config:
        ap.error("give --reduced or --config")
    cfg = vae_config(a.config)
    vae = write_case(a.out, a.config, cfg, a.size, a.size // 2, a.device, a.dtype, a.seed, shard=True)
    print(f"wrote {a.out} ({a.config}, {a.size}px, {a.dtype})")
    if a.time:
        dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        rows = timing(vae, cfg, 1024, dt, a.device)
        print(json.dumps(tiled_vs_untiled(vae, cfg, 1024, dt, a.device)), flush=True)
        if a.compile:
            rows += timing(vae, cfg, 1024, dt, a.device, compiled=True)
        with open(os.path.join(a.out, "timing.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
