"""`fz.generate`: Hugging Face's own `generate()` on the state's weights, with a residency plan.

Why HF's `generate` and not a loop of fz's own: users compare against `model.generate` token
for token, and it carries years of details (logits processors, stopping criteria, caches,
left padding, position ids, special tokens) that a second loop would have to repeat and would
drift from. What fz changes is only where the weights come from. The model's root forward is
redirected, for the call, to a Runner over the state's parameters (the same one `fz.apply`
uses), so every forward of the decode loop runs the skeleton's blocks functionally on the
state's tensors: nothing is copied into a module, the state is not touched, and training can
continue after it.

The Runner is a `ResidentRunner` (fz/step/residency.py): units the residency plan holds are
gathered on their first call and kept until `generate` returns ("gather once, decode many"),
the others are gathered per forward with prefetch. After each forward the Runner releases
what it does not hold, so streaming keeps memory at a few units.

Lockstep: at stage 3 every forward gathers, so the ranks of a shard group must run the same
number of forwards. HF's `synced_gpus=True` does exactly that (a finished rank keeps running
forwards until every rank is done), but its check all-reduces over the default group; fz
replaces that check, for the call, by one over the state's shard group, and turns it on
itself: the user sets no flag. At stages 0-2 there are no collectives and a rank may call
`generate` alone.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from fz.errors import ConfigError
from fz.sharding.comm import Comm
from fz.sharding.settle import Handle
from fz.state import State, expect_state
from fz.step.batches import on_device
from fz.step.residency import deciding
from fz.step.train import _forward


def generate(state: State, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, *,
             residency: str | int = "auto", budget: float | None = None, seed: int | None = None,
             **generation_kwargs: Any) -> Tensor:
    """Token ids, as the model's own `generate(input_ids, attention_mask, **generation_kwargs)`
    returns them, computed with the state's current weights (in eval mode); the state is unchanged.
    Encoder-decoder models too (BART, T5; Whisper with `input_features=` in place of input_ids):
    the encoder HF's generate runs directly runs on the state's weights as well.

    `residency`: "auto" (chosen from `budget` bytes per rank, default what is free now), "gather"
    (the whole model gathered once per call), "stream" (every unit gathered per forward) or k,
    the first k units kept. The plan is logged once per call. `seed`: sampling's generator is
    seeded with it (the same on every rank); without it, the state's generator is used. Either
    way the caller's generators are left as they were.

    At stage 3 this is a collective: every rank of the state's shard group calls it (prompts
    may differ per rank, lengths too); a rank whose sequences end first keeps running forwards
    until all have. At stages 0-2 it is local."""
    expect_state(state, "fz.generate")
    root = state.skeleton.root
    if not callable(getattr(type(root), "generate", None)):
        raise ConfigError(f"fz.generate needs a model with Hugging Face's generate() (a GenerationMixin such as "
                          f"LlamaForCausalLM); {type(root).__name__} has none: call fz.apply in a loop of your own")
    if "synced_gpus" in generation_kwargs:
        raise ConfigError("fz.generate: do not pass synced_gpus: fz keeps the ranks of a stage-3 state in lockstep "
                          "itself (a rank that finished keeps running forwards until every rank has)")
    plan = state.plan
    sharded = any(b.sharded_param for b in plan.buckets)
    given = {"attention_mask": attention_mask} if attention_mask is not None else {}
    given, generation_kwargs = on_device((given, generation_kwargs), plan.device)
    inputs = () if input_ids is None else (on_device(input_ids, plan.device),)

    def run(runner, comm: Comm) -> Tensor:
        if seed is not None:
            torch.manual_seed(seed)
        lockstep = sharded and comm.world > 1
        with _redirected(root, runner, comm if lockstep else None, plan.device, state.spec.compute_dtype):
            make: Any = root.generate  # GenerationMixin.generate, checked above
            return make(*inputs, **given, synced_gpus=lockstep, **generation_kwargs)

    return _forward(state, run, what="fz.generate", collective=sharded,
                    residency=deciding(state, residency, budget, "fz.generate"))


class _redirected:
    """For one call: the root's forward runs on `runner` (each forward then releases what the
    runner does not hold), and so does each submodule HF's generate calls directly (an
    encoder-decoder's encoder and decoder, the root's other children): on the state's weights,
    as from inside the root. HF's end-of-loop check agrees over `comm`'s group. A forward a
    library set on the instance (TRL's fused head) is the one that runs, and is put back after."""

    def __init__(self, root: torch.nn.Module, runner: Any, comm: Comm | None, device: torch.device,
                 dtype: torch.dtype):
        self.root, self.runner, self.comm = root, runner, comm
        self.probe = None
        self.saved: list[tuple[torch.nn.Module, Any]] = []  # (module, its own instance forward or None)
        first = next(root.parameters(), None)
        if first is None or first.device != device:  # the skeleton's parameters are on meta (or none):
            # HF's generate reads model.device / model.dtype from the first parameter (Whisper makes its
            # decoder's first ids there)
            self.probe = torch.nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)

    def _direct(self) -> list[torch.nn.Module]:
        """The submodules HF may call outside the root's forward: encoder, decoder, the root's children."""
        root: Any = self.root
        found = [getter() for getter in (getattr(root, "get_encoder", None), getattr(root, "get_decoder", None))
                 if callable(getter)]
        found += list(root.children())
        out: list[torch.nn.Module] = []
        for m in found:
            if isinstance(m, torch.nn.Module) and m is not root and type(m).__name__ != "_UnitCall" and \
                    all(m is not o for o in out):
                out.append(m)
        return out

    def _wrap(self, module: torch.nn.Module, inside: list[bool], first: bool) -> None:
        own = module.__dict__.get("forward")
        call = own if own is not None else type(module).forward.__get__(module)
        runner = self.runner

        @functools.wraps(call)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:  # called from within a forward already running on the runner
                return call(*args, **kwargs)
            inside[0] = True
            try:
                return runner(*args, **kwargs) if first else runner.inside(call, *args, **kwargs)
            finally:
                inside[0] = False
                runner.release()  # streamed units dropped; the call order kept for the next prefetch

        self.saved.append((module, own))
        object.__setattr__(module, "forward", forward)

    def __enter__(self) -> None:
        inside = [False]
        if self.probe is not None:
            self.root.register_parameter("_fz_device_probe", self.probe)
        self._wrap(self.root, inside, True)
        for module in self._direct():
            self._wrap(module, inside, False)
        if self.comm is not None:
            object.__setattr__(self.root, "_has_unfinished_sequences", functools.partial(_unfinished, self.comm))

    def __exit__(self, *exc: Any) -> None:
        for module, own in reversed(self.saved):
            module.__dict__.pop("forward", None)
            if own is not None:
                object.__setattr__(module, "forward", own)
        self.root.__dict__.pop("_has_unfinished_sequences", None)
        self.root._parameters.pop("_fz_device_probe", None)


def _unfinished(comm: Comm, this_peer_finished: bool, synced_gpus: bool, device: torch.device) -> bool:
    """HF's `_has_unfinished_sequences` with synced_gpus, over the shard group: True while any
    rank of it has a sequence still going."""
    flag = torch.tensor(0.0 if this_peer_finished else 1.0, device=comm.device)
    sum_ = torch.distributed.ReduceOp.SUM  # waited within Spec.timeout_s: a rank lost meanwhile is an fz.PeerError
    Handle([flag]).add(torch.distributed.all_reduce(flag, op=sum_, group=comm.group, async_op=True)).wait()
    return bool(flag.item() > 0)
