"""Shared pieces of the PyTorch twins of apps/diffusion's models (embed.h / embed.cpp).

Same names, same math and same init scheme as the FLAME side, so a state dict saved by either
loads in the other (`interop.py` checks it). Only torch is needed.
"""
import math

import torch
import torch.nn as nn


def timestep_embedding(t, dim, max_period=10000.0):
    """DiT's sinusoidal table: [cos(t f_i), sin(t f_i)], f_i = max_period^(-i/half), f32."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def sincos_2d_pos_embed(dim, grid_size):
    """[grid^2, dim] in float64 then f32: row r*grid+c; first half encodes the column c, the
    second the row r, each as [sin(pos w_k), cos(pos w_k)], w_k = 10000^(-k/(dim/4))."""
    if dim % 4:
        raise ValueError(f"sincos_2d_pos_embed: dim must be divisible by 4, got {dim}")
    quarter = dim // 4
    k = torch.arange(quarter, dtype=torch.float64)
    omega = 1.0 / torch.pow(torch.tensor(10000.0, dtype=torch.float64), k / quarter)
    idx = torch.arange(grid_size * grid_size)
    rows = (idx // grid_size).to(torch.float64)
    cols = (idx % grid_size).to(torch.float64)

    def enc(pos):
        a = pos[:, None] * omega[None]
        return torch.cat([torch.sin(a), torch.cos(a)], dim=1)

    return torch.cat([enc(cols), enc(rows)], dim=1).to(torch.float32)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, frequency_dim=256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        return self.mlp(timestep_embedding(t, self.frequency_dim))


class LabelEmbedder(nn.Module):
    """num_classes + 1 rows: the last is the null class of classifier-free guidance."""

    def __init__(self, num_classes, hidden):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, hidden)

    def forward(self, labels):
        return self.embedding_table(labels)


def drop_labels(labels, p, null_class, generator=None):
    drop = torch.rand(labels.shape, device=labels.device, generator=generator) < p
    return torch.where(drop, torch.full_like(labels, null_class), labels)


@torch.no_grad()
def init_embedders(t_embedder, y_embedder):
    """N(0, 0.02) label table and timestep-MLP weights, zero timestep-MLP biases."""
    nn.init.normal_(y_embedder.embedding_table.weight, std=0.02)
    for i in (0, 2):
        nn.init.normal_(t_embedder.mlp[i].weight, std=0.02)
        nn.init.zeros_(t_embedder.mlp[i].bias)
