"""fz.estimate beside DeepSpeed's estimator (fz/planning/beside.py): for a 7B Llama on 8 GPUs and
T0_3B on one, every term of fz's per-GPU and per-CPU figure is one of DeepSpeed's terms, equal to
it where both count the same thing, or a named extra fz holds beyond it; "largest layer" is
DeepSpeed's. DeepSpeed's formulas are quoted below (CI has no DeepSpeed); with FZ_DEEPSPEED_PYTHON
set, the live functions are checked against the quotes."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

import fz
from fz.planning.beside import deepspeed_figures

pytest.importorskip("transformers")

from support.real_nets import llama_7b, t0_3b  # noqa: E402

FACTOR = 1.5  # additional_buffer_factor's default in both functions


def ds_zero3(total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload, cpu_offload_params):
    """deepspeed/runtime/zero/stage3.py, estimate_zero3_model_states_mem_needs (DeepSpeed 0.19.8), zero_init=True,
    quoted: (cpu_mem, gpu_mem)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = (4 * largest_layer_params)
    if cpu_offload and cpu_offload_params:
        gpu_mem = largest_layer_memory
        cpu_mem = total_params * 18 * gpus_factor * FACTOR
    elif cpu_offload:
        gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        cpu_mem = total_params * 16 * gpus_factor * FACTOR
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = largest_layer_params * 4 * num_gpus_per_node * FACTOR
    return int(cpu_mem), int(gpu_mem)


def ds_zero2(total_params, num_gpus_per_node, num_nodes, cpu_offload):
    """deepspeed/runtime/zero/stage_1_and_2.py, estimate_zero2_model_states_mem_needs, quoted: (cpu_mem, gpu_mem)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * FACTOR
    else:
        # GPU's total_params multipliers: 2 = params_16bit,
        # 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit(momentum and variance)
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * FACTOR
    return int(cpu_mem), int(gpu_mem)


def ds_largest_layer(model):
    """deepspeed/runtime/zero/stage3.py, model_to_params: the largest layer is the most parameters one module holds
    itself (`layer_params = sum(p.numel() for p in m.parameters(recurse=False))` over `model.modules()`)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


# DeepSpeed's terms fz does not hold by design (fz 0): its 1.5 margin, the fp32 model or largest layer it has each
# GPU process build on the CPU, and its ZeRO-2 floor of 4 host bytes a parameter per GPU
DEEPSPEED_ONLY = {"DeepSpeed's buffer factor (1.5x the above)", "max(4·GPUs, 16)·Ψ: 4 bytes a parameter per GPU",
                  "largest layer in fp32 per GPU process (4·L·GPUs per node)",
                  "fp32 model per GPU process (4·Ψ·GPUs per node)"}
ROWS = [(3, fz.offload.cpu(params=True)), (3, fz.offload.cpu()), (3, None), (2, fz.offload.cpu()), (2, None)]
# (model, GPUs, Ψ, DeepSpeed's largest layer, fz's largest unit)
CASES = {"llama_7b": (llama_7b, 8, 6_738_415_616, 131_072_000, 262_148_096),
         "t0_3b": (t0_3b, 1, 2_849_757_184, 65_798_144, 131_600_384)}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make, gpus, psi, layer, unit = CASES[request.param]
    model = make()
    return request.param, model, gpus, psi, layer, unit


def test_largest_layer_is_deepspeeds(case):
    name, model, gpus, psi, layer, unit = case
    assert ds_largest_layer(model) == layer
    est = fz.estimate(model, spec=fz.Spec(stage=3, precision="bf16"), world_size=gpus)
    assert (est.num_params, est.largest_layer, est.largest_unit) == (psi, layer, unit)
    sw = fz.estimate_table(model, gpus_per_node=gpus, stages=(3,)).splitlines()[2]
    assert sw.startswith(f"SW: Model with {int(psi / 1e6)}M total params, {int(layer / 1e6)}M largest layer params "
                         f"({int(unit / 1e6)}M in fz's largest unit)"), sw


@pytest.mark.parametrize("stage,offload", ROWS)
def test_every_term_is_deepspeeds_or_a_named_extra(case, stage, offload):
    name, model, gpus, psi, layer, _ = case
    est = fz.estimate(model, spec=fz.Spec(stage=stage, precision="bf16", offload=offload), world_size=gpus)
    side = est.beside_deepspeed()
    assert side is not None
    # fz's columns are fz's figures; DeepSpeed's are its functions' (quoted above)
    assert (side.fz_gpu, side.fz_cpu) == (est.per_device, est.per_host)
    want = ds_zero3(psi, layer, gpus, 1, offload is not None, offload is not None and offload.params == "host") \
        if stage == 3 else ds_zero2(psi, gpus, 1, offload is not None)
    assert (side.deepspeed_cpu, side.deepspeed_gpu) == want
    for terms, total in ((side.gpu, want[1]), (side.cpu, want[0])):
        assert abs(sum(t.deepspeed or 0 for t in terms) - total) <= 4  # its terms add up to it (int() rounding)
        for t in terms:
            if t.deepspeed is None:  # an extra: named, and held
                assert t.name and t.fz > 0, t
            elif t.name in DEEPSPEED_ONLY or t.name.startswith("16-bit gradients") and gpus > 1:
                assert t.fz == 0, t  # fz reduces straight into fp32 over several GPUs: no 16-bit copy
            else:
                assert t.fz == t.deepspeed, t  # the same thing: the same bytes
    gathered = [t for t in side.gpu if t.name == "largest layer's parameters, gathered (2·L)"]
    assert [t.deepspeed for t in gathered] == ([2 * layer] if stage == 3 else [])


def test_the_extras_of_the_two_cases():
    """What fz holds beyond DeepSpeed's 4·L with parameters and optimizer on the CPU: for the 7B Llama on
    8 GPUs a whole decoder block (202.4M) gathered, not one module (its embedding, 131.1M), the next block
    prefetched, and the fp32 reduce-scatter buffers; for T0_3B on one GPU the gradient of the
    embedding encoder and decoder share, summed until its last use, and the next unit's upload in
    flight (one GPU prefetches the uploads of offloaded parameters: the window beside the embedding
    holds another 65.8M-parameter unit, its head)."""
    spec = fz.Spec(stage=3, precision="bf16", offload=fz.offload.cpu(params=True))
    block, layer = 202_383_360, 131_072_000
    side = fz.estimate(llama_7b(), spec=spec, world_size=8).beside_deepspeed()
    extras = {t.name: t.fz for t in side.gpu if t.deepspeed is None}
    assert extras.pop("rest of the running unit (largest, 202.4M)") == 2 * (block - layer)
    assert extras.pop("prefetched units") == 2 * block
    assert extras.pop("reduction buffers beyond it (fp32, <= 2 buckets)") > 0
    assert set(extras) <= {"the model's buffers"}  # Llama's rotary table: 256 bytes
    side = fz.estimate(t0_3b(), spec=spec, world_size=1).beside_deepspeed()
    assert {t.name: t.fz for t in side.gpu if t.deepspeed is None} == {
        "summed gradient of a weight several units share": 2 * 65_798_144, "prefetched units": 2 * 65_798_144}


def test_raw_counts_on_one_gpu_are_deepspeeds_figure():
    """Given DeepSpeed's own inputs (each layer one unit, nothing shared), fz's per-GPU figure with
    parameters and optimizer on the CPU is DeepSpeed's 4·L (one layer gathered, one gradient copied)
    and the next layer's upload in flight, 2·L; without prefetch exactly DeepSpeed's."""
    for psi, layer in ((2_783_000_000, 65_000_000), (2_849_757_184, 65_798_144)):
        spec = fz.Spec(stage=3, precision="bf16", offload=fz.offload.cpu(params=True))
        est = fz.estimate((psi, layer), spec=spec)
        assert est.per_device == ds_zero3(psi, layer, 1, 1, True, True)[1] + 2 * layer == 6 * layer
        assert fz.estimate((psi, layer), spec=spec.replace(prefetch=0, live_buckets=2)).per_device == 4 * layer
        assert est.per_host == 18 * psi  # DeepSpeed's 18·Ψ before its 1.5 factor


def test_no_row_where_deepspeed_has_none(tmp_path):
    model = (2_783_000_000, 65_000_000)
    for spec in (fz.Spec(stage=1, precision="bf16"), fz.Spec(stage=3, precision="fp32"),
                 fz.Spec(stage=3, precision="bf16", offload=fz.offload.nvme(str(tmp_path), params=True))):
        assert fz.estimate(model, spec=spec).beside_deepspeed() is None
        assert "beside DeepSpeed" not in str(fz.estimate(model, spec=spec))


def test_cli_names_the_terms(capsys):
    from fz.cli import main
    assert main(["estimate", "--params", "2783e6", "--largest-layer", "65e6", "--stage", "3",
                 "--offload-optimizer", "cpu", "--offload-param", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "estimate_zero3_model_states_mem_needs(total_params=2783000000, largest_layer_params=65000000" in out
    assert "largest layer's parameters, gathered (2·L)" in out and "DeepSpeed's buffer factor" in out
    assert main(["estimate", "--params", "1e9", "--largest-layer", "1e7", "--stage", "2", "--offload-param",
                 "cpu"]) == 2
    assert "no row offloads param=cpu" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("FZ_DEEPSPEED_PYTHON"),
                    reason="set FZ_DEEPSPEED_PYTHON to a python with DeepSpeed to check the quoted formulas live")
def test_quotes_match_live_deepspeed():
    """DeepSpeed's own functions give the quoted formulas' figures, and fz's transcription's, on a grid
    of counts (zero_init both ways); its model_to_params finds fz's largest layer."""
    grid = [(psi, layer, gpn, nodes) for psi in (2_849_757_184, 6_738_415_616) for layer in (65_798_144, 131_072_000)
            for gpn in (1, 8) for nodes in (1, 2)]
    code = (
        "import json, sys\n"
        "from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3, model_to_params\n"
        "from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2\n"
        "from support.real_nets import llama_7b, t0_3b\n"
        "out = {'z3': [], 'z2': [], 'largest': [model_to_params(m())[1] for m in (llama_7b, t0_3b)]}\n"
        "for psi, layer, gpn, nodes in json.loads(sys.argv[1]):\n"
        "    for off, par in ((True, True), (True, False), (False, False)):\n"
        "        for zi in (True, False):\n"
        "            out['z3'].append(list(z3(psi, layer, gpn, nodes, off, par, zi)[:2]))\n"
        "    for off in (True, False):\n"
        "        out['z2'].append(list(z2(psi, gpn, nodes, off)))\n"
        "print(json.dumps(out))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([os.environ["FZ_DEEPSPEED_PYTHON"], "-c", code, json.dumps(grid)], capture_output=True,
                         text=True, timeout=600, check=True,
                         env=dict(os.environ, PYTHONPATH=f"{root}/tests:{root}", DS_ACCELERATOR="cpu"))
    live = json.loads(run.stdout.strip().splitlines()[-1])
    assert live["largest"] == [CASES["llama_7b"][3], CASES["t0_3b"][3]]
    z3, z2 = iter(live["z3"]), iter(live["z2"])
    for psi, layer, gpn, nodes in grid:
        for off, par in ((True, True), (True, False), (False, False)):
            for zi in (True, False):
                got = next(z3)
                assert tuple(got) == deepspeed_figures(3, psi, layer, gpn, nodes, off, par, zi)
                if zi:
                    assert tuple(got) == ds_zero3(psi, layer, gpn, nodes, off, par)
        for off in (True, False):
            got = next(z2)
            assert tuple(got) == deepspeed_figures(2, psi, layer, gpn, nodes, off) == ds_zero2(psi, gpn, nodes, off)


def test_docs_tables_are_these_figures():
    """docs/planning.md's two side-by-side tables: each row's four figures, as fz and DeepSpeed give them."""
    from pathlib import Path
    page = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    rows = {"ZeRO-3, parameters and optimizer on the CPU": ROWS[0], "ZeRO-3, optimizer on the CPU": ROWS[1],
            "ZeRO-3, nothing offloaded": ROWS[2], "ZeRO-2, optimizer on the CPU": ROWS[3],
            "ZeRO-2, nothing offloaded": ROWS[4]}
    seen = 0
    for key, head in (("llama_7b", "| Llama 7B, 8 GPUs"), ("t0_3b", "| T0_3B, 1 GPU")):
        make, gpus, psi, layer, _ = CASES[key]
        model = make()
        table = page[page.index(head):].split("\n\n")[0].splitlines()[2:]
        assert [line.split(" | ")[0][2:] for line in table] == list(rows)
        for line in table:
            stage, off = rows[line.split(" | ")[0][2:]]
            est = fz.estimate(model, spec=fz.Spec(stage=stage, precision="bf16", offload=off), world_size=gpus)
            cpu, gpu = ds_zero3(psi, layer, gpus, 1, off is not None, off is not None and off.params == "host") \
                if stage == 3 else ds_zero2(psi, gpus, 1, off is not None)
            want = [f"{x / 2**30:.2f}" for x in (est.per_device, gpu, est.per_host, cpu)]
            assert line.strip(" |").split(" | ")[1:] == want, (key, line)
            seen += 1
    assert seen == 10
