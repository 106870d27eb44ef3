"""Initial parameter values: the user's own, or the model's own init under a per-module seed.

For a model built on the meta device, each module is materialised alone (peak host
memory ~ the largest module) under a seed derived from (spec.seed, module name), so the
values are the same for every world size and stage; each rank keeps only its rows. The
init is what building the model on the CPU would do: `reset_parameters()` (torch's
modules), then, for a Hugging Face model, its `_init_weights` on the module and on each
of its ancestors, nearest first (HF's `initialize_weights` order: a block's init may set
its children, as GPT-2's scaled `c_proj`), then `Spec.init_fn`.

Nothing is left to `torch.empty`: every tensor is filled with a sentinel first (a signalling
NaN, which arithmetic never makes; a pattern for integers; for one-byte dtypes, two runs
with different fills), and a tensor that still holds it after `reset_parameters()` and
`Spec.init_fn` is named in a ConfigError instead of training on garbage.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch import Tensor

from fz.errors import ConfigError

InitFn = Callable[[str, nn.Module], None]
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# signalling NaNs (arithmetic only makes quiet ones) with a payload of their own
_FLOAT_SENTINELS = {torch.float32: 0x7FA5A5A5, torch.float64: 0x7FF4A5A5A5A5A5A5, torch.float16: 0x7CA5,
                    torch.bfloat16: 0x7FA5, torch.complex64: 0x7FA5A5A57FA5A5A5}
_BYTE_FILLS = (0x00, 0x01)  # dtypes without a sentinel: two runs, filled with each


def module_seed(seed: int, module_name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _owner(name: str) -> tuple[str, str]:
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def _signed(bits: int, size: int) -> int:
    return bits - (1 << 8 * size) if bits >= 1 << (8 * size - 1) else bits


def sentinel(t: Tensor) -> tuple[torch.dtype, int] | None:
    """(integer view dtype, value) of the sentinel that fills `t`; None: no value can be told
    apart (one-byte dtypes, complex128), so those are initialised twice with different fills."""
    size = t.element_size()
    if t.dtype in _FLOAT_SENTINELS:
        return _INTS[size], _signed(_FLOAT_SENTINELS[t.dtype], size)
    if t.is_floating_point() or t.is_complex() or size not in (2, 4, 8):
        return None
    return _INTS[size], _signed(int.from_bytes(b"\xa5" * size, "little"), size)


def _fill(t: Tensor, second: bool) -> Tensor:
    if t.numel():
        s = sentinel(t)
        if s is None:
            t.view(-1).view(torch.uint8).fill_(_BYTE_FILLS[second])
        else:
            t.view(-1).view(s[0]).fill_(s[1])
    return t


def still_filled(t: Tensor, second: bool = False) -> Tensor:
    """Per element: does `t` still hold its fill (that of the second run if `second`)? (bool, flat)"""
    flat = t.detach().contiguous().view(-1)
    s = sentinel(t)
    if s is None:
        return (flat.view(torch.uint8).view(-1, t.element_size()) == _BYTE_FILLS[second]).all(dim=1)
    return flat.view(s[0]) == s[1]


class InitialValues:
    """Full initial values of canonical parameters/buffers, one module at a time; remembers
    every tensor its initialisers left unset for one error (`check`) that names them all."""

    def __init__(self, model: nn.Module, seed: int, device: torch.device, init_fn: InitFn | None = None):
        self.model, self.seed, self.device, self.init_fn = model, seed, device, init_fn
        self.tensors: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=True))
        self.tensors.update(model.named_buffers(remove_duplicate=True))
        self.unset: list[tuple[str, str, str]] = []  # (kind, canonical name, why)

    def __call__(self, names: list[str]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        meta_by_module: dict[str, list[str]] = {}
        for n in names:
            t = self.tensors[n]
            if t.is_meta:
                meta_by_module.setdefault(_owner(n)[0], []).append(n)
            else:
                # never the module's own (training updates buffers in place)
                out[n] = t.detach().to(self.device, copy=True)
        for mname, full_names in meta_by_module.items():
            out.update(self._materialize(self.model.get_submodule(mname), mname, full_names))
        return out

    def _twin(self, module: nn.Module, mname: str, second: bool) -> nn.Module:
        """A copy of `module` with its own tensors filled, its children left on meta (their
        own turn comes), after reset_parameters() and init_fn under the module's seed."""
        dev = self.device
        twin = nn.Module.__new__(type(module))
        twin.__dict__ = dict(module.__dict__)
        twin._parameters = {k: (None if p is None else nn.Parameter(_fill(torch.empty_like(p, device=dev), second),
                                                                    p.requires_grad))
                            for k, p in module._parameters.items()}
        twin._buffers = {k: (None if b is None else _fill(torch.empty_like(b, device=dev), second))
                         for k, b in module._buffers.items()}
        twin._modules = dict(module._modules)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, mname))
            init = _own_init(twin)
            if init is not None:
                init()
            self._torch_parent_inits(twin, mname)
            self._model_init(twin, mname)
            if self.init_fn is not None:
                self.init_fn(mname, twin)
        return twin

    def _torch_parent_inits(self, twin: nn.Module, mname: str) -> None:
        """torch modules whose constructor ends by initialising their children's tensors too
        (`nn.MultiheadAttention._reset_parameters` zeroes `out_proj.bias`; `nn.Transformer`'s
        re-draws every matrix): run it on a shell of each such ancestor whose child on the way
        down is `twin`, nearest first, as building the model on the CPU would."""
        names = [mname.rsplit(".", k)[0] for k in range(1, mname.count(".") + 1)] + ([""] if mname else [])
        current, below = twin, mname
        for name in names:
            original = self.model.get_submodule(name)
            shell = nn.Module.__new__(type(original))
            shell.__dict__ = dict(original.__dict__)
            shell._modules = dict(original._modules, **{below.rsplit(".", 1)[-1]: current})
            init = _torch_private_init(shell)
            if init is not None:
                init()
            current, below = shell, name

    def _model_init(self, twin: nn.Module, mname: str) -> None:
        """A Hugging Face model's own `_init_weights` on `twin` and then on each ancestor, nearest
        first; an ancestor is a shallow copy whose child on the way down is the twin (its other
        tensors stay meta: initialising them does nothing, their own turn comes)."""
        names = [mname] + [mname.rsplit(".", k)[0] for k in range(1, mname.count(".") + 1)] + ([""] if mname else [])
        current = twin
        for k, name in enumerate(names):
            if k:
                original = self.model.get_submodule(name)
                current_leaf = names[k - 1].rsplit(".", 1)[-1]
                shell = nn.Module.__new__(type(original))
                shell.__dict__ = dict(original.__dict__)
                shell._modules = dict(original._modules, **{current_leaf: current})
                current = shell
            init = self._hf_init(name)
            if init is not None:
                init(current)

    def _hf_init(self, name: str) -> Callable[[nn.Module], None] | None:
        """`_init_weights` of the nearest Hugging Face model (one with a config) containing `name`."""
        parts = name.split(".") if name else []
        for k in range(len(parts), -1, -1):
            owner = self.model.get_submodule(".".join(parts[:k]))
            init = getattr(owner, "_init_weights", None)
            if callable(init) and hasattr(owner, "config"):
                return init
        return None

    def _materialize(self, module: nn.Module, mname: str, full_names: list[str]) -> dict[str, Tensor]:
        twin = self._twin(module, mname, False)
        leaves = [_owner(n)[1] for n in full_names]
        values = [self._leaf(twin, leaf) for leaf in leaves]
        again = None
        if any(sentinel(v) is None for v in values):  # e.g. a bool mask: run it again, filled otherwise
            again = self._twin(module, mname, True)
        for n, leaf, v in zip(full_names, leaves, values):
            unset = still_filled(v)
            if sentinel(v) is None:
                assert again is not None, "made above for every value without a sentinel"
                unset &= still_filled(self._leaf(again, leaf), True)
            if bool(unset.any()):
                self.unset.append(("parameter" if leaf in module._parameters else "buffer", n,
                                   self._why(module, unset)))
        return dict(zip(full_names, values))

    @staticmethod
    def _leaf(twin: nn.Module, leaf: str) -> Tensor:
        t: Tensor | None = twin._parameters.get(leaf)
        if t is None:
            t = twin._buffers.get(leaf)
        if t is None:
            raise ConfigError(f"{type(twin).__name__}.{leaf} is None after its reset_parameters() / init_fn")
        return t.detach()

    def _why(self, module: nn.Module, unset: Tensor) -> str:
        part = "" if bool(unset.all()) else f"{int(unset.sum())} of {unset.numel()} elements "
        init = _own_init(module)
        if init is not None:
            return f"{part}not set by {type(module).__name__}.{init.__name__}()" + (
                " or init_fn" if self.init_fn else ""
            )
        return f"{part}not set: {type(module).__name__} has no reset_parameters()" + (
            " and init_fn does not set it" if self.init_fn else "")

    def check(self) -> None:
        """Raise the ConfigError naming every tensor left unset (none: return)."""
        if not self.unset:
            return
        lines = "\n  ".join(f"{kind} {name!r}: {why}" for kind, name, why in self.unset)
        raise ConfigError(
            f"fz.init: the model was built on the meta device and {len(self.unset)} tensor(s) would start as "
            f"uninitialised memory:\n  {lines}\n"
            "Set them with Spec(init_fn=fn) (fn(module_name, module) runs on each module after its "
            "reset_parameters(), under no_grad; fill its tensors in place), give the module a reset_parameters() "
            "that sets them, or build the model on the CPU.")


def _torch_private_init(module: nn.Module) -> Callable[[], None] | None:
    """torch's own modules without a public reset_parameters() initialise in a private
    `_reset_parameters()` (nn.MultiheadAttention, nn.Transformer); only torch's are trusted."""
    init = getattr(module, "_reset_parameters", None)
    return init if callable(init) and type(module).__module__.startswith("torch.nn") else None


def _own_init(module: nn.Module) -> Callable[[], None] | None:
    """What initialises `module`'s own tensors when it is built: reset_parameters(), else torch's private one."""
    init = getattr(module, "reset_parameters", None)
    return init if callable(init) else _torch_private_init(module)
