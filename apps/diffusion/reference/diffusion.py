"""PyTorch twin of apps/diffusion/src/objective.{h,cpp} and sampler.{h,cpp}.

Rectified flow: x_t = (1 - t) x0 + t eps (t = 0 data, t = 1 noise), target v = eps - x0,
t ~ sigmoid(N(0, 1)). DDPM: T = 1000, linear (1e-4 .. 0.02) or cosine betas, eps target, the model
sees t = n / T. Samplers: Euler / Heun from t = 1 to 0, DDIM (eta 0) / ancestral (eta 1), classifier-
free guidance with the conditional and null-class passes in one batch. Models: dit.py / unet.py.
"""
import math

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- objectives

def flow_loss(model, x0, y, generator=None, eps=None, t=None):
    if eps is None:
        eps = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    if t is None:
        t = torch.sigmoid(torch.randn(x0.shape[0], generator=generator, device=x0.device))
    tt = t.to(x0.dtype).view(-1, 1, 1, 1)
    xt = (1 - tt) * x0 + tt * eps
    return F.mse_loss(model(xt, t, y), eps - x0)


def ddpm_alphas_cumprod(kind="linear", steps=1000):
    if kind == "linear":
        scale = 1000.0 / steps
        betas = torch.linspace(scale * 1e-4, scale * 0.02, steps, dtype=torch.float64)
    elif kind == "cosine":
        def f(u):
            return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
        betas = torch.tensor([min(1 - f((i + 1) / steps) / f(i / steps), 0.999) for i in range(steps)],
                             dtype=torch.float64)
    else:
        raise ValueError(f"unknown beta schedule '{kind}' (known: linear, cosine)")
    return torch.cumprod(1 - betas, dim=0)


def ddpm_loss(model, x0, y, alphas_cumprod, generator=None, eps=None, n=None):
    steps = alphas_cumprod.shape[0]
    if eps is None:
        eps = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    if n is None:
        n = torch.randint(0, steps, (x0.shape[0],), generator=generator, device=x0.device)
    ab = alphas_cumprod.to(x0.device)[n].to(x0.dtype).view(-1, 1, 1, 1)
    xn = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
    return F.mse_loss(model(xn, n.float() / steps, y), eps)


# ---------------------------------------------------------------- samplers

def guided(model, labels, cfg_scale):
    """f(x, t) of the model with labels bound and guidance, both passes in one batch."""
    null = torch.full_like(labels, model.null_class)
    y2 = torch.cat([labels, null])

    def f(x, t):
        cond, uncond = model(torch.cat([x, x]), torch.cat([t, t]), y2).chunk(2)
        return uncond + cfg_scale * (cond - uncond)
    return f


@torch.no_grad()
def euler_solve(velocity, x, steps):
    for i in range(steps):
        t, t_next = 1 - i / steps, 1 - (i + 1) / steps
        x = x + (t_next - t) * velocity(x, torch.full((x.shape[0],), t, device=x.device))
    return x


@torch.no_grad()
def heun_solve(velocity, x, steps):
    for i in range(steps):
        t, t_next = 1 - i / steps, 1 - (i + 1) / steps
        dt = t_next - t
        d = velocity(x, torch.full((x.shape[0],), t, device=x.device))
        d_next = velocity(x + dt * d, torch.full((x.shape[0],), t_next, device=x.device))
        x = x + 0.5 * dt * (d + d_next)
    return x


def ddim_timesteps(T, steps):
    if steps == 1:
        return [T - 1]
    # half away from zero, as the C++ side (llround), not Python's round-half-even
    return [int(math.floor((steps - 1 - i) / (steps - 1) * (T - 1) + 0.5)) for i in range(steps)]


@torch.no_grad()
def ddim_solve(eps_model, alphas_cumprod, x, steps, eta=0.0, generator=None, clip_x0=True):
    T = alphas_cumprod.shape[0]
    ts = ddim_timesteps(T, steps)
    for i, n in enumerate(ts):
        ab = alphas_cumprod[n].item()
        ab_prev = alphas_cumprod[ts[i + 1]].item() if i + 1 < len(ts) else 1.0
        eps = eps_model(x, torch.full((x.shape[0],), n / T, device=x.device))
        x0 = (x - math.sqrt(1 - ab) * eps) / math.sqrt(ab)
        if clip_x0:
            x0 = x0.clamp(-1, 1)
            eps = (x - math.sqrt(ab) * x0) / math.sqrt(1 - ab)
        sigma = eta * math.sqrt((1 - ab_prev) / (1 - ab)) * math.sqrt(1 - ab / ab_prev)
        x = math.sqrt(ab_prev) * x0 + math.sqrt(max(1 - ab_prev - sigma ** 2, 0.0)) * eps
        if sigma > 0:
            x = x + sigma * torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return x


@torch.no_grad()
def sample(model, labels, sampler="euler", steps=32, cfg_scale=1.0, seed=0, alphas_cumprod=None, eta=0.0):
    """[B, C, H, W] in [-1, 1]; deterministic for a seed on one device."""
    was_training = model.training
    model.eval()
    p = next(model.parameters())
    cfg = model.config
    size = getattr(cfg, "input_size", None) or cfg.image_size
    g = torch.Generator(device=p.device).manual_seed(seed)
    x = torch.randn((labels.shape[0], cfg.in_channels, size, size), generator=g, device=p.device, dtype=p.dtype)
    f = guided(model, labels.to(p.device), cfg_scale)
    if sampler == "euler":
        out = euler_solve(f, x, steps)
    elif sampler == "heun":
        out = heun_solve(f, x, steps)
    elif sampler in ("ddim", "ddpm"):
        if alphas_cumprod is None:
            raise ValueError(f"sampler '{sampler}' needs the DDPM schedule (alphas_cumprod)")
        out = ddim_solve(f, alphas_cumprod, x, steps, 1.0 if sampler == "ddpm" else eta, g)
    else:
        raise ValueError(f"unknown sampler '{sampler}' (known: euler, heun, ddim, ddpm)")
    model.train(was_training)
    return out.clamp(-1, 1)
