#!/usr/bin/env python3
"""Tiny text-to-image pipelines of FLUX.1, SD3.5 and SDXL, and diffusers 0.42's images from them, for
FLAME's models/pipelines.h (Pipelines.* in apps/diffusion/tests/test_pipelines.cpp, and the CLI test
of `flame-diffusion generate`).

Writes apps/diffusion/tests/data/models/pipelines-tiny/:
  flux/, sd3/, sdxl/        diffusers pipeline folders (save_pretrained: model_index.json, scheduler/,
                            transformer/ or unet/, vae/, text_encoder*/, tokenizer*/) of random tiny
                            components in the families' layouts: FLUX (CLIPTextModel + T5, guidance
                            embedding, 16 latent channels packed 2x2), SD3.5 (CLIP-L and bigG with
                            projection + T5, RMS QK norm, a dual-attention block), SDXL (CLIPTextModel +
                            bigG with projection, text_time embedding). The shipped scheduler
                            configurations. Components shared between folders are stored once, the
                            other folders link to them (relative symlinks).
  tokenizers: a tiny CLIP BPE vocabulary (the 512 byte symbols, a few merges, the two special tokens
                            last so the end token has the largest id as in CLIP) and the T5 test
                            SentencePiece model of tests/data/tokenizers (linked).
  reference.safetensors     per case: "<case>.latents" (the initial latents given to the pipeline:
                            packed for FLUX), "<case>.image" (the pipeline's output_type="pt" image, in
                            [0, 1]); metadata "cases": "<case>:<family>:<sampler>:<steps>:<guidance>:
                            <negative prompt or '-' for none>:<LoRA file of lora/ or '-'>:<FLUX's
                            true_cfg_scale>" and "prompts" (joined by '|').
  lora/flux.safetensors, lora/sdxl.safetensors
                            random rank-4 adapters written by the pipelines' save_lora_weights (the
                            diffusers layout), loaded with load_lora_weights for the LoRA cases.
Weights are stored in bf16 and every run is f32 on the CPU (the stored values are the computed ones).

Usage: python pipelines.py [--out DIR]   (torch, diffusers, transformers, sentencepiece, safetensors)

       python pipelines.py --check-lora DIR
  loads each LoRA file FLAME's fine-tuning wrote into DIR (FinetuneRun.* with
  FLAME_FINETUNE_EXPORT_DIR=DIR: <family>_<kohya|diffusers>.safetensors, and <family>_flame_images.safetensors
  with FLAME's images from fixed latents) into the tiny pipeline with load_lora_weights, runs it on the
  same latents and compares the images (f32, CPU).
"""
import argparse
import json
import os
import shutil
import tempfile

import torch
from diffusers import (AutoencoderKL, DPMSolverMultistepScheduler, EulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                       StableDiffusion3Pipeline, StableDiffusionXLPipeline, UNet2DConditionModel)
from safetensors.torch import load_file, save_file
from tokenizers_ref import bytes_to_unicode
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5Config,
                          T5EncoderModel, T5TokenizerFast)

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data")
DEFAULT_OUT = os.path.join(DATA, "models", "pipelines-tiny")
T5_MODEL = os.path.join(DATA, "tokenizers", "t5_test.model")

PROMPTS = ["a red cat on a wooden table", "a photo of the moon over the sea at night"]
HEIGHT, WIDTH = 16, 24
CLIP_MAX = 16  # the tiny CLIPs' max_position_embeddings and their tokenizers' model_max_length
T5_MAX = 20    # max_sequence_length given to the FLUX and SD3 pipelines
# (case, family, sampler, steps, guidance, negative prompt or None, LoRA file or None, FLUX's
# true_cfg_scale). A LoRA case gives the denoiser a rank-4 PEFT adapter with random A and B (seeded),
# writes it with the pipeline's save_lora_weights (diffusers layout) into lora/, and runs a fresh
# pipeline after load_lora_weights. New cases go last: each case's latents are the next draws of
# one generator, so the earlier cases' stay the same.
CASES = [
    ("flux", "flux", "flow-euler", 3, 3.5, None, None, 1.0),
    ("sd3", "sd3", "flow-euler", 3, 4.5, "blurry, dark", None, 1.0),
    ("sdxl_euler", "sdxl", "euler", 3, 5.0, "blurry, dark", None, 1.0),
    ("sdxl_dpm_karras", "sdxl", "dpm++2m-karras", 4, 6.0, None, None, 1.0),
    ("flux_lora", "flux", "flow-euler", 3, 3.5, None, "flux.safetensors", 1.0),
    ("sdxl_lora", "sdxl", "euler", 3, 5.0, None, "sdxl.safetensors", 1.0),
    ("flux_true_cfg", "flux", "flow-euler", 3, 3.5, "blurry, dark", None, 4.0),
]
PIPELINES = {"flux": FluxPipeline, "sd3": StableDiffusion3Pipeline, "sdxl": StableDiffusionXLPipeline}


def write_lora(out, family, name, seed):
    """A random rank-4 adapter on the denoiser's attention projections, saved as diffusers does."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    pipe = PIPELINES[family].from_pretrained(os.path.join(out, family), torch_dtype=torch.float32)
    model = pipe.transformer if family != "sdxl" else pipe.unet
    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False))
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_" in k:
                p.mul_(0.5)
    layers = get_peft_model_state_dict(model)
    kw = {"unet_lora_layers": layers} if family == "sdxl" else {"transformer_lora_layers": layers}
    PIPELINES[family].save_lora_weights(os.path.join(out, "lora"), weight_name=name, **kw)

MERGES = ["t h", "th e</w>", "o n</w>", "c a", "ca t</w>", "r e", "re d</w>", "m o", "mo o", "moo n</w>",
          "s e", "se a</w>", "o f</w>", "p h", "ph o", "pho t", "phot o</w>", "a t</w>"]

FLUX_VAE = dict(scaling_factor=0.3611, shift_factor=0.1159, latent_channels=16, use_quant_conv=False)
SD3_VAE = dict(scaling_factor=1.5305, shift_factor=0.0609, latent_channels=16, use_quant_conv=False)
SDXL_VAE = dict(scaling_factor=0.13025, shift_factor=None, latent_channels=4, use_quant_conv=True)

FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
SDXL_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                      prediction_type="epsilon", timestep_spacing="leading", steps_offset=1,
                      interpolation_type="linear", use_karras_sigmas=False)


def clip_vocab():
    table = bytes_to_unicode()
    symbols = [table[b] for b in range(256)]
    vocab = symbols + [s + "</w>" for s in symbols]
    vocab += ["".join(m.split(" ")) for m in MERGES]
    return vocab + ["<|startoftext|>", "<|endoftext|>"]


def write_clip_files(path):
    """vocab.json and merges.txt, the files of a downloaded CLIP tokenizer folder."""
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(clip_vocab())}, f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(MERGES) + "\n")


def write_clip_tokenizer(path, pad_token):
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_clip_files(tmp)
        tok = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token=pad_token,
                            model_max_length=CLIP_MAX)
        tok.save_pretrained(path)
    return len(clip_vocab())


def as_downloaded(out):
    """Tokenizer folders as the published pipelines ship them: CLIP's vocab.json + merges.txt, T5's
    spiece.model, with tokenizer_config.json (transformers 5 writes only tokenizer.json)."""
    for pipe in ("flux", "sd3", "sdxl"):
        for comp in os.listdir(os.path.join(out, pipe)):
            path = os.path.join(out, pipe, comp)
            weights = os.path.join(path, "model.safetensors")
            if comp.startswith("text_encoder") and os.path.isfile(weights):
                # transformers 5 saves CLIPTextModel without the "text_model." prefix the published
                # files (saved by transformers 4) have; store the published layout.
                sd = load_file(weights)
                if "embeddings.token_embedding.weight" in sd:
                    save_file({"text_model." + k: v for k, v in sd.items()}, weights, metadata={"format": "pt"})
            if not comp.startswith("tokenizer"):
                continue
            cfg = json.load(open(os.path.join(path, "tokenizer_config.json")))
            if cfg.get("tokenizer_class", "").startswith("CLIP"):
                write_clip_files(path)
            else:
                shutil.copy(T5_MODEL, os.path.join(path, "spiece.model"))
            os.remove(os.path.join(path, "tokenizer.json"))


def perturbed(model, seed, std=0.02, only_1d=False):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not only_1d or p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * std)
            p.copy_(p.to(torch.bfloat16).float())  # the stored values are the computed ones
    return model.eval()


def clip(vocab, hidden, heads, act, eos, bos, projection, seed):
    torch.manual_seed(seed)
    cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, max_position_embeddings=CLIP_MAX, hidden_act=act,
                         projection_dim=hidden, eos_token_id=eos, bos_token_id=bos, pad_token_id=1)
    return perturbed((CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg), seed + 1, 0.05, True)


def t5(seed):
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=1100, d_model=48, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False, use_cache=False)
    return perturbed(T5EncoderModel(cfg), seed + 1, 0.05, True)


def vae(family_cfg, seed):
    torch.manual_seed(seed)
    m = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                      up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                      act_fn="silu", latent_channels=family_cfg["latent_channels"], norm_num_groups=4, sample_size=16,
                      scaling_factor=family_cfg["scaling_factor"], shift_factor=family_cfg["shift_factor"],
                      force_upcast=True, use_quant_conv=family_cfg["use_quant_conv"],
                      use_post_quant_conv=family_cfg["use_quant_conv"], mid_block_add_attention=True)
    return perturbed(m, seed + 1, 0.05, True)


def build(out):
    tok_dir = os.path.join(out, "_tokenizers")
    vocab = write_clip_tokenizer(os.path.join(tok_dir, "clip_l"), "<|endoftext|>")
    write_clip_tokenizer(os.path.join(tok_dir, "clip_g"), "!")
    t5_dir = os.path.join(tok_dir, "t5")
    os.makedirs(t5_dir, exist_ok=True)
    shutil.copy(T5_MODEL, os.path.join(t5_dir, "spiece.model"))
    T5TokenizerFast(vocab_file=os.path.join(t5_dir, "spiece.model"), extra_ids=100).save_pretrained(t5_dir)
    tok_l = CLIPTokenizer.from_pretrained(os.path.join(tok_dir, "clip_l"))
    tok_g = CLIPTokenizer.from_pretrained(os.path.join(tok_dir, "clip_g"))
    tok_t5 = T5TokenizerFast.from_pretrained(t5_dir)
    eos, bos = vocab - 1, vocab - 2
    # CLIP-L: the legacy end-token rule (eos_token_id 2: argmax of the ids); bigG: the end id.
    clip_l = clip(vocab, 16, 2, "quick_gelu", 2, 0, False, 10)
    clip_l_proj = clip(vocab, 16, 2, "quick_gelu", 2, 0, True, 11)
    clip_g = clip(vocab, 24, 3, "gelu", eos, bos, True, 12)
    t5_model = t5(13)

    torch.manual_seed(20)
    flux_tr = perturbed(FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=48, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(2, 2, 4)), 21)
    torch.manual_seed(22)
    sd3_tr = perturbed(SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=48, caption_projection_dim=16, pooled_projection_dim=40, out_channels=16,
        pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=(0,)), 23)
    torch.manual_seed(24)
    unet = perturbed(UNet2DConditionModel(
        sample_size=8, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], block_out_channels=[8, 16], layers_per_block=1,
        transformer_layers_per_block=[1, 2], cross_attention_dim=40, attention_head_dim=[2, 2], norm_num_groups=4,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=24 + 6 * 4), 25)

    pipes = {
        "flux": FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=vae(FLUX_VAE, 30),
                             text_encoder=clip_l, tokenizer=tok_l, text_encoder_2=t5_model, tokenizer_2=tok_t5,
                             transformer=flux_tr),
        "sd3": StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
                                        vae=vae(SD3_VAE, 31), text_encoder=clip_l_proj, tokenizer=tok_l,
                                        text_encoder_2=clip_g, tokenizer_2=tok_g, text_encoder_3=t5_model,
                                        tokenizer_3=tok_t5, transformer=sd3_tr),
        "sdxl": StableDiffusionXLPipeline(scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER), vae=vae(SDXL_VAE, 32),
                                          text_encoder=clip_l, tokenizer=tok_l, text_encoder_2=clip_g,
                                          tokenizer_2=tok_g, unet=unet, add_watermarker=False),
    }
    for name, pipe in pipes.items():
        pipe.to(torch.bfloat16).save_pretrained(os.path.join(out, name))
    shutil.rmtree(tok_dir)
    as_downloaded(out)
    dedupe(out)


def same_tree(a, b):
    fa = sorted(os.listdir(a))
    if fa != sorted(os.listdir(b)):
        return False
    for f in fa:
        pa, pb = os.path.join(a, f), os.path.join(b, f)
        if os.path.isdir(pa) != os.path.isdir(pb):
            return False
        if os.path.isdir(pa):
            if not same_tree(pa, pb):
                return False
        elif open(pa, "rb").read() != open(pb, "rb").read():
            return False
    return True


def dedupe(out):
    """Replaces each component folder that repeats an earlier one by a relative symlink to it; the T5
    tokenizer's spiece.model links to tests/data/tokenizers/t5_test.model."""
    seen = []
    for pipe in ("flux", "sd3", "sdxl"):
        for comp in sorted(os.listdir(os.path.join(out, pipe))):
            path = os.path.join(out, pipe, comp)
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            twin = next((s for s in seen if same_tree(s, path)), None)
            if twin is None:
                seen.append(path)
                continue
            shutil.rmtree(path)
            os.symlink(os.path.relpath(twin, os.path.dirname(path)), path)
    for s in seen:
        sp = os.path.join(s, "spiece.model")
        if os.path.isfile(sp):
            os.remove(sp)
            os.symlink(os.path.relpath(os.path.abspath(T5_MODEL), s), sp)


def run(out):
    tensors, names = {}, []
    g = torch.Generator().manual_seed(31)
    for case, family, sampler, steps, guidance, negative, lora, true_cfg in CASES:
        path = os.path.join(out, family)
        if lora:
            write_lora(out, family, lora, 40 + len(names))
        if family == "flux":
            pipe = FluxPipeline.from_pretrained(path, torch_dtype=torch.float32)
            stored = load_file(os.path.join(path, "text_encoder", "model.safetensors"))
            for k, v in pipe.text_encoder.state_dict().items():  # the prefixed file loaded, nothing left random
                assert torch.equal(stored["text_model." + k.removeprefix("text_model.")].float(), v), k
            c, h, w = 16, HEIGHT // 2, WIDTH // 2
            latents = FluxPipeline._pack_latents(torch.randn(len(PROMPTS), c, h, w, generator=g), len(PROMPTS), c, h, w)
            kw = dict(max_sequence_length=T5_MAX, negative_prompt=negative, true_cfg_scale=true_cfg)
        elif family == "sd3":
            pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=torch.float32)
            latents = torch.randn(len(PROMPTS), 16, HEIGHT // 2, WIDTH // 2, generator=g)
            kw = dict(max_sequence_length=T5_MAX, negative_prompt=negative)
        else:
            pipe = StableDiffusionXLPipeline.from_pretrained(path, torch_dtype=torch.float32, add_watermarker=False)
            if sampler == "dpm++2m-karras":
                pipe.scheduler = DPMSolverMultistepScheduler.from_config(
                    pipe.scheduler.config, algorithm_type="dpmsolver++", solver_order=2, use_karras_sigmas=True)
            latents = torch.randn(len(PROMPTS), 4, HEIGHT // 2, WIDTH // 2, generator=g)
            kw = dict(negative_prompt=negative)
        if lora:
            pipe.load_lora_weights(os.path.join(out, "lora"), weight_name=lora)
        with torch.no_grad():
            image = pipe(PROMPTS, height=HEIGHT, width=WIDTH, num_inference_steps=steps, guidance_scale=guidance,
                         latents=latents.clone(), output_type="pt", **kw).images
        tensors[f"{case}.latents"] = latents.contiguous()
        tensors[f"{case}.image"] = image.float().contiguous()
        names.append(f"{case}:{family}:{sampler}:{steps}:{guidance}:{'-' if negative is None else negative}:"
                     f"{lora or '-'}:{true_cfg}")
        print(f"{case}: image {tuple(image.shape)} mean {image.mean().item():.4f} std {image.std().item():.4f}")
    path = os.path.join(out, "reference.safetensors")
    save_file(tensors, path, metadata={"cases": "|".join(names), "prompts": "|".join(PROMPTS),
                                       "height": str(HEIGHT), "width": str(WIDTH), "max_sequence_length": str(T5_MAX)})


def check_lora(folder, tolerance=1e-4):
    from safetensors import safe_open
    failed = 0
    for ref_name in sorted(f for f in os.listdir(folder) if f.endswith("_flame_images.safetensors")):
        ref_path = os.path.join(folder, ref_name)
        with safe_open(ref_path, "pt") as f:
            cases = f.metadata()["cases"].split("|")
        ref = load_file(ref_path)
        for case in cases:
            name, family, steps, guidance, prompt = case.split(":", 4)
            if name in ("flux_kohya", "sd3_kohya"):
                # diffusers 0.42 reads no kohya SD3 file, and its kohya FLUX converter fixes FLUX.1's widths
                # for single_blocks_*_linear1: lora_files.py checks those files at the model level.
                print(f"{name}: not loadable by diffusers' pipeline at the tiny widths (see lora_files.py); skipped")
                continue
            path = os.path.join(DEFAULT_OUT, family)
            latents = ref[name + ".latents"]
            if family == "flux":
                pipe = FluxPipeline.from_pretrained(path, torch_dtype=torch.float32)
                n, c, h, w = latents.shape
                latents = FluxPipeline._pack_latents(latents, n, c, h, w)
                kw = dict(max_sequence_length=20)
            elif family == "sd3":
                pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=torch.float32)
                kw = dict(max_sequence_length=20)
            else:
                pipe = StableDiffusionXLPipeline.from_pretrained(path, torch_dtype=torch.float32, add_watermarker=False)
                kw = {}
            pipe.load_lora_weights(folder, weight_name=name + ".safetensors")
            flame_image = ref[name + ".image"]
            with torch.no_grad():
                image = pipe([prompt], height=flame_image.shape[2], width=flame_image.shape[3],
                             num_inference_steps=int(steps), guidance_scale=float(guidance), latents=latents.clone(),
                             output_type="pt", **kw).images.float()
            with torch.no_grad():
                plain = pipe.__class__.from_pretrained(path, torch_dtype=torch.float32, **(
                    {"add_watermarker": False} if family == "sdxl" else {}))(
                    [prompt], height=flame_image.shape[2], width=flame_image.shape[3], num_inference_steps=int(steps),
                    guidance_scale=float(guidance), latents=latents.clone(), output_type="pt", **kw).images.float()
            err = (image - flame_image).abs().max().item()
            moved = (image - plain).abs().max().item()
            ok = err <= tolerance
            failed += not ok
            print(f"{name}: diffusers load_lora_weights + pipeline vs FLAME: max abs {err:.3e} "
                  f"(the LoRA moves the image by {moved:.3e}) {'PASS' if ok else 'FAIL'}")
    if failed:
        raise SystemExit(f"{failed} case(s) failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check-lora", metavar="DIR")
    a = ap.parse_args()
    if a.check_lora:
        check_lora(a.check_lora)
        return
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    os.makedirs(a.out)
    build(a.out)
    run(a.out)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(a.out) for f in fs
                if not os.path.islink(os.path.join(d, f)))
    print(f"wrote {a.out}: {total} bytes (links not counted)")


if __name__ == "__main__":
    main()
