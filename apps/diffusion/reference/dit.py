"""PyTorch twin of apps/diffusion/src/dit.{h,cpp}: DiT with adaLN-Zero for 28x28 images.

Parameter names are the DiT reference's (x_embedder.proj, pos_embed, t_embedder.mlp.0/2,
y_embedder.embedding_table, blocks.N.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2, adaLN_modulation.1},
final_layer.{linear, adaLN_modulation.1}). pos_embed is a learned parameter initialised with the
2-D sin-cos table; t is continuous in [0, 1] and embedded as t * time_scale (1000).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import LabelEmbedder, TimestepEmbedder, init_embedders, sincos_2d_pos_embed

NORM_EPS = 1e-6


@dataclass
class DiTConfig:
    name: str = "dit-s"
    input_size: int = 28
    patch_size: int = 2
    in_channels: int = 1
    hidden: int = 384
    depth: int = 12
    heads: int = 6
    mlp_ratio: float = 4.0
    num_classes: int = 10
    frequency_dim: int = 256
    time_scale: float = 1000.0

    @property
    def grid(self):
        return self.input_size // self.patch_size

    @property
    def tokens(self):
        return self.grid * self.grid


PRESETS = {
    "dit-tiny": dict(hidden=96, depth=4, heads=4),
    "dit-s": dict(hidden=384, depth=12, heads=6),
    "dit-b": dict(hidden=768, depth=12, heads=12),
}


def dit_config(name):
    if name not in PRESETS:
        raise ValueError(f"unknown DiT preset '{name}' (known: {', '.join(PRESETS)})")
    return DiTConfig(name=name, **PRESETS[name])


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class PatchEmbed(nn.Module):
    def __init__(self, in_channels, hidden, patch_size):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden, patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # scale 1/sqrt(head_dim)
        return self.proj(o.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, hidden, mlp_hidden):
        super().__init__()
        self.fc1 = nn.Linear(hidden, mlp_hidden)
        self.fc2 = nn.Linear(mlp_hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, mlp_ratio):
        super().__init__()
        self.hidden = hidden
        self.attn = Attention(hidden, heads)
        self.mlp = Mlp(hidden, int(hidden * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        h = F.layer_norm(x, (self.hidden,), eps=NORM_EPS)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(h, shift_msa, scale_msa))
        h = F.layer_norm(x, (self.hidden,), eps=NORM_EPS)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(h, shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, hidden, patch_size, out_channels):
        super().__init__()
        self.hidden = hidden
        self.linear = nn.Linear(hidden, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(F.layer_norm(x, (self.hidden,), eps=NORM_EPS), shift, scale))


class DiT(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        c = self.config = config
        # pos_embed is DiT's own parameter: first in the state dict, as on the FLAME side.
        self.pos_embed = nn.Parameter(torch.zeros(1, c.tokens, c.hidden))
        self.x_embedder = PatchEmbed(c.in_channels, c.hidden, c.patch_size)
        self.t_embedder = TimestepEmbedder(c.hidden, c.frequency_dim)
        self.y_embedder = LabelEmbedder(c.num_classes, c.hidden)
        self.blocks = nn.ModuleList([DiTBlock(c.hidden, c.heads, c.mlp_ratio) for _ in range(c.depth)])
        self.final_layer = FinalLayer(c.hidden, c.patch_size, c.in_channels)
        self.initialize_weights()

    @property
    def null_class(self):
        return self.config.num_classes

    @torch.no_grad()
    def initialize_weights(self):
        def basic(m):
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

        self.apply(basic)
        self.pos_embed.copy_(sincos_2d_pos_embed(self.config.hidden, self.config.grid).unsqueeze(0))
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # as a [hidden, C*p*p] matrix
        nn.init.zeros_(self.x_embedder.proj.bias)
        init_embedders(self.t_embedder, self.y_embedder)
        for blk in self.blocks:
            nn.init.zeros_(blk.adaLN_modulation[1].weight)
            nn.init.zeros_(blk.adaLN_modulation[1].bias)
        for lin in (self.final_layer.adaLN_modulation[1], self.final_layer.linear):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def unpatchify(self, x):
        c, p, g = self.config.in_channels, self.config.patch_size, self.config.grid
        x = x.reshape(x.shape[0], g, g, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, g * p, g * p)

    def forward(self, x, t, y):
        h = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t.float() * self.config.time_scale) + self.y_embedder(y)
        for blk in self.blocks:
            h = blk(h, c)
        return self.unpatchify(self.final_layer(h, c))
