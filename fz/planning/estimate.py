"""`Estimate`: what `fz.estimate` found, the bytes of each term per device, per host and on disk, and
its text (each total, then the terms it is the sum of, so the lines add up). fz/planning/estimator.py
computes one; ladder.py and render.py read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fz.planning.beside import Beside

KINDS = ("params", "master", "moments", "grads", "buffers")


@dataclass(frozen=True)
class Estimate:
    """Predicted bytes of one configuration. Per-rank fields are the largest rank's (rank 0:
    Shard(0) gives the first ranks the most rows); `per_host` and `per_disk` add up the ranks
    of one node."""

    world_size: int
    nodes: int
    stage: int
    precision: str
    num_params: int
    params: int  # as memory_report: this rank's parameter storage (any tier)
    grads: int  # as memory_report: the step's gradient buffers, in the parameters' dtype
    master: int  # fp32 master weights (mixed precision)
    optimizer: int  # the optimizer's own state (Adam: two moments); memory_report's opt = master + optimizer
    buffers: int  # the model's buffers
    gather: int  # stage 3: gathered buckets alive at once (the root's own and the units in flight: _gather)
    reduce: int  # gradient reductions in flight (their own buffers)
    grads_update: int  # gradients as the update reads them (fp32 copies in mixed precision)
    sync: int  # stages 1-2: the all-gathers' inputs (and padded buckets' buffers) until they land (fz/sharding/sync.py)
    io_buffers: int  # the disk tier's host buffers
    activations: int | None  # at the forward's end, traced from one micro-batch (None: no batch given)
    backward_start: int | None  # activations + one op's gradients at backward's first op (fz/planning/activations.py)
    backward_units: int | None  # activations + gradients at the worst point of the units' backward
    model_copy: int  # a model built normally (not on the meta device): its fp32 values on the host
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # per rank, as memory_report.tiers
    ranks_per_node: int = 1
    # one parameter's optimizer state and master rows: the disk tier's I/O buffer must hold it
    largest_opt_part: int = 0
    update_loaded: int = 0  # parameters on disk: the bucket read into memory (read ahead, or being updated)
    gather_summed: int = 0  # the part of `gather` that is gradients summed over a bucket's several users
    accumulated: int = 0  # grad_accum > 1, replicated gradients (stages 0-1): summed in full across micro-batches
    pool_idle: int = 0  # the disk tier: idle host buffers kept for reuse (shards read from disk), at most
    pool_idle_cpu: int = 0  # the same where host and device are one memory (the step's buffers too), at most
    link: int = 0  # a CPU run's ranks of one host: the buffer their collectives share (fz/distributed/shm.py)
    # the parts of `gather` (with gather_summed; the prefetched units are the rest: `gather_prefetched`)
    gather_root: int = 0  # the root's own buckets, gathered for the whole step (the root not fetched per use)
    gather_unit: int = 0  # the largest unit, gathered while it runs
    gather_kept: int = 0  # units `live_buckets` keeps from forward to backward
    grads_update_narrow: int = 0  # the part of grads_update that is the 16-bit sum kept beside its fp32 copy
    largest_layer: int = 0  # DeepSpeed's largest layer (parameters one module holds itself), in parameters
    largest_unit: int = 0  # the most parameters one fz gather holds (a unit), in parameters
    offload: tuple[str, str] = ("device", "device")  # (optimizer's tier, parameters' tier)
    traced_for: str | None = None  # the device type whose autocast the activations were traced as ("cuda", "cpu")

    @property
    def gather_prefetched(self) -> int:
        """The units in flight beside the largest one (the `prefetch` ones over several ranks)."""
        return self.gather - self.gather_root - self.gather_unit - self.gather_kept - self.gather_summed

    @property
    def backward(self) -> int | None:
        """Activations + gradients at backward's worst point."""
        if self.backward_start is None:
            return None
        return max(self.backward_start, self.backward_units or 0)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def per_device(self) -> int:
        """Peak device bytes of one rank during a step (the sum of `device_peak()`'s terms)."""
        return sum(v for _, v in self.device_peak()[1])

    def device_peak(self) -> tuple[str, list[tuple[str, int]]]:
        """(when the device peaks, [(term, bytes)] that add up to `per_device`): what stays on the
        device for the whole step, plus the worst of three moments. Backward's first op holds every
        activation and the gathered units, no gradient made or reduced yet; then backward frees a
        block's activations as it makes the block's gradients (`backward_units` is its worst
        point) with reductions in flight; the update holds the gradients as it reads them and, at
        stages 1-2, the all-gathers' inputs."""
        resident = [(f"{k} (resident)", v) for k, v in self.tiers["device"].items() if k != "grads"]
        grads = ("gradients for the update", self.grads_update)
        if (self.backward_units or 0) > self.grads_update:
            grads = ("activations + gradients, units' backward", self.backward_units or 0)
        gathered = self.gathered()
        moments = {
            "backward's first op": [("activations + first op's gradients", self.backward_start or 0),
                                    *gathered[:-1], ("accumulated gradients", self.accumulated)],
            "backward": [*gathered, ("reductions in flight", self.reduce),
                         ("accumulated gradients", self.accumulated), grads],
            "the update": [*gathered, ("gradients for the update", self.grads_update),
                           ("all-gather inputs (sync)", self.sync)],
        }
        when = max(moments, key=lambda m: sum(v for _, v in moments[m]))  # the first of equals
        return when, resident + moments[when]

    def gathered(self) -> list[tuple[str, int]]:
        """Stage 3's gathered bytes (`gather`) by kind, the summed gradients last: the root's own
        buckets, held for the step; the running unit (counted as the largest); the units prefetched
        beside it; those `live_buckets` keeps from forward to backward; the gradient of a weight
        several units gather, summed until its last use's backward."""
        return [("gathered: the root's own, for the step", self.gather_root),
                (f"gathered: running unit (largest, {self.gather_unit / self._el / 1e6:,.1f}M)", self.gather_unit),
                ("gathered: prefetched units", self.gather_prefetched),
                ("gathered: kept (live_buckets)", self.gather_kept),
                ("gathered: summed shared-weight gradient", self.gather_summed)]

    @property
    def _el(self) -> int:
        """Bytes of one parameter in the compute dtype."""
        return 4 if self.precision == "fp32" else 2

    def host_terms(self) -> list[tuple[str, int]]:
        """[(term, bytes)] of one rank's host memory: they add up to `per_rank_host`."""
        pool = [("idle buffers kept for reuse (at most)", self.pool_idle)] if self.pool_idle else []
        return [*self.tiers["host"].items(), *pool, ("model copy (built off meta)", self.model_copy)]

    @property
    def one_memory(self) -> int:
        """Peak bytes of one rank where host and device are one memory (a CPU-only run). The
        host gradients of an offloaded optimizer stay in their buffers from step to step (kept
        by the process's pool, as pinned ones are on a GPU: fz/offload/host_grads.py), so they
        add to backward's worst point. Parameters on disk add one bucket read into memory: read
        ahead for the next gather in backward, being updated in the streamed update."""
        host_grads = self.tiers["host"].get("grads", 0)
        if not host_grads:
            return self.per_device + self.per_rank_host - self.pool_idle + self.pool_idle_cpu + self.link
        resident = sum(v for k, v in self.tiers["device"].items() if k != "grads") + \
            sum(self.tiers["host"].values()) + self.model_copy + self.pool_idle_cpu + self.link
        during_backward = self.reduce + self.update_loaded + (self.backward or 0)
        return resident + self.gather + max(during_backward, self.sync + self.update_loaded)

    @property
    def per_rank_host(self) -> int:
        return sum(v for _, v in self.host_terms())

    @property
    def per_host(self) -> int:
        """Host memory of one node: every local rank's host tier, I/O buffers and model copy."""
        return self.ranks_per_node * self.per_rank_host

    @property
    def per_disk(self) -> int:
        """Bytes the disk tier holds on one node, which is also the free space it needs: a step
        writes its update in place (fz/step/stream.py), and fz.init checks for this much."""
        return self.ranks_per_node * sum(self.tiers["disk"].values())

    def beside_deepspeed(self) -> Beside | None:
        """The per-GPU and per-CPU figures split into DeepSpeed's estimator's terms and fz's extras,
        beside DeepSpeed's figures for the same counts (fz/planning/beside.py); None where
        DeepSpeed's estimators have no row (stages 0-1, NVMe, fp32)."""
        from fz.planning.beside import beside
        return beside(self)

    def __str__(self) -> str:
        """Each total, then the terms it is the sum of; then the same figures beside DeepSpeed's."""
        side = self.beside_deepspeed()
        return _text(self) + ("" if side is None else "\n" + str(side))


def _text(est: Estimate) -> str:
    """`str(fz.estimate(...))`: each total, then every term it is the sum of, so the lines add up."""
    gb = lambda x: f"{x / 2**30:8.2f} GB"  # noqa: E731

    def block(title: str, total: int, terms: list[tuple[str, int]]) -> list[str]:
        return [f"  {title:<44}{gb(total)}", *(f"    {k:<42}{gb(v)}" for k, v in terms if v)]

    when, device = est.device_peak()
    n = est.ranks_per_node
    lines = [f"fz estimate: {est.num_params / 1e6:,.1f}M params, ZeRO stage {est.stage}, {est.precision}, "
             f"{est.nodes} node(s) x {n} rank(s)" + (f", activations as {est.traced_for} keeps them"
                                                      if est.traced_for else ""),
             *block("model states per rank (as fz.memory_report)", est.model_states,
                    [("params", est.params), ("grads", est.grads), ("master", est.master),
                     ("optimizer", est.optimizer)]),
             *block(f"per device, at its peak ({when})", est.per_device, device),
             *block("per rank on the host", est.per_rank_host, est.host_terms()),
             f"  {f'per host ({n} rank(s) x the line above)':<44}{gb(est.per_host)}"]
    if est.per_disk:
        lines += [*block("on disk per rank", est.per_disk // n, list(est.tiers["disk"].items())),
                  f"  {f'on disk per node ({n} rank(s))':<44}{gb(est.per_disk)}"]
    return "\n".join(lines)
