"""LoRA files of the tiny FLUX, SD3 and SDXL models: references for models/lora_file.{h,cpp}.

  python3 apps/diffusion/reference/lora_files.py write
      builds each tiny model (tests/data/models/{flux-tiny,sd3-tiny,unet2d-tiny-xl}) with diffusers,
      adds PEFT adapters with seeded values and writes to tests/data/models/lora/:
        <family>_diffusers.safetensors  the adapters as the pipeline's save_lora_weights writes them
        flux_kohya_fused.safetensors    a kohya FLUX file trained on the fused layers (dense lora_up
                                        over qkv and linear1, shared lora_down), built here
        sdxl_kohya.safetensors          the SDXL adapters in kohya's names (original SGM paths)
        sd3_kohya.safetensors           the SD3 adapters in lora_transformer_ names
        reference.safetensors           each model's output with its adapters (output.<family>), the
                                        fused file's output (output.flux_kohya_fused), inputs from
                                        the tiny models' own reference files
      and checks that diffusers' loaders give the adapters' output from the files it can read.
  python3 apps/diffusion/reference/lora_files.py check DIR
      loads the files FLAME wrote to DIR (FLAME_LORA_EXPORT_DIR=DIR diffusion_tests
      --gtest_filter='LoraFile.MatchesTheDiffusersReference') with diffusers' own loaders and prints
      the largest difference from the reference outputs (tolerance 1e-5, f32).

diffusers 0.42 reads kohya FLUX (FluxPipeline.lora_state_dict converts lora_unet_* keys) and kohya
SDXL (StableDiffusionXLPipeline.lora_state_dict with the UNet config maps the SGM block names) but
not kohya SD3 (lora_transformer_*, the ComfyUI / SimpleTuner form): those are checked by merging the
update W += alpha / r * up @ down into each named layer here. Its FLUX converter also fixes FLUX.1's
widths for single_blocks_*_linear1 (dims 3072, 3072, 3072, 12288), so the tiny model's linear1
entries are merged the same way and the rest goes through diffusers.
"""
import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data", "models")
OUT = os.path.join(DATA, "lora")
TOL = 1e-5

# (targets, rank, alpha, rank_pattern, alpha_pattern) per family; the patterns exercise per-module
# ranks and alphas in every layout.
SPEC = {
    "flux": (["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
              "ff.net.0.proj", "norm1.linear", "proj_mlp"], 4, 8.0, {"to_add_out": 2}, {"ff.net.0.proj": 3.0}),
    "sd3": (["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.2"], 4, 8.0,
            {"ff.net.2": 2}, {"to_out.0": 2.0}),
    "sdxl": (["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2", "time_emb_proj"], 4, 8.0,
             {"proj_in": 2}, {"ff.net.2": 5.0}),
}


def load_model(family):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
    if family == "flux":
        return FluxTransformer2DModel.from_pretrained(os.path.join(DATA, "flux-tiny", "transformer")).eval()
    if family == "sd3":
        return SD3Transformer2DModel.from_pretrained(os.path.join(DATA, "sd3-tiny", "transformer")).eval()
    return UNet2DConditionModel.from_pretrained(os.path.join(DATA, "unet2d-tiny-xl", "unet")).eval()


def inputs(family):
    folder = {"flux": "flux-tiny", "sd3": "sd3-tiny", "sdxl": "unet2d-tiny-xl"}[family]
    return load_file(os.path.join(DATA, folder, "reference.safetensors"))


@torch.no_grad()
def run(model, family, r):
    if family == "flux":
        return model(hidden_states=r["input.hidden_states"], encoder_hidden_states=r["input.encoder_hidden_states"],
                     pooled_projections=r["input.pooled_projections"], timestep=r["input.timestep"],
                     img_ids=r["input.img_ids"], txt_ids=r["input.txt_ids"], guidance=r["input.guidance"],
                     return_dict=False)[0]
    if family == "sd3":
        return model(hidden_states=r["input.hidden_states"], encoder_hidden_states=r["input.encoder_hidden_states"],
                     pooled_projections=r["input.pooled_projections"], timestep=r["input.timestep"],
                     return_dict=False)[0]
    return model(r["input.sample"], r["input.timestep"], encoder_hidden_states=r["input.encoder_hidden_states"],
                 added_cond_kwargs={"text_embeds": r["input.text_embeds"], "time_ids": r["input.time_ids"]},
                 return_dict=False)[0]


def add_adapters(model, family, seed):
    """PEFT adapters of SPEC[family], A and B drawn N(0, 0.3) from `seed`."""
    from peft import LoraConfig
    targets, rank, alpha, rank_pattern, alpha_pattern = SPEC[family]
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, rank_pattern=rank_pattern,
                                 alpha_pattern=alpha_pattern, init_lora_weights=True))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if ".lora_A." in n or ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def adapters(model):
    """{module: (A, B, scaling)} of the PEFT adapters of `model`."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
            out[name] = (m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach(), m.scaling["default"])
    return out


def pipeline(family):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline
    return {"flux": FluxPipeline, "sd3": StableDiffusion3Pipeline, "sdxl": StableDiffusionXLPipeline}[family]


def save_diffusers(model, family, path):
    from peft.utils import get_peft_model_state_dict
    layers = get_peft_model_state_dict(model)
    meta = model.peft_config["default"].to_dict()
    folder, name = os.path.split(path)
    if family == "sdxl":
        pipeline(family).save_lora_weights(folder, unet_lora_layers=layers, unet_lora_adapter_metadata=meta,
                                           weight_name=name)
    else:
        pipeline(family).save_lora_weights(folder, transformer_lora_layers=layers,
                                           transformer_lora_adapter_metadata=meta, weight_name=name)


def sgm_name(module, layers):
    """The original SGM path of a diffusers UNet module path (layers_per_block `layers`, all blocks
    alike): kohya's SDXL naming."""
    p = module.split(".")
    kind = {"resnets": "0", "attentions": "1"}
    if p[0] == "down_blocks":
        return ".".join(["input_blocks", str(1 + int(p[1]) * (layers + 1) + int(p[3])), kind[p[2]]] +
                        sgm_rest(p[2], p[4:]))
    if p[0] == "up_blocks":
        return ".".join(["output_blocks", str(int(p[1]) * (layers + 1) + int(p[3])), kind[p[2]]] +
                        sgm_rest(p[2], p[4:]))
    if p[0] == "mid_block":
        return ".".join(["middle_block", str(2 * int(p[2]) + int(kind[p[1]]))] + sgm_rest(p[1], p[3:]))
    raise ValueError(module)


def sgm_rest(kind, rest):
    if kind == "resnets":
        return {"time_emb_proj": ["emb_layers", "1"]}[rest[0]] + rest[1:]
    return rest


def kohya_names(model, family):
    """{diffusers module: kohya stem} for the adapted modules (SD3: lora_transformer_, SDXL: SGM)."""
    out = {}
    for m in adapters(model):
        if family == "sd3":
            out[m] = "lora_transformer_" + m.replace(".", "_")
        else:
            out[m] = "lora_unet_" + sgm_name(m, model.config.layers_per_block).replace(".", "_")
    return out


def save_kohya(model, family, path):
    sd = {}
    for m, stem in kohya_names(model, family).items():
        a, b, s = adapters(model)[m]
        sd[stem + ".lora_down.weight"] = a.contiguous()
        sd[stem + ".lora_up.weight"] = b.contiguous()
        sd[stem + ".alpha"] = torch.tensor(s * a.shape[0], dtype=torch.float32)
    save_file(sd, path, metadata={"ss_network_module": "networks.lora", "ss_base_model_version": family})


@torch.no_grad()
def merge_kohya(model, sd, lookup, fused=None):
    """W += alpha / r * up @ down for every stem of `sd` (a kohya dict), through `lookup` (stem ->
    module); `fused` maps a stem to [(module, rows)] split along up's rows."""
    modules = dict(model.named_modules())
    stems = {k.split(".")[0] for k in sd if k.endswith(".lora_down.weight")}
    for stem in sorted(stems):
        down, up = sd[stem + ".lora_down.weight"].double(), sd[stem + ".lora_up.weight"].double()
        alpha = float(sd[stem + ".alpha"]) if stem + ".alpha" in sd else down.shape[0]
        delta = up @ down * (alpha / down.shape[0])
        parts = fused[stem] if fused and stem in fused else [(lookup[stem], delta.shape[0])]
        row = 0
        for module, rows in parts:
            w = modules[module].base_layer.weight if hasattr(modules[module], "base_layer") else modules[module].weight
            w += delta[row:row + rows].to(w.dtype)
            row += rows


def flux_fused_parts(model):
    """kohya stem -> [(diffusers module, rows)] of FLUX's fused layers (BFL names)."""
    d = model.config.num_attention_heads * model.config.attention_head_dim
    out = {}
    for i in range(model.config.num_layers):
        t = f"transformer_blocks.{i}.attn."
        out[f"lora_unet_double_blocks_{i}_img_attn_qkv"] = [(t + "to_q", d), (t + "to_k", d), (t + "to_v", d)]
        out[f"lora_unet_double_blocks_{i}_txt_attn_qkv"] = [(t + "add_q_proj", d), (t + "add_k_proj", d),
                                                            (t + "add_v_proj", d)]
    for i in range(model.config.num_single_layers):
        t = f"single_transformer_blocks.{i}."
        out[f"lora_unet_single_blocks_{i}_linear1"] = [(t + "attn.to_q", d), (t + "attn.to_k", d),
                                                       (t + "attn.to_v", d), (t + "proj_mlp", 4 * d)]
    return out


def write_flux_fused(model, path, seed):
    """A kohya FLUX file over the fused layers with dense lora_up (rank 6, alpha 3): what a trainer on
    the BFL model writes. Also one unfused layer (img_attn_proj, rank 2, no alpha: alpha = rank)."""
    gen = torch.Generator().manual_seed(seed)
    d = model.config.num_attention_heads * model.config.attention_head_dim
    sd = {}
    for stem, parts in flux_fused_parts(model).items():
        if "txt_attn" in stem and "_1_" in stem:
            continue  # one fused layer left out
        rows = sum(r for _, r in parts)
        sd[stem + ".lora_down.weight"] = torch.randn(6, d, generator=gen) * 0.3
        sd[stem + ".lora_up.weight"] = torch.randn(rows, 6, generator=gen) * 0.3
        sd[stem + ".alpha"] = torch.tensor(3.0)
    sd["lora_unet_double_blocks_0_img_attn_proj.lora_down.weight"] = torch.randn(2, d, generator=gen) * 0.3
    sd["lora_unet_double_blocks_0_img_attn_proj.lora_up.weight"] = torch.randn(d, 2, generator=gen) * 0.3
    save_file(sd, path, metadata={"ss_network_module": "networks.lora", "ss_base_model_version": "flux1"})
    return sd


def report(what, got, want):
    err = (got.double() - want.double()).abs().max().item()
    print(f"  {what}: max abs error {err:.3g} (max |want| {want.abs().max().item():.3g})")
    if err > TOL:
        print(f"FAILED: {what} differs by {err} > {TOL}")
        sys.exit(1)


def load_with_diffusers(family, path):
    """A fresh model with the file loaded the way the pipelines' load_lora_weights does it; kohya
    entries diffusers cannot read (module docstring) are merged into the weights here."""
    model = load_model(family)
    pipe = pipeline(family)
    keys = list(safe_open(path, "pt").keys())
    kohya = any(k.endswith(".lora_down.weight") for k in keys)
    if kohya and family == "sd3":
        sd = load_file(path)
        lookup = {"lora_transformer_" + n.replace(".", "_"): n for n, _ in model.named_modules()}
        merge_kohya(model, sd, lookup)
        return model, "merged here (diffusers 0.42 has no SD3 kohya converter)"
    if family == "sdxl":
        sd, alphas, meta = pipe.lora_state_dict(path, unet_config=model.config, return_lora_metadata=True)
        pipe.load_lora_into_unet(sd, alphas, model, metadata=meta)
        return model, "StableDiffusionXLPipeline.lora_state_dict(path, unet_config=...) + load_lora_into_unet"
    if kohya:  # FLUX
        sd = load_file(path)
        linear1 = {k: v for k, v in sd.items() if "_linear1." in k}
        rest = {k: v for k, v in sd.items() if k not in linear1}
        converted = pipe.lora_state_dict(rest)
        pipe.load_lora_into_transformer(converted, None, model)
        merge_kohya(model, linear1, {}, flux_fused_parts(model))
        return model, ("FluxPipeline.lora_state_dict(kohya dict) + load_lora_into_transformer; "
                       f"{len(linear1) // 3} linear1 stems merged here")
    if family == "flux":
        sd, alphas, meta = pipe.lora_state_dict(path, return_alphas=True, return_lora_metadata=True)
        pipe.load_lora_into_transformer(sd, alphas, model, metadata=meta)
    else:
        sd, meta = pipe.lora_state_dict(path, return_lora_metadata=True)
        pipe.load_lora_into_transformer(sd, model, metadata=meta)
    return model, f"{pipe.__name__}.lora_state_dict(path) + load_lora_into_transformer(metadata=...)"


def write():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    ref = {}
    for i, family in enumerate(["flux", "sd3", "sdxl"]):
        r = inputs(family)
        model = load_model(family)
        add_adapters(model, family, seed=100 + i)
        want = run(model, family, r)
        ref[f"output.{family}"] = want.contiguous()
        path = os.path.join(OUT, f"{family}_diffusers.safetensors")
        save_diffusers(model, family, path)
        if family != "flux":
            save_kohya(model, family, os.path.join(OUT, f"{family}_kohya.safetensors"))
        print(family)
        for name in [f"{family}_diffusers"] + ([] if family == "flux" else [f"{family}_kohya"]):
            loaded, how = load_with_diffusers(family, os.path.join(OUT, name + ".safetensors"))
            report(f"{name} via {how}", run(loaded, family, r), want)
    # The fused kohya FLUX file: its output from the update merged into the base weights.
    model = load_model("flux")
    sd = write_flux_fused(model, os.path.join(OUT, "flux_kohya_fused.safetensors"), seed=200)
    parts = flux_fused_parts(model)
    merge_kohya(model, sd, {"lora_unet_double_blocks_0_img_attn_proj": "transformer_blocks.0.attn.to_out.0"}, parts)
    r = inputs("flux")
    ref["output.flux_kohya_fused"] = run(model, "flux", r).contiguous()
    loaded, how = load_with_diffusers("flux", os.path.join(OUT, "flux_kohya_fused.safetensors"))
    print("flux_kohya_fused")
    report(f"flux_kohya_fused via {how}", run(loaded, "flux", r), ref["output.flux_kohya_fused"])
    import diffusers
    import peft
    save_file(ref, os.path.join(OUT, "reference.safetensors"),
              metadata={"diffusers": diffusers.__version__, "peft": peft.__version__, "torch": torch.__version__})


def check(folder):
    ref = load_file(os.path.join(OUT, "reference.safetensors"))
    names = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not names:
        sys.exit(f"no .safetensors files in {folder}")
    for sub in sorted(f for f in os.listdir(folder) if os.path.isdir(os.path.join(folder, f))):
        from peft import PeftModel  # PEFT's folder: adapter_model.safetensors + adapter_config.json
        family = sub.split("_")[0]
        want = ref["output.flux_kohya_fused"] if "from_fused" in sub else ref[f"output.{family}"]
        model = PeftModel.from_pretrained(load_model(family), os.path.join(folder, sub))
        report(f"{sub}/ via peft.PeftModel.from_pretrained", run(model.base_model.model, family, inputs(family)), want)
    for name in names:
        family = name.split("_")[0]
        if family not in SPEC:
            continue
        want = ref["output.flux_kohya_fused"] if "from_fused" in name else ref[f"output.{family}"]
        if "_peft" in name:  # PEFT's layout: the LoraConfig FLAME stored in the metadata, then the weights
            import json
            from peft import LoraConfig
            from peft.utils import set_peft_model_state_dict
            path = os.path.join(folder, name)
            model = load_model(family)
            with safe_open(path, "pt") as f:
                config = json.loads(f.metadata()["lora_adapter_metadata"])
            model.add_adapter(LoraConfig(**config))
            sd = {k.removeprefix("base_model.model."): v for k, v in load_file(path).items()}
            res = set_peft_model_state_dict(model, sd)
            assert not [k for k in res.unexpected_keys if "lora" in k], res.unexpected_keys
            how = "add_adapter(LoraConfig(**lora_adapter_metadata)) + peft.set_peft_model_state_dict"
        else:
            model, how = load_with_diffusers(family, os.path.join(folder, name))
        report(f"{name} via {how}", run(model, family, inputs(family)), want)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["write", "check"])
    ap.add_argument("folder", nargs="?")
    a = ap.parse_args()
    write() if a.mode == "write" else check(a.folder)
