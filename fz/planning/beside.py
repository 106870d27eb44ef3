"""fz's estimate beside DeepSpeed's estimator, term by term.

DeepSpeed's `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py) and
`estimate_zero2_model_states_mem_needs` (stage_1_and_2.py) give bytes per GPU and per CPU (one
node) from two counts: Ψ, the parameters, and L, the largest layer (the most parameters one
module holds itself). fz's figures are larger where it counts what those formulas leave out,
and a DeepSpeed user comparing the two needs to see which is which. So each fz figure (the
device's peak during a step, one node's host memory) is split into rows that add up to it:
each row is one of DeepSpeed's terms, with DeepSpeed's bytes beside fz's (equal where both
count the same thing), or an extra of fz's that DeepSpeed's formula leaves out (prefetched
units, reduction buffers, ...), or a term only DeepSpeed has (its 1.5 buffer factor: fz 0).

Compared: model states of ZeRO-2 and ZeRO-3 in 16-bit mixed precision with Adam, nothing
offloaded or offloaded to the CPU, the model built on the meta device (DeepSpeed's
zero_init=1), as DeepSpeed's formulas assume; activations are left out on both sides.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol


class Estimate(Protocol):
    """What this module reads of fz/planning/estimate.py's Estimate, which calls it (a Protocol,
    not an import of that module: no estimate <-> beside circle)."""

    @property
    def world_size(self) -> int: ...

    @property
    def nodes(self) -> int: ...

    @property
    def stage(self) -> int: ...

    @property
    def precision(self) -> str: ...

    @property
    def num_params(self) -> int: ...

    @property
    def ranks_per_node(self) -> int: ...

    @property
    def gather_root(self) -> int: ...

    @property
    def gather_unit(self) -> int: ...

    @property
    def gather_kept(self) -> int: ...

    @property
    def gather_prefetched(self) -> int: ...

    @property
    def grads_update_narrow(self) -> int: ...

    @property
    def largest_layer(self) -> int: ...

    @property
    def offload(self) -> tuple[str, str]: ...

    def device_peak(self) -> tuple[str, list[tuple[str, int]]]: ...

    def host_terms(self) -> list[tuple[str, int]]: ...

BUFFER_FACTOR = 1.5  # DeepSpeed's default additional_buffer_factor (both functions)


def deepspeed_figures(stage: int, total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                      num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                      zero_init: bool = True, additional_buffer_factor: float = BUFFER_FACTOR) -> tuple[int, int]:
    """(per CPU, per GPU) bytes as DeepSpeed 0.19's estimators compute them, their code transcribed
    (stage 2: `estimate_zero2_model_states_mem_needs`, which takes no largest layer and no params
    offload; stage 3: `estimate_zero3_model_states_mem_needs`)."""
    total_gpus = num_nodes * num_gpus_per_node
    if stage == 2:
        if cpu_offload:
            return (int(total_params * max(4 * total_gpus, 16) * additional_buffer_factor), int(2 * total_params))
        return (int(total_params * 4 * num_gpus_per_node * additional_buffer_factor),
                int(2 * total_params + int(18 * total_params / total_gpus)))
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu = largest_layer_memory
        cpu = total_params * (18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor))
    elif cpu_offload:
        gpu = largest_layer_memory + int(2 * total_params / total_gpus)
        cpu = total_params * (16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor))
    else:
        gpu = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node
    return int(cpu * additional_buffer_factor), int(gpu)


@dataclass(frozen=True)
class Term:
    """One row: `deepspeed` is None for an fz extra DeepSpeed's formula leaves out."""

    name: str
    fz: int
    deepspeed: int | None


@dataclass(frozen=True)
class Beside:
    """fz's per-GPU and per-CPU figures split into DeepSpeed's terms and fz's extras."""

    call: str  # the DeepSpeed function and arguments whose figures stand beside fz's
    gpu: tuple[Term, ...]  # fz's column adds up to Estimate.per_device (activations left out)
    cpu: tuple[Term, ...]  # fz's column adds up to Estimate.per_host: one node
    deepspeed_gpu: int  # DeepSpeed's per-GPU figure, as its function prints it
    deepspeed_cpu: int  # DeepSpeed's per-CPU figure (its buffer factor included)

    @property
    def fz_gpu(self) -> int:
        return sum(t.fz for t in self.gpu)

    @property
    def fz_cpu(self) -> int:
        return sum(t.fz for t in self.cpu)

    def __str__(self) -> str:
        gb = lambda x: f"{'-':>9}" if x is None else f"{x / 2**30:6.2f} GB"  # noqa: E731
        lines = ["  beside DeepSpeed's estimator, model states only (fz extra: held beyond its formula)",
                 f"    {self.call}", f"  {'':<64}{'fz':>9}  {'DeepSpeed':>9}"]
        for title, fz, ds, terms in (("per GPU", self.fz_gpu, self.deepspeed_gpu, self.gpu),
                                     ("per CPU (one node)", self.fz_cpu, self.deepspeed_cpu, self.cpu)):
            lines.append(f"  {title:<64}{gb(fz)}  {gb(ds)}")
            lines += [f"    {('' if t.deepspeed is not None else 'fz extra: ') + t.name:<62}{gb(t.fz)}  "
                      f"{gb(t.deepspeed)}" for t in terms]
        return "\n".join(lines)


def beside(est: Estimate) -> Beside | None:
    """`est` split beside DeepSpeed's figures for the same counts, or None where DeepSpeed's
    estimators have no row for it (stages 0-1, NVMe, fp32)."""
    if est.stage not in (2, 3) or est.precision == "fp32" or not est.largest_layer \
            or est.offload not in (("device", "device"), ("host", "device"), ("host", "host")):
        return None  # DeepSpeed has no row offloading the parameters without the optimizer
    # model states only
    est = dataclasses.replace(_dataclass(est), activations=None, backward_start=None, backward_units=None)
    psi, layer, nodes, gpn = est.num_params, est.largest_layer, est.nodes, est.ranks_per_node
    opt_off, params_off = est.offload[0] == "host", est.offload[1] == "host"
    ds_cpu, ds_gpu = deepspeed_figures(est.stage, psi, layer, gpn, nodes, opt_off, params_off)
    if est.stage == 2:
        call = (f"estimate_zero2_model_states_mem_needs(total_params={psi}, num_gpus_per_node={gpn}, "
                f"num_nodes={nodes}, cpu_offload={opt_off})")
    else:
        call = (f"estimate_zero3_model_states_mem_needs(total_params={psi}, largest_layer_params={layer}, "
                f"num_gpus_per_node={gpn}, num_nodes={nodes}, cpu_offload={opt_off}, "
                f"cpu_offload_params={params_off}, zero_init=True)")
    return Beside(call, tuple(_gpu(est)), tuple(_cpu(est)), ds_gpu, ds_cpu)


def _gpu(est: Estimate) -> list[Term]:
    """The device's peak (`Estimate.device_peak`) row by row. DeepSpeed's 4·L at stage 3 reads as
    the largest layer's 16-bit parameters gathered and its 16-bit gradient (2 bytes each); fz
    gathers a whole unit (a block) at once and reduces in fp32, so the rest of what it gathers
    and reduces are extras. Its 18·Ψ/N (stage 3) and 2·Ψ + 18·Ψ/N (stage 2) split as its stage-2
    code comment names them: 16-bit params, 16-bit and fp32 gradients, fp32 params (master
    weights), 8 bytes of Adam state; stage 3's offload rows put 2·Ψ/N of it on the GPU."""
    psi, n, two_l, stage = est.num_params, est.world_size, 2 * est.largest_layer, est.stage
    opt_off = est.offload[0] == "host"
    per = psi if stage == 2 else psi / n  # where DeepSpeed's 16-bit parameters live
    out: list[Term] = []
    seen: set[str] = set()

    def ds(name: str, fz: int, deepspeed: float) -> None:
        out.append(Term(name, fz, int(deepspeed)))
        seen.add(name)

    params = f"16-bit parameters ({'2·Ψ' if stage == 2 else '2·Ψ/N: this GPU shard'})"
    master, moments = "fp32 master weights (4·Ψ/N)", "Adam's two moments (8·Ψ/N)"
    grads16, grads32 = "16-bit gradients (2·Ψ/N)", "fp32 gradients (4·Ψ/N)"
    gathered, gradient = "largest layer's parameters, gathered (2·L)", "largest layer's gradient (2·L)"
    terms = est.device_peak()[1]
    in_gather = [v for name, v in terms if name.startswith("gathered:")]
    for name, v in terms:
        if name.startswith("gathered:") and stage == 3:
            if gathered not in seen:
                out += _gathered(est, gathered, two_l, sum(in_gather))
                seen.add(gathered)
        elif name == "params (resident)" and est.offload[1] == "device":
            ds(params, v, 2 * per)
        elif name in ("master (resident)", "moments (resident)") and not opt_off:
            ds(master if name.startswith("master") else moments, v, (4 if name.startswith("master") else 8) * psi / n)
        elif name == "gradients for the update" and not opt_off:
            ds(grads32, v - est.grads_update_narrow, 4 * psi / n)
            if stage == 2:
                ds(grads16, est.grads_update_narrow, 2 * psi / n)
            else:
                _extra(out, "16-bit gradient sum beside its fp32 copy", est.grads_update_narrow)
        elif name == "reductions in flight" and stage == 3:
            ds(gradient, min(v, two_l), two_l)
            _extra(out, "reduction buffers beyond it (fp32, <= 2 buckets)", v - min(v, two_l))
        elif name == "reductions in flight":
            _extra(out, "reduction buffers in flight (<= 2 buckets)", v)
        elif name == "all-gather inputs (sync)":
            _extra(out, "all-gather inputs of the updated parameters", v)
        else:
            _extra(out, "the model's buffers" if name == "buffers (resident)" else name.replace(" (resident)", ""), v)
    wanted = [(params, 2 * per)] if est.offload[1] == "device" else []
    if not opt_off:
        wanted += [(master, 4 * psi / n), (moments, 8 * psi / n), (grads32, 4 * psi / n)]
        wanted += [(grads16, 2 * psi / n)] if stage == 2 else []
    if stage == 3:
        wanted += [(gathered, two_l), (gradient, two_l)]
    out += [Term(name, 0, int(v)) for name, v in wanted if name not in seen]  # DeepSpeed's, not held by fz then
    return out


def _gathered(est: Estimate, name: str, two_l: int, total: int) -> list[Term]:
    """Stage 3's gathered bytes at the peak (`total`: `Estimate.gathered()`'s parts): DeepSpeed's
    largest layer out of the part that holds it (the running unit, the largest; or the root's own
    buckets, when the layer is there and no unit is as large), then the rest by kind."""
    unit, root = est.gather_unit, est.gather_root
    from_root = unit < two_l <= root
    carved = two_l if from_root else min(unit, two_l)
    terms = [Term(name, carved, two_l)]
    _extra(terms, f"{'the' if from_root else 'rest of the'} running unit (largest, "
           f"{unit / 2e6:,.1f}M)", unit - (0 if from_root else carved))
    _extra(terms, f"{'rest of ' if from_root else ''}the root's parameters (held for the step)",
           root - (carved if from_root else 0))
    _extra(terms, "prefetched units", est.gather_prefetched)
    _extra(terms, "units kept from forward to backward (live_buckets)", est.gather_kept)
    _extra(terms, "summed gradient of a weight several units share",
           total - unit - root - est.gather_prefetched - est.gather_kept)
    return terms


def _cpu(est: Estimate) -> list[Term]:
    """One node's host memory row by row (`Estimate.host_terms`, times the ranks of a node)."""
    psi, nodes, stage, gpn = est.num_params, est.nodes, est.stage, est.ranks_per_node
    opt_off, params_off = est.offload[0] == "host", est.offload[1] == "host"
    per = psi / nodes if stage == 3 else psi  # DeepSpeed's stage-2 CPU formula does not divide by nodes
    names = {"params": ("16-bit parameters (2·Ψ)", 2 * per), "master": ("fp32 master weights (4·Ψ)", 4 * per),
             "moments": ("Adam's two moments (8·Ψ)", 8 * per), "grads": ("fp32 gradients (4·Ψ)", 4 * per)}
    out: list[Term] = []
    for kind, v in est.host_terms():
        if kind in names and (params_off if kind == "params" else opt_off):
            out.append(Term(names[kind][0], v * gpn, int(names[kind][1])))
        else:
            _extra(out, kind.replace("_", " "), v * gpn)
    base = 0.0
    if opt_off:
        base = (18 if params_off else 16) * per
        floor = max(4 * est.world_size, 16) * psi - 16 * psi if stage == 2 else 0
        if floor:
            out.append(Term("max(4·GPUs, 16)·Ψ: 4 bytes a parameter per GPU", 0, int(floor)))
            base += floor
    elif stage == 3:
        base = 4 * est.largest_layer * gpn
        out.append(Term("largest layer in fp32 per GPU process (4·L·GPUs per node)", 0, int(base)))
    else:
        base = 4 * psi * gpn
        out.append(Term("fp32 model per GPU process (4·Ψ·GPUs per node)", 0, int(base)))
    out.append(Term(f"DeepSpeed's buffer factor ({BUFFER_FACTOR}x the above)", 0, int(base * (BUFFER_FACTOR - 1))))
    return out


def _extra(out: list[Term], name: str, v: int) -> None:
    if v:
        out.append(Term(name, v, None))


def _dataclass(est: Estimate) -> Any:
    """The Estimate itself, for dataclasses.replace (a frozen dataclass behind the Protocol)."""
    assert dataclasses.is_dataclass(est) and not isinstance(est, type)
    return est
