#!/usr/bin/env python3
"""A diffusers pipeline folder of random weights at a real configuration (FLUX.1-dev, SD3.5-Large or
SDXL), and a small captioned image folder, for the end-to-end fine-tuning runs on the GPU machine
(scripts/models_parity.sh --stages finetune_e2e,full_trainer): `flame-diffusion finetune --config`
reads them as it reads a downloaded pipeline.

  python3 make_pipeline.py --family flux --out /tmp/pipe_flux --images /tmp/ft_images --device cuda

The components are the real configurations of models_flux.py / models_sd3.py / models_unet.py /
models_text.py / models_vae.py (FLUX-dev transformer 11.9 B parameters, T5-XXL, CLIP-L; the SD3.5-Large
transformer, 8.1 B, CLIP-L and OpenCLIP bigG with projections, T5-XXL; or the SDXL UNet, CLIP-L,
OpenCLIP bigG) with the shipped scheduler configurations, saved in bf16 by save_pretrained. The
tokenizers are the tiny CLIP BPE vocabulary of pipelines.py (ids below the real vocabulary size, 77
tokens) and the T5 test SentencePiece model: any ids in range exercise the same code. Images: 1024²
and 832x1216 PNGs of coloured shapes with a caption each.
"""
import argparse
import os
import shutil
import tempfile

import numpy as np
import torch
from PIL import Image
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer,
                          T5EncoderModel, T5TokenizerFast)

import models_flux
import models_sd3
import models_text
import models_unet
import models_vae
import pipelines


def clip_tokenizer(pad_token):
    tmp = tempfile.mkdtemp()
    pipelines.write_clip_files(tmp)
    tok = CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), pad_token=pad_token,
                        model_max_length=77)
    return tok


def t5_tokenizer():
    tmp = tempfile.mkdtemp()
    shutil.copy(pipelines.T5_MODEL, os.path.join(tmp, "spiece.model"))
    return T5TokenizerFast(vocab_file=os.path.join(tmp, "spiece.model"), extra_ids=100)


def clip(name, projection, device, seed):
    torch.manual_seed(seed)
    cfg = dict(models_text.CLIP[name])
    if name == "clip-g":  # the end token's id of the tokenizer (the largest, as in CLIP)
        cfg["eos_token_id"] = len(pipelines.clip_vocab()) - 1
    with torch.device(device):
        m = (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(**cfg, layer_norm_eps=1e-5))
    return m.to(torch.bfloat16).eval()


def t5(device, seed):
    torch.manual_seed(seed)
    with torch.device(device):
        m = T5EncoderModel(models_text.t5_config("t5-xxl"))
    return m.to(torch.bfloat16).eval()


def vae(family, device, seed):
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    with torch.device(device):
        m = AutoencoderKL(**models_vae.vae_config(family))
    return m.to(torch.bfloat16).eval()


def build(family, out, device):
    from diffusers import (EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                           StableDiffusion3Pipeline, StableDiffusionXLPipeline)
    if family == "flux":
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**pipelines.FLUX_SCHEDULER),
                            vae=vae("flux", device, 1), text_encoder=clip("clip-l", False, device, 2),
                            tokenizer=clip_tokenizer("<|endoftext|>"), text_encoder_2=t5(device, 3),
                            tokenizer_2=t5_tokenizer(),
                            transformer=models_flux.build("flux-dev", device, torch.bfloat16, 4))
    elif family == "sd3":
        pipe = StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**pipelines.SD3_SCHEDULER),
                                        vae=vae("sd3", device, 1), text_encoder=clip("clip-l", True, device, 2),
                                        tokenizer=clip_tokenizer("<|endoftext|>"),
                                        text_encoder_2=clip("clip-g", True, device, 3), tokenizer_2=clip_tokenizer("!"),
                                        text_encoder_3=t5(device, 5), tokenizer_3=t5_tokenizer(),
                                        transformer=models_sd3.build("sd3.5-large", device, torch.bfloat16, 4))
    else:
        pipe = StableDiffusionXLPipeline(scheduler=EulerDiscreteScheduler(**pipelines.SDXL_SCHEDULER),
                                         vae=vae("sdxl", device, 1), text_encoder=clip("clip-l", False, device, 2),
                                         tokenizer=clip_tokenizer("<|endoftext|>"),
                                         text_encoder_2=clip("clip-g", True, device, 3), tokenizer_2=clip_tokenizer("!"),
                                         unet=models_unet.build("sdxl", device, torch.bfloat16, 4),
                                         add_watermarker=False)
    pipe.save_pretrained(out, max_shard_size="5GB")
    del pipe
    # The published tokenizer files (vocab.json + merges.txt, spiece.model), as pipelines.as_downloaded.
    for comp in os.listdir(out):
        path = os.path.join(out, comp)
        if not comp.startswith("tokenizer"):
            continue
        if os.path.exists(os.path.join(path, "merges.txt")) or "clip" in open(
                os.path.join(path, "tokenizer_config.json")).read().lower():
            pipelines.write_clip_files(path)
        else:
            shutil.copy(pipelines.T5_MODEL, os.path.join(path, "spiece.model"))
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            os.remove(os.path.join(path, "tokenizer.json"))


def images(folder, count, seed):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = [(1024, 1024), (832, 1216), (1216, 832)]
    words = ["red", "blue", "green", "yellow"]
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        y, x = np.mgrid[0:h, 0:w]
        c = rng.uniform(0, 255, 3)
        r = min(w, h) * rng.uniform(0.15, 0.35)
        cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
        inside = (x - cx) ** 2 + (y - cy) ** 2 < r * r
        img = np.stack([x * 255.0 / w, y * 255.0 / h, np.full_like(x, 128.0)], -1)
        img[inside] = c
        Image.fromarray(img.astype(np.uint8)).save(os.path.join(folder, f"shape{i}.png"))
        with open(os.path.join(folder, f"shape{i}.txt"), "w") as f:
            f.write(f"a {words[i % 4]} circle on a gradient, photo {i}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["flux", "sd3", "sdxl"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", help="also write a captioned image folder here")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.images:
        images(a.images, a.count, 7)
    with torch.no_grad():
        build(a.family, a.out, a.device)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(a.out) for f in fs)
    print(f"wrote {a.out}: {total / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
