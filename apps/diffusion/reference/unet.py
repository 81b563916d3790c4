"""PyTorch twin of apps/diffusion/src/unet.{h,cpp}: a small class-conditional UNet for 28x28.

Names (state-dict keys identical to FLAME's): t_embedder.mlp.{0,2}, y_embedder.embedding_table,
conv_in, down_blocks.{i}, downsamplers.{i}, mid_block1, mid_attn, mid_block2, up_blocks.{j},
upsamplers.{j}, norm_out, conv_out. Init: PyTorch's defaults for Conv2d/Linear, the embedders as
DiT's, conv_out zero.
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import LabelEmbedder, TimestepEmbedder, init_embedders


@dataclass
class UNetConfig:
    name: str = "unet-s"
    image_size: int = 28
    in_channels: int = 1
    base_channels: int = 64
    channel_mult: tuple = (1, 2, 4)
    groups: int = 32
    heads: int = 4
    emb_dim: int = 256
    num_classes: int = 10
    frequency_dim: int = 256
    time_scale: float = 1000.0


PRESETS = {
    "unet-tiny": dict(base_channels=32, channel_mult=(1, 2, 2), groups=8, heads=2, emb_dim=128),
    "unet-s": dict(base_channels=64, channel_mult=(1, 2, 4), groups=32, heads=4, emb_dim=256),
}


def unet_config(name):
    if name not in PRESETS:
        raise ValueError(f"unknown UNet preset '{name}' (known: {', '.join(PRESETS)})")
    return UNetConfig(name=name, **PRESETS[name])


def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, emb_dim, groups):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = conv3x3(cin, cout)
        self.emb_proj = nn.Linear(emb_dim, cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = conv3x3(cout, cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x, c):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb_proj(F.silu(c))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.skip(x) if self.skip is not None else x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels, groups, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x):
        b, ch, hh, ww = x.shape
        n = hh * ww
        tokens = self.norm(x).flatten(2).transpose(1, 2)
        q = self.qkv(tokens).reshape(b, n, 3, self.heads, ch // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q[0], q[1], q[2])
        out = self.proj(o.transpose(1, 2).reshape(b, n, ch))
        return x + out.transpose(1, 2).reshape(b, ch, hh, ww)


class UNet(nn.Module):
    def __init__(self, config: UNetConfig):
        super().__init__()
        c = self.config = config
        levels = len(c.channel_mult)
        ch = [c.base_channels * m for m in c.channel_mult]
        self.t_embedder = TimestepEmbedder(c.emb_dim, c.frequency_dim)
        self.y_embedder = LabelEmbedder(c.num_classes, c.emb_dim)
        self.conv_in = conv3x3(c.in_channels, c.base_channels)
        self.down_blocks = nn.ModuleList()
        self.downsamplers = nn.ModuleList()
        cur = c.base_channels
        for i in range(levels):
            self.down_blocks.append(ResBlock(cur, ch[i], c.emb_dim, c.groups))
            cur = ch[i]
            if i + 1 < levels:
                self.downsamplers.append(conv3x3(cur, cur, stride=2))
        self.mid_block1 = ResBlock(cur, cur, c.emb_dim, c.groups)
        self.mid_attn = AttnBlock(cur, c.groups, c.heads)
        self.mid_block2 = ResBlock(cur, cur, c.emb_dim, c.groups)
        self.up_blocks = nn.ModuleList()
        self.upsamplers = nn.ModuleList()
        for j in range(levels):
            out = ch[levels - 1 - j]
            self.up_blocks.append(ResBlock(cur + out, out, c.emb_dim, c.groups))
            cur = out
            if j + 1 < levels:
                self.upsamplers.append(conv3x3(cur, cur))
        self.norm_out = nn.GroupNorm(c.groups, cur)
        self.conv_out = conv3x3(cur, c.in_channels)
        with torch.no_grad():
            init_embedders(self.t_embedder, self.y_embedder)
            nn.init.zeros_(self.conv_out.weight)
            nn.init.zeros_(self.conv_out.bias)

    @property
    def null_class(self):
        return self.config.num_classes

    def forward(self, x, t, y):
        c = self.t_embedder(t.float() * self.config.time_scale) + self.y_embedder(y)
        h = self.conv_in(x)
        skips = []
        levels = len(self.down_blocks)
        for i in range(levels):
            h = self.down_blocks[i](h, c)
            skips.append(h)
            if i + 1 < levels:
                h = self.downsamplers[i](h)
        h = self.mid_block2(self.mid_attn(self.mid_block1(h, c)), c)
        for j in range(levels):
            h = self.up_blocks[j](torch.cat([h, skips[levels - 1 - j]], dim=1), c)
            if j + 1 < levels:
                h = self.upsamplers[j](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(h)))


def make_model(name):
    """Any preset of dit.py or unet.py."""
    if name.startswith("unet-"):
        return UNet(unet_config(name))
    from dit import DiT, dit_config
    return DiT(dit_config(name))
