"""Planning a GPU job from a machine without one: a device budget is planned for as a device,
checked apart from the host budget, on any machine; only with no device budget and no GPU is
the device the host. The model is OpenLLaMA-3B's shape on the meta device (nothing allocated)."""
from __future__ import annotations

import re

import pytest

import fz
from fz.planning import machine
from fz.planning.ladder import candidates
from fz.planning.render import plan_report, spec_python

from support.real_nets import llama_3b

pytest.importorskip("transformers")

GB = 2**30
DEVICE, HOST, MARGIN = 24 * GB, 64 * GB, 0.2
OFFLOAD_RUNG = "ZeRO-3 + optimizer and parameter offload (host)"


@pytest.fixture(scope="module")
def llama():
    model = llama_3b()
    assert 3.4e9 < sum(p.numel() for p in model.parameters()) < 3.45e9
    return model


def test_cli_plans_for_the_device_given_on_a_cpu_machine(llama, capsys, tmp_path):
    """`fz plan --device-gb 24 --host-gb 64`: separate budgets, each rejection names its budget, and
    the chosen plan's device bytes are fz.estimate's per_device for that Spec, within 24 GB."""
    from fz.cli import main
    assert main(["plan", "--model", "tests/support/real_nets.py:llama_3b", "--device-gb", "24", "--host-gb", "64",
                 "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "budget 24.00 GB per device, 64.00 GB per host" in out and "device = host" not in out
    zero0 = next(ln for ln in out.splitlines() if ln.startswith("  ZeRO-0"))
    assert "GB of device > 19.20 GB (24.00 GB less the 20% margin)" in zero0 and "of host" not in zero0

    world = machine.local_devices()  # the CLI's default: 1 on a machine without a GPU
    spec = fz.plan(llama, world_size=world, device_budget=DEVICE, host_budget=HOST, nvme_path=str(tmp_path))
    est = fz.estimate(llama, spec=spec, world_size=world)
    assert est.per_device <= DEVICE * (1 - MARGIN) and est.per_host <= HOST * (1 - MARGIN)
    assert f"spec = {spec_python(spec)}\n" in out  # the CLI chose the same Spec
    uses = re.search(r"uses device ([\d.]+) GB of 24.00 GB, host ([\d.]+) GB of 64.00 GB", out)
    assert uses and float(uses.group(1)) == round(est.per_device / GB, 2)
    assert float(uses.group(2)) == round(est.per_host / GB, 2)


def test_each_rung_is_rejected_by_the_budget_it_exceeds(llama, tmp_path):
    """One rung fits the host but not the device, another the device but not the host: each is
    rejected for that budget alone (the sum of both would reject the second for memory)."""
    found, budgets = candidates(llama, world_size=1, device_budget=DEVICE, host_budget=HOST, disk_budget=2**50,
                                nvme_path=str(tmp_path), stop_at_first=False)
    assert not budgets.device_is_host and budgets.device == DEVICE and budgets.host == HOST
    for c in found:  # at 24 / 64 GB: every verdict follows the two budgets, apart
        over_device = c.estimate.per_device > DEVICE * (1 - MARGIN)
        over_host = c.estimate.per_host > HOST * (1 - MARGIN)
        assert any("of device >" in p for p in c.problems) == over_device, c
        assert any("of host" in p for p in c.problems) == over_host, c
        assert not any("of memory" in p for p in c.problems)
    assert any(c.problems and all("of device >" in p for p in c.problems) for c in found)

    by_name = {c.name: c.estimate for c in found}
    for rung, tight, roomy in ((OFFLOAD_RUNG, "host", "device"), ("ZeRO-0 (data parallel)", "device", "host")):
        e = by_name[rung]
        need = {"device": e.per_device, "host": e.per_host}
        budget = {tight: need[tight] / (1 - MARGIN) * 0.99, roomy: need[roomy] / (1 - MARGIN) * 1.01 + GB}
        one, _ = candidates(llama, world_size=1, device_budget=budget["device"], host_budget=budget["host"],
                            disk_budget=2**50, nvme_path=str(tmp_path), stop_at_first=False)
        problems = next(c.problems for c in one if c.name == rung)
        assert len(problems) == 1 and f"GB of {tight} " in problems[0], (rung, problems)


def test_the_device_is_the_host_only_without_a_device_budget_or_gpu(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "gpu_memory", lambda: None)
    found, budgets = candidates(llama, world_size=1, host_budget=GB, disk_budget=2**50, nvme_path=str(tmp_path),
                                stop_at_first=False)
    text = plan_report(found, budgets)
    assert "budget 1.00 GB memory (device = host: no device budget given and no GPU here)" in text
    assert all(c.problems and "GB of memory (1 rank(s) x (device" in c.problems[0] for c in found)
    assert "of device" not in text and "of host" not in text
    assert machine.plan_budgets(str(tmp_path), device=DEVICE).device == DEVICE  # a budget: a device

    monkeypatch.setattr(machine, "gpu_memory", lambda: 16 * GB)  # a 16 GB GPU here
    here = machine.plan_budgets(str(tmp_path), host=HOST)
    assert here.device == 16 * GB and not here.device_is_host
    given = machine.plan_budgets(str(tmp_path), device=DEVICE, host=1 * GB)
    assert given.device == DEVICE  # the budget given wins over the smaller GPU here, and says so
    assert [n for n in given.notes if n.startswith("device budget 24.00 GB given, this machine has 16.00 GB (GPU)")]
    assert not [n for n in given.notes if n.startswith("host")]  # a smaller host budget is simply honoured


def test_budget_notes_reach_the_log_without_a_report(llama, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setattr(machine, "gpu_memory", lambda: 16 * GB)
    fz_log = fz.log.logger()  # "fz": its own console handler, not propagated to the root (fz/log.py)
    fz_log.addHandler(caplog.handler)  # routed like any logger
    try:
        fz.plan(llama, world_size=1, device_budget=DEVICE, host_budget=HOST, nvme_path=str(tmp_path))
    finally:
        fz_log.removeHandler(caplog.handler)
    assert "device budget 24.00 GB given, this machine has 16.00 GB (GPU): the given one wins" in caplog.text
    assert "the given one wins" in capsys.readouterr().err  # and shown by default, as a warning on stderr


def test_offload_rung_keeps_the_device_under_2_gb(llama, tmp_path):
    """With parameters and optimizer on the host, the device holds gathers and reductions (no batch
    traced here, so no activations): well under 2 GB for 3.4B parameters, not 4 bytes each of gradients."""
    found, _ = candidates(llama, world_size=1, device_budget=DEVICE, host_budget=HOST, disk_budget=2**50,
                          nvme_path=str(tmp_path), stop_at_first=False)
    e = next(c.estimate for c in found if c.name == OFFLOAD_RUNG)
    assert e.activations is None and e.per_device < 2 * GB, e.per_device / GB


def test_the_disk_tier_needs_its_own_size_free_not_twice(llama, tmp_path):
    """A step updates the disk tier in place (fz/step/stream.py), so the NVMe rung fits a disk with
    its bytes free plus a little, where it once asked for twice them."""
    from fz.planning.ladder import check
    found, budgets = candidates(llama, world_size=1, device_budget=DEVICE, host_budget=HOST, disk_budget=2**50,
                                nvme_path=str(tmp_path), stop_at_first=False)
    nvme = next(c for c in found if "NVMe" in c.name or "nvme" in c.name)
    disk = nvme.estimate.per_disk
    assert disk > 20 * GB  # 3.4B parameters' optimizer state and parameters
    roomy = type(budgets)(budgets.device, budgets.host, int(1.05 * disk))
    assert not [p for p in check(nvme.estimate, roomy, MARGIN) if "disk tier" in p]
    short = type(budgets)(budgets.device, budgets.host, int(0.95 * disk))
    (why,) = [p for p in check(nvme.estimate, short, MARGIN) if "disk tier" in p]
    assert why == f"the disk tier holds {disk / GB:.2f} GB per node, {0.95 * disk / GB:.2f} GB are free"
