#!/usr/bin/env python3
"""transformers' CLIP and T5 text encoders as the reference of FLAME's models/clip_text.h and
models/t5_encoder.h (parity and timing). Needs torch, transformers and safetensors (no diffusers).

Reference files (tools/text_parity reads any; the CPU tests read the reduced ones):
  python3 apps/diffusion/reference/models_text.py --reduced --out apps/diffusion/tests/data/models
      writes text-tiny-clip, text-tiny-clip-g and text-tiny-t5 (each < 1 MB: bf16 weights, f32 and
      bf16 compute on the CPU)
  python3 apps/diffusion/reference/models_text.py --config clip-l|clip-g|t5-xxl --dtype f32|bf16 --out DIR
      a real configuration on --device (cuda), TF32 off; then: build/apps/diffusion/text_parity --dir DIR

A model is built at its configuration with a fixed seed (transformers' init, then N(0, 0.05) added to
every 1-d parameter so the layer norms and biases are not 1/0), its weights rounded to the stored
dtype, and written to DIR in every layout FLAME loads (models/text_checkpoint.h):
  transformers/                   save_pretrained (the real configurations sharded, at 200 MB for
                                  CLIP and 2 GB for T5, so the index is exercised)
  CLIP-L: clip_l.safetensors      ComfyUI: transformers' names, bare
          sdxl.safetensors        "conditioner.embedders.0.transformer." + text_model.* (no projection;
                                  with text_model.embeddings.position_ids as SDXL files have it)
          sd3.safetensors         "text_encoders.clip_l.transformer." + text_model.* (no projection)
  bigG:   clip_g.safetensors      ComfyUI: transformers' names, bare
          sdxl.safetensors        "conditioner.embedders.1.model." in OpenCLIP's names (fused in_proj,
                                  text_projection stored transposed, logit_scale)
          sd3.safetensors         "text_encoders.clip_g.transformer." + transformers' names
  T5:     t5xxl.safetensors       ComfyUI t5xxl_fp16 layout: bare, shared.weight and its tied copy
                                  encoder.embed_tokens.weight
          sd3.safetensors         "text_encoders.t5xxl.transformer." + shared.weight, encoder.*
          t5xxl_fp8_e4m3fn.safetensors         the Linear weights and the embedding stored F8_E4M3
          t5xxl_fp8_e4m3fn_scaled.safetensors  "scaled_fp8" marker; each Linear weight W stored as
                                  F8_E4M3 of W / s with <module>.scale_weight = s = max|W| / 448 (f32)
With --reduced, the tiny models' sdxl.safetensors holds both tiny CLIPs (the loader must pick by
family) and the T5's sd3.safetensors holds all three encoders.
  reference.safetensors           input_ids [3, L] (row 0 full, rows 1-2 padded: CLIP-L pads with
                                  EOS, bigG and T5 with 0), attention_mask [3, L], and outputs (f32
                                  copies): CLIP: last_hidden_state, penultimate (hidden_states[-2]),
                                  embeddings (hidden_states[0]), pooled, text_embeds; masked_* the
                                  same with the attention mask; T5: last_hidden_state (with the
                                  mask), unmasked_last_hidden_state, fp8_* and fp8_scaled_* (the
                                  model with the fp8 files' dequantized weights), and buckets (the
                                  relative position buckets of distances -511..511).
                                  --reduced adds bf16_* (the same model run in bf16 on the CPU);
                                  a real bf16 run adds f32ref_* (its exact layouts' outputs computed
                                  in f32 from the same weights).
                                  Metadata: config (JSON), dtype, family, files (JSON: file -> output
                                  prefix, "" for the exact layouts), versions.

Timing (bf16, --device cuda; the same work as text_parity --time):
  python3 apps/diffusion/reference/models_text.py --config t5-xxl --time --batch 16 --length 512 --out DIR
  python3 apps/diffusion/reference/models_text.py --config clip-l --time --batch 64 --length 77 --out DIR
prints one JSON line per encoder: median ms of 10 encodes after 3 warm-ups (CUDA events), peak
allocated GiB.
"""
import argparse
import json
import os
import statistics

import torch
from safetensors.torch import save_file

import transformers
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

CLIP = {
    "clip-l": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                   projection_dim=768, eos_token_id=2, bos_token_id=0, pad_token_id=1),
    "clip-g": dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                   num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
                   projection_dim=1280, eos_token_id=2, bos_token_id=0, pad_token_id=1),
    # Reduced: the legacy eos rule (argmax of the ids) for tiny-clip, the eos id rule for tiny-clip-g.
    "tiny-clip": dict(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, max_position_embeddings=16, hidden_act="quick_gelu",
                      projection_dim=24, eos_token_id=2, bos_token_id=0, pad_token_id=1),
    "tiny-clip-g": dict(vocab_size=500, hidden_size=40, intermediate_size=80, num_hidden_layers=3,
                        num_attention_heads=5, max_position_embeddings=16, hidden_act="gelu",
                        projection_dim=40, eos_token_id=499, bos_token_id=498, pad_token_id=0),
}
T5 = {
    "t5-xxl": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64),
    "tiny-t5": dict(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4),
}
FAMILY = {"clip-l": "clip-l", "tiny-clip": "clip-l", "clip-g": "clip-g", "tiny-clip-g": "clip-g",
          "t5-xxl": "t5-xxl", "tiny-t5": "t5-xxl"}


def family_of(name):
    return FAMILY[name]


def t5_config(name):
    return T5Config(**T5[name], relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
                    is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)


def build(name, seed, store, device):
    torch.manual_seed(seed)
    with torch.device(device):
        if name in CLIP:
            model = CLIPTextModelWithProjection(CLIPTextConfig(**CLIP[name], layer_norm_eps=1e-5))
        else:
            model = T5EncoderModel(t5_config(name))
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g, device=device) * 0.05)
            p.copy_(p.to(store).float())  # the stored values are the computed ones
    return model


def state(model, store):
    """The stored tensors (T5's encoder.embed_tokens.weight, the tied copy of shared.weight, left out)."""
    return {k: v.detach().to(store).contiguous().cpu() for k, v in model.state_dict().items()
            if k != "encoder.embed_tokens.weight"}


# ---- layouts ----

def clip_l_files(sd, extra_sdxl=None):
    text = {k: v for k, v in sd.items() if k.startswith("text_model.") and not k.endswith("position_ids")}
    L = text["text_model.embeddings.position_embedding.weight"].shape[0]
    sdxl = {"conditioner.embedders.0.transformer." + k: v for k, v in text.items()}
    sdxl["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = torch.arange(L)[None]
    sd3 = {"text_encoders.clip_l.transformer." + k: v for k, v in text.items()}
    return {"clip_l.safetensors": dict(sd), "sdxl.safetensors": sdxl, "sd3.safetensors": sd3}


def openclip_names(sd, prefix):
    """transformers' CLIP names -> OpenCLIP's (the inverse of diffusers' convert_open_clip_checkpoint)."""
    out = {}
    tm = "text_model."
    out[prefix + "token_embedding.weight"] = sd[tm + "embeddings.token_embedding.weight"]
    out[prefix + "positional_embedding"] = sd[tm + "embeddings.position_embedding.weight"]
    out[prefix + "ln_final.weight"] = sd[tm + "final_layer_norm.weight"]
    out[prefix + "ln_final.bias"] = sd[tm + "final_layer_norm.bias"]
    out[prefix + "text_projection"] = sd["text_projection.weight"].t().contiguous()
    out[prefix + "logit_scale"] = torch.tensor(4.6052, dtype=sd["text_projection.weight"].dtype)
    n = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith(tm + "encoder.layers."))
    for i in range(n):
        s, d = f"{tm}encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for p in ("weight", "bias"):
            out[d + "ln_1." + p] = sd[s + "layer_norm1." + p]
            out[d + "ln_2." + p] = sd[s + "layer_norm2." + p]
            out[d + "attn.in_proj_" + p] = torch.cat([sd[s + f"self_attn.{q}_proj." + p] for q in "qkv"], 0)
            out[d + "attn.out_proj." + p] = sd[s + "self_attn.out_proj." + p]
            out[d + "mlp.c_fc." + p] = sd[s + "mlp.fc1." + p]
            out[d + "mlp.c_proj." + p] = sd[s + "mlp.fc2." + p]
    return out


def clip_g_files(sd):
    sdxl = openclip_names(sd, "conditioner.embedders.1.model.")
    sd3 = {"text_encoders.clip_g.transformer." + k: v for k, v in sd.items()}
    return {"clip_g.safetensors": dict(sd), "sdxl.safetensors": sdxl, "sd3.safetensors": sd3}


def fp8_weights(sd, scaled):
    """(stored dict, dequantized dict): Linear weights (and, unscaled, the embedding) as F8_E4M3."""
    stored, deq = {}, {}
    for k, v in sd.items():
        linear = v.ndim == 2 and ("SelfAttention." in k or "DenseReluDense." in k) and "relative_attention_bias" not in k
        if linear and scaled:
            s = v.float().abs().max() / 448.0
            q = (v.float() / s).to(torch.float8_e4m3fn)
            stored[k] = q
            stored[k[: -len(".weight")] + ".scale_weight"] = s.reshape(()).float()
            deq[k] = q.float() * s
        elif (linear or k == "shared.weight") and not scaled:
            q = v.float().to(torch.float8_e4m3fn)
            stored[k] = q
            deq[k] = q.float()
        else:
            stored[k] = v
            deq[k] = v.float()
    if scaled:
        stored["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return stored, deq


def t5_files(sd, real):
    sd = {k: v for k, v in sd.items() if k != "encoder.embed_tokens.weight"}
    files = {"sd3.safetensors": {"text_encoders.t5xxl.transformer." + k: v for k, v in sd.items()}}
    if not real:  # the real XXL writes fewer copies (disk)
        bare = dict(sd)
        bare["encoder.embed_tokens.weight"] = sd["shared.weight"].clone()
        files["t5xxl.safetensors"] = bare
    return files


# ---- inputs and outputs ----

def make_ids(name, seed):
    g = torch.Generator().manual_seed(seed + 2)
    if name in CLIP:
        c = CLIP[name]
        L, V = c["max_position_embeddings"], c["vocab_size"]
        bos, eos = (V - 2, V - 1) if V < 49408 else (49406, 49407)
        pad = eos if FAMILY[name] == "clip-l" else 0
        lengths = [L, 5, 2]
        low = 3
    else:
        L, V = (40 if name.startswith("tiny") else 77), T5[name]["vocab_size"]
        eos, pad, bos = 1, 0, None
        lengths = [L, 17, 3]
        low = 2
    ids = torch.full((3, L), pad, dtype=torch.long)
    mask = torch.zeros((3, L), dtype=torch.long)
    for r, n in enumerate(lengths):
        body = torch.randint(low, V - 2, (n,), generator=g)
        if bos is not None:
            body[0] = bos
        body[n - 1] = eos
        ids[r, :n] = body
        mask[r, :n] = 1
    return ids, mask


def clip_outputs(model, ids, mask, device, prefix=""):
    out = {}
    with torch.no_grad():
        for tag, m in (("", None), ("masked_", mask)):
            o = model(input_ids=ids.to(device), attention_mask=None if m is None else m.to(device),
                      output_hidden_states=True)
            hs = o.hidden_states
            fln = model.text_model.final_layer_norm
            assert torch.allclose(fln(hs[-1]).float(), o.last_hidden_state.float(), atol=1e-2), "hidden_states[-1] is not un-normed"
            out[prefix + tag + "last_hidden_state"] = o.last_hidden_state
            out[prefix + tag + "penultimate"] = hs[-2]
            out[prefix + tag + "embeddings"] = hs[0]
            out[prefix + tag + "pooled"] = o.last_hidden_state[torch.arange(ids.shape[0]), _eos(model, ids).to(device)]
            out[prefix + tag + "text_embeds"] = o.text_embeds
    return out


def _eos(model, ids):
    eos = model.config.eos_token_id
    return ids.argmax(-1) if eos == 2 else (ids == eos).int().argmax(-1)


def t5_outputs(model, ids, mask, device, prefix=""):
    with torch.no_grad():
        return {prefix + "last_hidden_state": model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state,
                prefix + "unmasked_last_hidden_state": model(input_ids=ids.to(device)).last_hidden_state}


def t5_buckets(model):
    rel = torch.arange(-511, 512)[None, :]
    attn = model.encoder.block[0].layer[0].SelfAttention
    return attn._relative_position_bucket(rel, bidirectional=True, num_buckets=attn.relative_attention_num_buckets,
                                          max_distance=attn.relative_attention_max_distance)[0]


def f32(d):
    return {k: v.detach().float().cpu().contiguous() for k, v in d.items()}


def write_case(name, out_dir, dtype_name, device, seed, reduced, partners=None):
    """Builds `name`, writes its files and reference; returns the model's stored state dict."""
    store = torch.bfloat16 if (dtype_name == "bf16" or reduced) else torch.float32
    compute = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    model = build(name, seed, store, device)
    os.makedirs(out_dir, exist_ok=True)
    shard = {} if reduced else {"max_shard_size": "2GB" if family_of(name) == "t5-xxl" else "200MB"}
    model.to(store).save_pretrained(os.path.join(out_dir, "transformers"), safe_serialization=True, **shard)
    sd = state(model, store)
    family = FAMILY[name]
    files = {"transformers": ""}
    if family == "clip-l":
        layouts = clip_l_files(sd)
    elif family == "clip-g":
        layouts = clip_g_files(sd)
    else:
        layouts = t5_files(sd, real=not reduced)
    for fname, d in (partners or {}).items():  # other encoders of the same single file
        layouts.setdefault(fname, {}).update(d)
    for fname, d in layouts.items():
        save_file(d, os.path.join(out_dir, fname))
        files[fname] = ""
    ids, mask = make_ids(name, seed)
    model = model.to(device=device, dtype=compute)
    if family == "t5-xxl":
        outs = t5_outputs(model, ids, mask, device)
        outs["buckets"] = t5_buckets(model)
        fp8 = [("t5xxl_fp8_e4m3fn_scaled.safetensors", True, "fp8_scaled_")]
        if reduced:
            fp8.append(("t5xxl_fp8_e4m3fn.safetensors", False, "fp8_"))
        for fname, scaled, prefix in fp8:
            stored, deq = fp8_weights(sd, scaled)
            save_file(stored, os.path.join(out_dir, fname))
            files[fname] = prefix
            model.load_state_dict({k: v.to(compute) for k, v in deq.items()}, strict=False)
            outs.update(t5_outputs(model, ids, mask, device, prefix))
            del stored, deq
        model.load_state_dict({k: v.to(compute) for k, v in sd.items()}, strict=False)
    else:
        outs = clip_outputs(model, ids, mask, device)
    if compute == torch.bfloat16 and not reduced:
        # The exact layouts' outputs of the same weights in f32: text_parity measures both
        # implementations' bf16 error against them (deep stacks in bf16 drift from any reference).
        model = model.float()
        outs = f32(outs)
        outs.update(t5_outputs(model, ids, mask, device, "f32ref_") if family == "t5-xxl"
                    else clip_outputs(model, ids, mask, device, "f32ref_"))
        if family == "t5-xxl":  # and of the fp8 files' dequantised weights, for their outputs
            for fname, scaled, prefix in fp8:
                _, deq = fp8_weights(sd, scaled)
                model.load_state_dict({k: v.float() for k, v in deq.items()}, strict=False)
                outs.update(t5_outputs(model, ids, mask, device, "f32ref_" + prefix))
                del deq
    if reduced:  # the same model in bf16 on the CPU
        mb = model.to(torch.bfloat16)
        outs.update(t5_outputs(mb, ids, mask, device, "bf16_") if family == "t5-xxl" else clip_outputs(mb, ids, mask, device, "bf16_"))
    outs = f32(outs)
    outs["input_ids"] = ids
    outs["attention_mask"] = mask
    if "buckets" in outs:
        outs["buckets"] = outs["buckets"].long()
    cfg = model.config.to_dict()
    meta = {"config": json.dumps({k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool, list)) or v is None}),
            "dtype": dtype_name, "family": family, "name": name, "files": json.dumps(files),
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}"}
    save_file(outs, os.path.join(out_dir, "reference.safetensors"), metadata=meta)
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out_dir) for f in fs)
    print(f"{out_dir}: {name} {dtype_name}, {total / 2**20:.2f} MiB")
    return sd


# ---- timing ----

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


def timing(name, batch, length, device):
    model = build(name, 0, torch.bfloat16, device).to(torch.bfloat16)
    V = CLIP[name]["vocab_size"] if name in CLIP else T5[name]["vocab_size"]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V - 2, (batch, length), generator=g).to(device)
    mask = torch.ones_like(ids)
    if name in CLIP:
        fn = lambda: model(input_ids=ids, output_hidden_states=True)
    else:
        fn = lambda: model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = time_ms(fn)
        peak = torch.cuda.max_memory_allocated()
    row = {"impl": "transformers", "model": name, "batch": batch, "length": length, "dtype": "bf16",
           "ms": round(ms, 3), "peak_gib": round(peak / 2**30, 3), "peak_over_weights_gib": round((peak - base) / 2**30, 3),
           "attn": model.config._attn_implementation, "device": torch.cuda.get_device_name()}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--config", choices=["clip-l", "clip-g", "t5-xxl"])
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--batch", type=int, default=0, help="--time: batch (t5-xxl 16, clip 64)")
    ap.add_argument("--length", type=int, default=0, help="--time: tokens (t5-xxl 512, clip 77)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    if a.reduced:
        root = a.out
        tiny = {n: state(build(n, a.seed, torch.bfloat16, "cpu"), torch.bfloat16) for n in ("tiny-clip", "tiny-clip-g")}
        l_files, g_files = clip_l_files(tiny["tiny-clip"]), clip_g_files(tiny["tiny-clip-g"])
        write_case("tiny-clip", os.path.join(root, "text-tiny-clip"), "f32", "cpu", a.seed, True,
                   partners={"sdxl.safetensors": g_files["sdxl.safetensors"]})
        write_case("tiny-clip-g", os.path.join(root, "text-tiny-clip-g"), "f32", "cpu", a.seed, True,
                   partners={"sdxl.safetensors": l_files["sdxl.safetensors"]})
        write_case("tiny-t5", os.path.join(root, "text-tiny-t5"), "f32", "cpu", a.seed, True,
                   partners={"sd3.safetensors": {**l_files["sd3.safetensors"], **g_files["sd3.safetensors"]}})
        return
    if not a.config:
        ap.error("give --reduced or --config")
    if a.time:
        t5 = a.config == "t5-xxl"
        row = timing(a.config, a.batch or (16 if t5 else 64), a.length or (512 if t5 else 77), a.device)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "timing.json"), "w") as f:
            json.dump([row], f, indent=1)
        return
    write_case(a.config, a.out, a.dtype, a.device, a.seed, False)


if __name__ == "__main__":
    main()
