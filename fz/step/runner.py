"""Runs the skeleton on one step's parameters: the only place that calls the model.

`Runner` hands each unit its parameters when the unit is called: views of the bucket
storage for replicated buckets, a just-in-time all-gather for sharded ones (whose
saved-for-backward copies are markers, so the gathered tensors die with the unit's
forward and are gathered again for its backward: see fz/sharding/gather.py). The root's
own buckets are gathered when the model's forward starts and held until backward ends;
a bucket several units use (a tied embedding and head) is gathered once a forward and held
until its last user has run, and its gradient is passed on once, the sum over its uses
(fz/sharding/uses.py).
"""
from __future__ import annotations

import fnmatch
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from fz.model.skeleton import Skeleton, hf_layers_as_checkpointed
from fz.model.standin import running
from fz.offload.transfer import Upload
from fz.sharding.buckets import Bucket
from fz.sharding.comm import Comm
from fz.sharding.gather import Gatherer, LiveCounter, ParamSaver, gather_bucket
from fz.sharding.plan import ShardPlan
from fz.sharding.sync import ParamSync
from fz.sharding.uses import GradUses
from fz.spec import Spec
from fz.step.binding import Bindings, checkpoint_seen, inside_checkpoint
from fz.step.pooled_backward import pooled_backward
from fz.step.unused import UsedParams


class Runner:
    """One forward pass over `leaves` (one tensor per bucket: full params or this rank's shard)."""

    def __init__(self, skel: Skeleton, plan: ShardPlan, comm: Comm, leaves: Sequence[Tensor],
                 buffers: dict[str, Tensor], spec: Spec, order: Sequence[int] = (), *, backward: bool = True,
                 grad_sink: Callable | None = None, sync: ParamSync | None = None, used: UsedParams | None = None):
        """`spec` gives prefetch, compile, the compute dtype and, when a `backward` follows (train_step),
        activation checkpointing and `live_buckets`; eval and apply run forward only."""
        checkpointing = spec.activation_checkpointing if backward else False
        live_buckets = spec.live_buckets if backward else 0
        prefetch, compile, compute_dtype = spec.prefetch, spec.compile, spec.compute_dtype
        self.skel, self.plan, self.leaves, self.buffers = skel, plan, leaves, buffers
        self.bindings = Bindings()
        self.used = used  # Spec.skip_unused: which parameters backward reaches
        # floating buffers of modules with parameters (BatchNorm's statistics) in the compute dtype,
        # one copy per step, written back after it (fz/model/skeleton.py: _buffer_kinds)
        self.cast = set(skel.cast_buffers) if compute_dtype != torch.float32 else set()
        self.compute_dtype = compute_dtype
        self.cast_copies: dict[str, tuple[Tensor, int]] = {}  # buffer -> (its cast copy, the copy's version)
        self.order = list(order)  # units in forward call order, as the last step saw them (for prefetch)
        self.live = LiveCounter()
        self.sync = sync  # replicated buckets still being all-gathered from the last update
        self.grad_sink, self.prefetch = grad_sink, prefetch
        self.compiled = compiled_units(skel, compile) if compile else None
        # blocks only: a root leaf's recompute would gather it once more to save nothing
        self.checkpointed = [i > 0 and not u.leaf
                             and (u.checkpointed or _wants_checkpoint(checkpointing, u.name, u.module))
                             for i, u in enumerate(skel.units)]
        for unit, checkpointed in zip(skel.units, self.checkpointed):
            if checkpointed:
                hf_layers_as_checkpointed(unit.module)
        self.unit_buckets = unit_buckets(skel, plan.buckets)
        self.sharded = [sum(b.sharded_param for b in ub) for ub in self.unit_buckets]
        # stage 3 with room to spare: the first units' gathered buckets stay alive from forward
        # to backward (no second all-gather) while the root, the running unit and the
        # prefetched ones still fit under `live_buckets` (DeepSpeed's stage3_max_live_parameters)
        widest = max(self.sharded[1:], default=0)
        self.keep_budget = keep_budget(live_buckets, prefetch, self.sharded[0], widest, skel.fetches_root)
        self.kept: set = set()  # units whose gathered buckets this forward keeps for backward
        self.root_tensors: dict[str, Tensor] = {}
        self.read_tensors: dict[str, Tensor] = {}  # root leaves' parameters this forward read outside their call
        self.gatherer = Gatherer(comm, self.live, Upload)  # one rank: offloaded shards' uploads on the copy stream
        self.gatherer.users = shared_buckets(self.unit_buckets)
        self.saver: ParamSaver | None = ParamSaver(self.gatherer, self._on_regather)  # None once disposed
        self.uses = GradUses(grad_sink) if grad_sink is not None else None
        self.backward_seen: set = set()
        self.in_unit = self.in_backward = False
        self.called: list[int] = []  # units in the order this forward called them

    def _bucket_tensors(self, b: Bucket, unit: int) -> list[Tensor]:
        leaf = self.leaves[b.index]
        if b.sharded_param:
            grad = torch.is_grad_enabled()
            saver = self.saver if self.in_unit and grad else None
            sink = self.uses if grad else None
            if sink is not None and leaf.requires_grad and not self.in_backward:  # a recompute's gather has no backward
                sink.gathered(b)
            return gather_bucket(leaf, b, self.gatherer, saver, sink, unit)
        if self.sync is not None:
            self.sync.wait(b.index)
        return [t.view(s.shape) for s, t in zip(b.slots, leaf.split([s.numel for s in b.slots]))]

    def _on_regather(self, b: Bucket, unit: int) -> None:
        self._backward_reached(unit)

    def _backward_reached(self, unit: int) -> None:
        """Backward reached `unit` (a marker unpacked, or its checkpoint recomputing it): start
        gathering the unit before it."""
        if unit not in self.backward_seen:
            self.backward_seen.add(unit)
            self._prefetch_units(unit, -1)

    def _prefetch_units(self, unit: int, direction: int, kind: str | None = None) -> None:
        """Start gathering the next `prefetch` units after (1) or before (-1) `unit` in call
        order (direction 0: `unit` itself), and reading the one after those if its shards
        live on disk (offload), so its gather finds them in memory. `kind`: what the gathers are
        for (comm.h2d's count of offloaded shards), by default what the gatherer does now."""
        order = self.order
        if not self.prefetch or unit not in order:
            return
        pos = order.index(unit)
        for k in range(1, self.prefetch + 2) if direction else (0,):
            j = pos + direction * k
            if 0 <= j < len(order):
                if direction < 0 and (order[j] in self.kept or not (order[j] in self._saver.marked
                                                                      or self.checkpointed[order[j]])):
                    continue  # still gathered since its forward, or its backward needs no parameter (an embedding)
                for b in self.unit_buckets[order[j]]:
                    if b.sharded_param and k <= self.prefetch:
                        self.gatherer.prefetch(b, self.leaves[b.index], kind)
                    elif b.sharded_param:  # one unit further: a shard on disk starts its read
                        self.gatherer.read_ahead(b, self.leaves[b.index])

    def _gathered(self, index: int) -> dict[str, Tensor]:
        """{canonical name: tensor} of the buckets `index` gathers (or views, when replicated)."""
        own: dict[str, Tensor] = {}
        for b in self.unit_buckets[index]:
            own.update(zip((s.name for s in b.slots), self._bucket_tensors(b, index)))
        return own

    def read(self, index: int, local: str) -> Tensor:
        """A root leaf's parameter or buffer that the model reads outside the leaf's call
        (`F.linear(h, self.wte.weight)`): gathered once per forward (the forward's end drops
        it; autograd keeps it while it needs it), its gradient joined with the leaf's other
        uses (fz/sharding/uses.py)."""
        unit = self.skel.units[index]
        c = dict(unit.params).get(local)
        if c is None:
            return self._buffer(dict(unit.buffers)[local])
        if c in self.root_tensors:
            return self.root_tensors[c]
        if c not in self.read_tensors:
            got = self._gathered(index)
            if self.used is not None and torch.is_grad_enabled():
                self.used.watch(got)
            self.read_tensors.update(got)
        return self.read_tensors[c]

    def _unit_args(self, index: int) -> dict[str, Tensor]:
        own = self._gathered(index)
        if self.used is not None and torch.is_grad_enabled():
            self.used.watch(own)
        if index == 0:
            self.root_tensors = own
            if self.order:  # the root is gathered: start on the first block it will call
                self._prefetch_units(self.order[0], 0)
        unit = self.skel.units[index]
        args = {local: own[c] if c in own else self.root_tensors[c] for local, c in unit.params}
        args.update((local, self._buffer(c)) for local, c in unit.buffers)
        return args

    def _buffer(self, c: str) -> Tensor:
        if c not in self.cast:
            return self.buffers[c]
        if c not in self.cast_copies:
            copy = self.buffers[c].to(self.compute_dtype)
            self.cast_copies[c] = (copy, copy._version)
        return self.cast_copies[c][0]

    def _run_unit(self, index: int, args: tuple, kwargs: dict) -> Any:
        if self.in_backward and self.checkpointed[index]:
            self._backward_reached(index)  # its recompute: the unit before it is next
        module, tensors = self.skel.units[index].module, self._unit_args(index)
        if self.compiled:
            return self.compiled[index](module, tensors, args, kwargs)
        # bound until backward is done, so a checkpoint inside the block recomputes with them
        # (fz/step/binding.py); a stage-3 block's gathered tensors only if one ran inside it with
        # a backward to come (without grad, as in eval and generate, they go with the call)
        slots = self.bindings.bind(module, tensors)
        if not self.sharded[index]:
            return module(*args, **kwargs)
        # `finally`: a checkpoint's recompute in backward stops with an exception once it has
        # what backward needs (torch's early stop), and the gathered tensors must go then too
        with checkpoint_seen() as seen:
            try:
                return module(*args, **kwargs)
            finally:
                if not (seen[0] and torch.is_grad_enabled()):
                    self.bindings.unbind(slots)

    def call_unit(self, index: int, args: tuple, kwargs: dict) -> Any:
        self.called.append(index)
        self._prefetch_units(index, 1)
        if self.checkpointed[index] and torch.is_grad_enabled():
            # activation checkpointing around the functional call (never inside the module):
            # the unit, its gather included, runs again in backward
            out = checkpoint(self._run_unit, index, args, kwargs, use_reentrant=False)
            if self.order and index == self.order[-1]:
                self._prefetch_units(index, 0, "recompute")  # its recompute comes first: gathered while the loss runs
            return out
        n = self.sharded[index]
        if not (n and torch.is_grad_enabled()) or self.in_backward or inside_checkpoint():
            # a checkpoint around the unit (the model's own) saves its tensors, and recomputes them in
            # backward: gathered again there, as a unit fz checkpoints (fz's saver would keep them)
            return self._run_unit(index, args, kwargs)
        if index not in self.kept and sum(self.sharded[u] for u in self.kept) + n <= self.keep_budget:
            self.kept.add(index)
        if index in self.kept:
            return self._run_unit(index, args, kwargs)  # autograd saves the gathered tensors themselves
        self.in_unit = True
        try:
            with saved_tensors_hooks(self._saver.pack, self._saver.unpack):
                out = self._run_unit(index, args, kwargs)
        finally:
            self.in_unit = False
        if self.order and index == self.order[-1] and index in self._saver.marked:
            self._prefetch_units(index, 0, "recompute")  # its backward comes first: gathered while the loss runs
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with running(self):
                return self._run_unit(0, args, kwargs)
        finally:
            self.read_tensors = {}
            self.gatherer.end_forward()

    def inside(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn` (the forward of a submodule its caller runs directly, as HF's generate runs an
        encoder-decoder's encoder) with the root's tensors bound, as when the root's forward calls
        it: the blocks inside gather as usual."""
        try:
            with running(self):
                self.bindings.bind(self.skel.units[0].module, self._unit_args(0))
                return fn(*args, **kwargs)
        finally:
            self.read_tensors = {}
            self.gatherer.end_forward()

    def backward(self, loss: Tensor) -> None:
        """`loss.backward()` with unit calls still going to this runner (a checkpoint around blocks
        in the model's own forward calls them again in backward)."""
        self.in_backward, self.gatherer.kind = True, "recompute"
        try:
            with running(self), pooled_backward(self.plan.device, compiled=self.compiled is not None):
                loss.backward()
        finally:
            self.in_backward, self.gatherer.kind = False, "forward"

    @property
    def _saver(self) -> ParamSaver:
        if self.saver is None:
            raise RuntimeError("fz: a step's Runner was used after dispose()")
        return self.saver

    def dispose(self) -> None:
        """Break the runner's reference cycles (hooks -> runner) once the step is done."""
        self.release()
        self.leaves, self.saver, self.grad_sink, self.sync, self.uses = (), None, None, None, None

    def release(self) -> None:
        """After backward: pass on gradients of uses that had no backward, drop the root's
        gathered parameters, finish stray prefetches, and remember the call order so the
        next step can prefetch."""
        if self.uses is not None:
            self.uses.flush()
        self.root_tensors, self.read_tensors = {}, {}
        self.bindings.release()
        running = set(self.skel.running_stats) if self.skel.training else set()
        for c, (copy, version) in self.cast_copies.items():
            if copy._version != version or c in running:  # the module updated it (BatchNorm's statistics)
                self.buffers[c].copy_(copy)
        self.cast_copies = {}
        self.backward_seen = set()
        self.kept = set()
        if self.saver is not None:
            self.saver.marked = set()
        self.gatherer.close()
        if self.called:
            self.order, self.called = self.called, []


def unit_buckets(skel: Skeleton, buckets: Sequence[Bucket]) -> list[list[Bucket]]:
    """The buckets each unit gathers: the root, its own (held for the step); another unit, the
    ones holding its parameters that the root does not (a bucket shared by a tied embedding
    and head is gathered by both)."""
    where = {s.name: b for b in buckets for s in b.slots}
    out: list[list[Bucket]] = [[b for b in buckets if b.unit == 0]]
    for unit in skel.units[1:]:
        mine = {where[c].index: where[c] for _, c in unit.params if where[c].unit != 0}
        out.append(sorted(mine.values(), key=lambda b: b.index))
    return out


def shared_buckets(unit_buckets: Sequence[Sequence[Bucket]]) -> dict[int, int]:
    """Sharded buckets that more than one unit gathers (a tied embedding and head) -> how many."""
    users = Counter(b.index for ub in unit_buckets[1:] for b in ub if b.sharded_param)
    return {i: n for i, n in users.items() if n > 1}


def keep_budget(live_buckets: int, prefetch: int, root: int, widest: int, fetches_root: bool) -> int:
    """Gathered buckets that may stay alive from a unit's forward to its backward: what
    `live_buckets` leaves beside the root's `root` buckets and the running and prefetched units
    (`widest` buckets each). When the root's leaves are fetched per use, the root still counts
    as one: they are in flight like blocks, and `live_buckets` keeps its meaning (and default)."""
    return live_buckets - (max(root, 1) if fetches_root else root) - (1 + prefetch) * widest


def _call(module, params, args, kwargs):
    return functional_call(module, params, args, kwargs, tie_weights=False, strict=False)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_units(skel: Skeleton, backend: Any) -> list[Callable]:
    """One torch.compile'd functional call per unit (cached per skeleton: compiled once)."""
    key = "inductor" if backend is True else str(backend)
    per_skel = _COMPILED.setdefault(skel.root, {})
    if key not in per_skel:
        per_skel[key] = [torch.compile(_call, backend=key, dynamic=False) if i > 0 else _call
                         for i in range(len(skel.units))]
    return per_skel[key]


def _wants_checkpoint(policy: Any, name: str, module: Any) -> bool:
    """Spec.activation_checkpointing: True (every block), block-name patterns, or a predicate."""
    if isinstance(policy, bool):
        return policy
    if callable(policy):
        return bool(policy(name, module))
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in policy)


class BoundModel:
    """What `loss_fn(model, batch)` receives: call it like the module; attributes, indexing and
    iteration read through (to the model, whose blocks are stand-ins: fz/model/standin.py). A
    function set as its `forward` runs in the model's place, with the root's tensors bound (a
    library's forward redirection: `model.forward = f; model(x)` runs `f(x)` as the forward)."""

    def __init__(self, runner: Runner):
        self._runner = runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        patched = self.__dict__.get("forward")
        if patched is not None:  # a forward put in the model's place (TRL's forward redirection)
            if getattr(patched, "__self__", None) is self._runner.skel.root:
                del self.__dict__["forward"]  # the model's own, put back: the plain call
            else:
                return self._runner.inside(patched, *args, **kwargs)
        return self._runner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner.skel.root, name)

    @property  # type: ignore[misc]  # isinstance(model, PeftModel) reads __class__, as for stand-ins
    def __class__(self) -> type:
        return type(self._runner.skel.root)

    def __getitem__(self, key: Any) -> Any:
        root: Any = self._runner.skel.root  # indexable when the model is (nn.Sequential, ModuleList)
        return root[key]

    def __iter__(self):
        return iter(self._runner.skel.root)

    def __len__(self) -> int:
        root: Any = self._runner.skel.root  # sized when the model is
        return len(root)

    def __bool__(self) -> bool:
        return True
