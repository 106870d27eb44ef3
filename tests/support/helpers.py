"""Shared test pieces: the tiny GPT, its data, and the plain single-process reference."""
from __future__ import annotations

import torch

from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=2)
MICRO = 2
STEPS = 10
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.01, 1.0


def make_model(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def rank_batches(world: int, grad_accum: int, steps: int = STEPS, cfg: GPTConfig = CFG) -> list[list[torch.Tensor]]:
    """batches[step][rank]: each rank's [grad_accum * MICRO, seq + 1] tokens."""
    rows = world * grad_accum * MICRO
    out = []
    for step in range(steps):
        data = synthetic_tokens(rows, cfg.seq, cfg.vocab, seed=1000 + step)
        out.append(list(data.chunk(world)))
    return out


def reference(
    world: int, grad_accum: int, steps: int = STEPS, clip=CLIP
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: AdamW + clip_grad_norm_ on the concatenated global batch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for per_rank in rank_batches(world, grad_accum, steps):
        loss = lm_loss(model, torch.cat(per_rank))
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def spec(stage: int, grad_accum: int, **kw):
    import fz
    args = dict(stage=stage, optimizer=fz.optim.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
                grad_accum=grad_accum, clip_grad_norm=CLIP, loss_fn=lm_loss, seed=0)
    args.update(kw)
    return fz.Spec(**args)


def train_fz(rank: int, world: int, stage: int, grad_accum: int, steps: int = STEPS, **kw):
    import fz
    state = fz.init(make_model(), spec(stage, grad_accum, **kw))
    losses = []
    for per_rank in rank_batches(world, grad_accum, steps):
        state, loss = fz.train_step(state, per_rank[rank])
        losses.append(float(loss))
    return state, losses


def max_rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs().clamp_min(1e-6)).max())


def params_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest relative error of a parameter tensor (norm of difference / norm of reference)."""
    tied = set(got) - set(want)  # a tied name of full_params is the same tensor as one the reference names
    assert all(any(got[t] is got[k] for k in want if k in got) for t in tied), (sorted(got), sorted(want))
    got = {k: v for k, v in got.items() if k not in tied}
    assert len(got) > 0, (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)) for k in got)




def config_error(fn) -> str:
    """The message of the fz.ConfigError `fn()` raises, or '' if it raises none."""
    import fz
    try:
        fn()
    except fz.ConfigError as e:
        return str(e)
    return ""


def transform_updates(transform, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """The updates an fz.optim transformation makes over `steps` steps on two small tensors with
    seeded random gradients (compared against a torch optimizer's, or another transformation's)."""
    import fz
    torch.manual_seed(0)
    p = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    state, out = transform.init(p), []
    for _ in range(steps):
        u, state = transform.update({k: torch.randn_like(v) for k, v in p.items()}, state, p)
        out.append({k: v.clone() for k, v in u.items()})
        fz.optim.apply_updates(p, u)
    return out


class LionRef(torch.optim.Optimizer):
    """Lion on whole tensors: the paper's Algorithm 2 with decoupled decay."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                update = (b1 * m + (1 - b1) * p.grad).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
