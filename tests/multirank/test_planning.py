"""fz.estimate / estimate_table / plan: predictions against memory_report and measured peaks."""
from __future__ import annotations

import os

import pytest
import torch

import fz
from fz.config.export import to_deepspeed
from fz.planning.ladder import candidates
from fz.storage.scratch import IDLE_CAP
from fz.testing.gpt import GPT, GPTConfig, lm_loss
from fz.testing.spawn import run_ranks

from support.peak_worker import measure, measure_plan

SMALL = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=3)
MID = {"vocab": 4096, "seq": 128, "dim": 512, "heads": 8, "layers": 8}  # 27M params: states dominate noise


def _meta(cfg=SMALL):
    with torch.device("meta"):
        return GPT(cfg)


def _configs(path):
    """(stage, precision, offload, shard_group_size) combinations memory_report is compared on."""
    out = []
    for stage in range(4):
        for prec in ("fp32", "bf16"):
            out.append((stage, prec, None, None))
        if stage:
            out.append((stage, "bf16", fz.offload.cpu(), None))
    out += [
        (3, "fp32", fz.offload.nvme(path, params=True, buffer_mb=1), None),
        (3, "bf16", fz.offload.cpu(params=True), None),
        (3, "bf16", None, 2),
        (2, "fp32", None, 2),
    ]
    return out


def _compare(rank, world, path):
    """Every rank's memory_report against fz.estimate for the same rank position (rank 0 holds the most)."""
    out = []
    os.makedirs(os.path.join(path, f"r{rank}"), exist_ok=True)
    for stage, prec, off, group in _configs(os.path.join(path, f"r{rank}")):
        if group is not None and world % group:
            continue
        spec = fz.Spec(
            stage=stage, precision=prec, offload=off, shard_group_size=group, loss_fn=lm_loss, bucket_mb=0.01
        )
        r = fz.memory_report(fz.init(_meta(), spec))
        e = fz.estimate(_meta(), spec=spec, world_size=world)
        out.append(((stage, prec, off and (off.optimizer, off.params), group),
                    (r.params, r.grads, r.opt, r.tiers), (e.params, e.grads, e.master + e.optimizer, e.tiers)))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_estimate_equals_memory_report(world, tmp_path):
    results = run_ranks(world, _compare, str(tmp_path), timeout=240)
    for what, measured, predicted in results[0]:  # rank 0: the estimate is the largest rank's
        assert measured == predicted, (world, what)
    assert len(results[0]) >= 12


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_peak_within_10_percent(tmp_path, monkeypatch):
    """Peak RSS above the baseline vs the estimate's one-memory peak (host = device on this CPU).
    glibc's dynamic mmap threshold would keep freed blocks of up to 32 MB in the heap, so RSS
    would count freed memory too: a fixed threshold makes RSS follow the live bytes."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    nvme_gpt = dict(MID, vocab=1024)
    runs = [
        (1, dict(stage=3, precision="bf16", micro=8, gpt=MID)),
        (1, dict(stage=0, precision="fp32", micro=16, ac=True, gpt=MID)),
        (1, dict(stage=3, precision="bf16", micro=2, offload="nvme", buffer_mb=12, path=str(tmp_path), gpt=nvme_gpt)),
        (2, dict(stage=2, precision="bf16", micro=2, gpt=MID)),
    ]
    for world, cfg in runs:
        for r in run_ranks(world, measure, dict(cfg, steps=2), timeout=240):
            assert abs(r["peak"] - r["predicted"]) <= 0.10 * r["peak"], (cfg, r)


def test_backward_starts_with_the_blocks_inputs_and_recomputes_one_block_at_a_time():
    """Backward's first op meets what the forward left (the root's saved tensors, each checkpointed
    block's inputs) and what its first ops hold (`head`, tests/unit/test_backward_replay.py); no block
    is recomputed yet. A block's recompute counts
    in the units' backward, where it happens (the 2.8B GPT's device peak on an H200 held no
    block's inside at the first op)."""
    from fz.planning.activations import Trace
    t = Trace(saved={"": 10, "b0": 100, "b1": 60}, inputs={"b0": 4, "b1": 4}, head=20)
    forward, start, units = t.peaks(lambda u: True, {"b0": 7, "b1": 7}, grads_stay=False)
    assert start == 10 + 4 + 4 + 20
    assert forward == 10 + 4 + 4 + 100  # while the largest block runs
    assert units == max(4 + 60 + 7, 100 + 7)  # b1 beside b0's inputs, then b0 alone


def test_activations_traced_and_checkpointing_saves():
    m = _meta(GPTConfig(vocab=256, seq=64, dim=64, heads=4, layers=4))
    spec = fz.Spec(loss_fn=lm_loss)
    full = fz.estimate(m, spec=spec, micro_batch=4, seq_len=65)
    ckpt = fz.estimate(m, spec=spec, micro_batch=4, seq_len=65, activation_checkpointing=True)
    double = fz.estimate(m, spec=spec, micro_batch=8, seq_len=65)
    assert 0 < ckpt.activations < full.activations
    assert double.activations == pytest.approx(2 * full.activations, rel=0.02)  # linear in the batch
    assert fz.estimate(m, spec=spec).activations is None
    with pytest.raises(fz.ConfigError, match="seq_len"):
        fz.estimate(m, spec=spec, micro_batch=4)
    with pytest.raises(fz.ConfigError, match="raw counts"):
        fz.estimate((1000, 100), micro_batch=4, seq_len=8)


def test_seed_table_raw_counts():
    """The seed's example: 2,783M params, 65M largest layer, 1 node x 1 GPU (docs/planning.md: the formulas)."""
    text = fz.estimate_table((2783e6, 65e6), gpus_per_node=1, nodes=1)
    lines = text.splitlines()
    assert lines[:4] == ["Estimated memory needed for params, optim states and gradients for a:",
                         "HW: Setup with 1 node, 1 GPU per node.",
                         "SW: Model with 2783M total params, 65M largest layer params; fz, bf16, no activations.",
                         "  per CPU  |  per GPU |   Options"]
    assert len(lines) == 4 + 2 * (5 + 3 + 3 + 1)  # zero_init 1/0 x the offload options of stages 3, 2, 1, 0
    psi, layer, gb = 2783e6, 65e6, 2**30
    row = {line.split("| ")[2].split("  (DeepSpeed: ")[0]: line for line in lines[4:]}
    def cols(key):
        cpu, gpu = row[key].split("|")[:2]
        return float(cpu.strip()[:-2]) * gb, float(gpu.strip()[:-2]) * gb
    # ZeRO-3, nothing offloaded: device 14Ψ resident (2 params + 4 master + 8 moments) + 1 gathered layer (L x 2 B:
    # one rank prefetches nothing) + max(2 gradient buckets in flight (2L x 2 B: one rank reduces nothing, they
    # stay bf16) + the update's gradients (2 bf16 + 4 fp32: 6Ψ))
    cpu, gpu = cols("stage=3, offload_param=none, offload_optimizer=none, zero_init=1")
    assert cpu == 0 and gpu == pytest.approx(14 * psi + 2 * layer + 4 * layer + 6 * psi, rel=1e-3)
    cpu, gpu = cols("stage=3, offload_param=none, offload_optimizer=none, zero_init=0")
    assert cpu == pytest.approx(4 * psi, rel=1e-3)  # the model built with values: fp32 on the host
    # offloaded optimizer: gradients go to the host as they are reduced (fp32: 4Ψ there); on one GPU the
    # device holds the gathered layer (L x 2 B), the next one's upload in flight (prefetch=1: L x 2 B) and
    # the gradient copy in flight (L x 2 B)
    cpu, gpu = cols("stage=3, offload_param=cpu , offload_optimizer=cpu , zero_init=1")
    # the table's 0.01 GB
    assert cpu == pytest.approx(18 * psi, rel=1e-3) and gpu == pytest.approx(6 * layer, abs=0.005 * gb)
    assert gpu <= 0.5 * gb and cpu <= 70e9  # issue 22: DeepSpeed's class (0.25 GB / 70 GB)
    cpu, gpu = cols("stage=3, offload_param=none, offload_optimizer=cpu , zero_init=1")
    assert cpu == pytest.approx(16 * psi, rel=1e-3) and gpu == pytest.approx(2 * psi + 4 * layer, abs=0.005 * gb)
    assert gpu <= 5.5 * gb and cpu <= 62e9  # DeepSpeed: 5.43 GB / 62 GB
    assert cols("stage=2, offload_param=none, offload_optimizer=cpu , zero_init=1")[1] <= 5.5 * gb
    # on the host the 4 I/O buffers of 16 MB, the fp32 gradients (4Ψ) and the idle buffers the pool may keep
    # (IDLE_CAP x the largest shard read from disk: the 65M layer's bucket, bf16, one rank); 14Ψ on disk
    nvme_row = row["stage=3, offload_param=nvme, offload_optimizer=nvme, zero_init=1 (+36.29GB on disk per node)"]
    assert float(nvme_row.split("|")[0].strip()[:-2]) * gb == pytest.approx(
        4 * psi + 64 * 2**20 + IDLE_CAP * 2 * layer, abs=0.01 * gb)  # + the checksums, printed to 0.01 GB


def test_t0_3b_with_parameters_offloaded_holds_no_root():
    """T0_3B's shapes (T5 v1.1 XL: 65.8M-parameter embedding shared by encoder and decoder, an
    untied head) on the meta device, stage 3, bf16, parameters and optimizer on the host, one
    rank: the gathered part of the estimate is the running unit (the largest is the embedding),
    the next one's upload in flight (one rank prefetches offloaded shards' uploads) and the
    embedding's gradient summed over its users (fz/sharding/uses.py), no longer the root's
    embedding and head held for the whole step; raw counts agree (every layer a unit, two in
    flight)."""
    tr = pytest.importorskip("transformers")
    cfg = tr.T5Config(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_heads=32,
                      feed_forward_proj="gated-gelu")
    with torch.device("meta"):
        t0 = tr.T5ForConditionalGeneration(cfg)
        # transformers 5 ties T5's head; T0_3B's is not
        t0.lm_head.weight = torch.nn.Parameter(torch.empty(32128, 2048))
    emb, bucket = 32128 * 2048, int(25 * 2**20 / 4)
    spec = fz.Spec(stage=3, precision="bf16", offload=fz.offload.cpu(params=True))
    fetched, held = fz.estimate(t0, spec=spec), fz.estimate(t0, spec=spec.replace(offload=fz.offload.cpu()))
    assert 3 * emb * 2 <= fetched.gather <= (3 * emb + bucket) * 2, fetched.gather
    assert held.gather >= (2 * emb + 60e6) * 2, held.gather  # the root (embedding and head) and a decoder block
    assert fz.estimate((2783e6, 65e6), spec=spec).gather == 2 * 65e6 * 2
    assert fz.estimate((2783e6, 65e6), spec=spec.replace(prefetch=0, live_buckets=2)).gather == 65e6 * 2


def test_plan_ladder_and_deepspeed_json(tmp_path, capsys):
    model = _meta(GPTConfig(**MID))
    base = fz.Spec(loss_fn=lm_loss)
    roomy = fz.plan(model, spec=base, world_size=2, host_budget=2**40, disk_budget=2**40,
                    micro_batch=2, seq_len=129, nvme_path=str(tmp_path))
    assert roomy.stage == 0 and not roomy.activation_checkpointing and roomy.offload is None
    found, _ = candidates(model, base=base, world_size=2, micro_batch=2, seq_len=129, nvme_path=str(tmp_path),
                          stop_at_first=False, disk_budget=2**40)
    needs = [c.estimate.ranks_per_node * (c.estimate.per_device + c.estimate.per_rank_host) for c in found]
    chosen, budgets = [], sorted(set(needs), reverse=True)
    for need in budgets:  # a memory (device = host: no device budget) that just fits each distinct need
        spec = fz.plan(model, spec=base, world_size=2, host_budget=need / 0.8,
                       disk_budget=2**40, micro_batch=2, seq_len=129, nvme_path=str(tmp_path), report=print)
        chosen.append([c.spec for c in found].index(spec))
    assert chosen == sorted(chosen) and len(set(chosen)) >= 4  # ever more frugal as the budget shrinks
    assert all(needs[i] <= b for i, b in zip(chosen, budgets))  # and each one fits its budget
    out = capsys.readouterr().out
    assert "rejected: needs" in out and "spec = fz.Spec(stage=" in out and '"zero_optimization"' in out
    with pytest.raises(fz.ConfigError, match="no configuration fits"):
        fz.plan(model, spec=base, world_size=2, host_budget=1e6, disk_budget=1e6,
                nvme_path=str(tmp_path))
    for c in found:  # the DeepSpeed JSON reads back into the same Spec
        back = fz.Spec.from_deepspeed(to_deepspeed(c.spec, 2), world_size=2)
        for f in ("stage", "precision", "activation_checkpointing", "offload", "bucket_mb", "live_buckets", "prefetch"):
            assert getattr(back, f) == getattr(c.spec, f), (c.name, f)


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_the_chosen_plan_runs_within_its_budget(tmp_path, monkeypatch):
    """A budget too small for stage 0 (world 2) and one only the NVMe rung fits (world 1): the
    plan chosen in each fresh process trains, and its ranks' measured peaks stay within the budget."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # RSS follows the live bytes (see the peak test)
    model = _meta(GPTConfig(**MID))
    for world, rung, want in (
        (2, "ZeRO-2", (2, None)),
        (1, "ZeRO-3 + optimizer and parameter offload (NVMe)", (3, "disk")),
    ):
        found, _ = candidates(model, base=fz.Spec(loss_fn=lm_loss, clip_grad_norm=1.0), world_size=world,
                              micro_batch=2, seq_len=MID["seq"] + 1, nvme_path=str(tmp_path), stop_at_first=False,
                              disk_budget=2**40)
        c = next(c for c in found if c.name == rung)
        budget = c.estimate.ranks_per_node * (c.estimate.per_device + c.estimate.per_rank_host) / 0.8 * 1.01
        runs = run_ranks(world, measure_plan, dict(gpt=MID, micro=2, budget=budget, path=str(tmp_path)), timeout=240)
        assert (runs[0]["stage"], runs[0]["offload"] and runs[0]["offload"][1]) == want, runs[0]
        assert sum(r["peak"] for r in runs) <= budget, (rung, budget, runs)


def test_plan_picks_stage0_for_example_and_nvme_for_headline(capsys, monkeypatch):
    """This machine's budgets (RAM, free disk of the NVMe path): the example GPT trains at stage 0,
    the offload benchmark's 2.5B-parameter model needs stage 3 with NVMe (estimated on the meta device)."""
    from fz.cli import main
    from fz.planning import machine
    monkeypatch.setattr(machine, "gpu_memory", lambda: None)  # a CPU plan (fp32) on a GPU machine too
    assert main(["plan", "--model", "examples/train_gpt.py:default_model", "--loss-fn", "examples/train_gpt.py:lm_loss",
                 "--micro-batch", "8", "--seq-len", "129", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "chosen:\n  ZeRO-0" in out and "spec = fz.Spec(micro_batch=8, loss_fn=loss_fn)" in out
    assert '"train_micro_batch_size_per_gpu": 8' in out  # the micro-batch planned for is in the Spec and the JSON
    assert main(["plan", "--model", "benchmarks/offload.py:headline_model", "--world-size", "2", "--precision", "bf16",
                 "--host-gb", "23.5", "--disk-gb", "76"]) == 0
    out = capsys.readouterr().out
    assert "chosen:\n  ZeRO-3 + optimizer and parameter offload (NVMe)" in out
    assert "offload=fz.offload.nvme('nvme', params=True)" in out and '"device": "nvme"' in out
    assert out.count("rejected") == 5


def test_cli_estimate_raw_counts(capsys):
    from fz.cli import main

    assert (
        main(["estimate", "--params", "2.8e9", "--largest-layer", "65e6", "--gpus-per-node", "8", "--nodes", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "HW: Setup with 1 node, 8 GPUs per node." in out and "SW: Model with 2800M total params" in out
    assert main(["estimate", "--params", "2.8e9"]) == 2
    assert "--largest-layer" in capsys.readouterr().err
    assert main(["plan"]) == 2  # no arguments: usage and what to give, exit 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fz plan")
    assert "error: give --model module:factory, or --params and --largest-layer" in err


def _printed_blocks(text: str) -> list[tuple[str, float, list[float]]]:
    """(title, total GB, [term GB]) of each block `str(fz.estimate(...))` prints (before the figures
    beside DeepSpeed's, which test_beside_deepspeed.py checks)."""
    import re
    blocks: list = []
    for line in text.split("\n  beside DeepSpeed's")[0].splitlines()[1:]:
        m = re.match(r"^( {2,4})(\S.*?)\s+(-?\d+\.\d\d) GB$", line)
        assert m, line
        if len(m.group(1)) == 2:
            blocks.append((m.group(2), float(m.group(3)), []))
        else:
            blocks[-1][2].append(float(m.group(3)))
    return blocks


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_printed_estimate_total_is_the_sum_of_its_printed_lines(precision, tmp_path):
    """Every stage and offload row, with and without activations and accumulation: each total
    `fz.estimate` prints is the sum of the lines under it (to the printed rounding), and the
    device peak's terms add up to `per_device` exactly."""
    from fz.planning.counts import Counts
    rows = [(0, None), (1, None), (2, None), (3, None), (1, fz.offload.cpu()), (2, fz.offload.cpu()),
            (3, fz.offload.cpu()), (3, fz.offload.cpu(params=True)), (2, fz.offload.nvme(str(tmp_path))),
            (3, fz.offload.nvme(str(tmp_path), params=True))]
    targets = [(Counts(2_783_000_000, 65_000_000), {}), (GPT(GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=2)),
                                                         {"micro_batch": 4, "seq_len": 16})]
    for target, act in targets:
        for stage, off in rows:
            for accum in (1, 4):
                est = fz.estimate(target, spec=fz.Spec(stage=stage, precision=precision, offload=off,
                                                       grad_accum=accum, loss_fn=lm_loss), world_size=8, **act)
                assert sum(v for _, v in est.device_peak()[1]) == est.per_device
                assert sum(v for _, v in est.host_terms()) == est.per_rank_host
                blocks = _printed_blocks(str(est))
                assert any(t.startswith("per device, at its peak") for t, _, _ in blocks)
                for title, total, parts in blocks:
                    if parts:
                        assert abs(total - sum(parts)) <= 0.005 * (len(parts) + 1), (stage, off, title, total, parts)
