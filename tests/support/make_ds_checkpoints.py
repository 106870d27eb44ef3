"""Regenerate tests/data/deepspeed/: real DeepSpeed checkpoints of tests/support/ds_models.TinyLM.

Run with a python that has DeepSpeed (CPU is enough):

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/venv-ds/bin/python tests/support/make_ds_checkpoints.py [NAME ...]

For each fixture (ds_models.FIXTURES, and GROUPED: two parameter groups) two ranks (gloo) train 3
steps, `save_checkpoint` with a client state, then train two more steps. Written to tests/data/deepspeed/<name>/:
  ckpt/             the save_dir as DeepSpeed wrote it (its copies of zero_to_fp32.py and
                    zero_to_torch.py removed)
  zero_to_fp32.safetensors   DeepSpeed's get_fp32_state_dict_from_zero_checkpoint (where it runs)
  engine.safetensors         the live engine's full fp32 masters and Adam moments at the save
                             (safe_get_full_fp32_param / safe_get_full_optimizer_state)
  record.json       losses per step and rank, the next two steps' losses per rank (the
                    second follows an update that used the saved moments), config, world
Universal checkpoints (ds_to_universal) are made from stage2_fp32 and stage3_fp32 into <name>/universal/.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "deepspeed"
STEPS, TIMEOUT = 3, 600
CLIENT_STATE = {"step": 3, "note": "x"}


def _rank(name: str, rank: int, out: Path) -> None:
    """One rank of one fixture's run (in its own process)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from tests.support import ds_models as m

    torch.manual_seed(0)
    torch.set_num_threads(1)
    stage, precision = (m.FIXTURES | m.GROUPED)[name]
    deepspeed.init_distributed(dist_backend="gloo")
    model = m.TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=m.param_groups(model, name in m.GROUPED),
                                      config=m.ds_config(stage, precision))
    losses = []

    def step(i: int) -> float:
        loss = m.lm_loss(engine(m.batch(i, rank)), m.batch(i, rank))
        engine.backward(loss)
        engine.step()
        return float(loss)

    for i in range(STEPS):
        losses.append(step(i))
    engine.save_checkpoint(str(out / "ckpt"), client_state=dict(CLIENT_STATE))
    ref = _stage0_reference(engine) if stage == 0 else {}
    if getattr(engine.optimizer, "_hp_optimizer_states_linked", False):
        # ZeRO 1/2 link each parameter to its moments once, after the first group's first update: a later
        # group has no moments yet then, and safe_get_full_optimizer_state finds none; link them again
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for pname, p in engine.module.named_parameters() if stage else ():
        full = safe_get_full_fp32_param(p)
        if full is not None:
            ref[f"fp32/{pname}"] = full.detach().float().clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            s = safe_get_full_optimizer_state(p, moment) if p.requires_grad else None
            if s is not None:
                ref[f"{moment}/{pname}"] = s.detach().float().clone()
    nxt = [step(STEPS), step(STEPS + 1)]  # the second one's loss follows an update that used the moments
    if rank == 0:
        from safetensors.torch import save_file
        save_file(ref, str(out / "engine.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "next_loss": nxt[0], "next_losses": nxt}))


def _stage0_reference(engine) -> dict:
    """Without ZeRO, safe_get_full_* return None: the masters are the optimizer's fp32 copies
    (`fp32_groups` of DeepSpeed's fp16/bf16 wrapper) or the fp32 params themselves."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    masters = [t for g in getattr(opt, "fp32_groups", []) for t in g]
    ref = {}
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    for i, (pname, p) in enumerate(trainable):
        master = masters[i] if masters else p
        ref[f"fp32/{pname}"] = master.detach().float().clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            ref[f"{moment}/{pname}"] = inner.state[master][moment].detach().float().clone()
    return ref


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(name: str, out_root: Path = OUT, world: int = 2) -> Path:
    """Write fixture `name` into out_root/name (replacing it); returns that folder."""
    from tests.support import ds_models as m

    out = out_root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", name, str(r), str(out)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_SIZE=str(world)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: a rank failed:\n" + "\n".join(log[-4000:] for log in logs))
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its own scripts
        (out / "ckpt" / script).unlink(missing_ok=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r in range(world):
        (out / f"rank{r}.json").unlink()
    stage, precision = (m.FIXTURES | m.GROUPED)[name]
    import deepspeed
    record = {"name": name, "stage": stage, "precision": precision, "world": world, "steps": STEPS,
              "losses": [r["losses"] for r in ranks], "next_loss": [r["next_loss"] for r in ranks],
              "next_losses": [r["next_losses"] for r in ranks],
              "client_state": CLIENT_STATE, "config": m.ds_config(stage, precision, world),
              "grouped": name in m.GROUPED,
              "deepspeed": deepspeed.__version__, "zero_to_fp32": _zero_to_fp32(out)}
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def _zero_to_fp32(out: Path) -> str:
    """DeepSpeed's own consolidation into zero_to_fp32.safetensors; 'ok' or why it could not run."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(str(out / "ckpt"))
    except Exception as e:  # noqa: BLE001 - recorded: zero_to_fp32 does not read every layout
        return f"{type(e).__name__}: {e}"
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(out / "zero_to_fp32.safetensors"))
    return "ok"


def universal(name: str = "stage2_fp32", out_root: Path = OUT) -> Path:
    """ds_to_universal on fixture `name`'s checkpoint, into out_root/name/universal."""
    src = out_root / name / "ckpt"
    tag = (src / "latest").read_text().strip()
    dst = out_root / name / "universal"
    shutil.rmtree(dst, ignore_errors=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(src / tag), "--output_folder", str(dst / tag), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], env=env, check=True, timeout=TIMEOUT,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (dst / "latest").write_text(tag)
    return dst


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        _rank(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
        sys.stdout.flush()
        os._exit(0)  # its files are written; DeepSpeed's bf16 stage-1 threads can abort the interpreter's teardown
    sys.path.insert(0, str(ROOT))
    from tests.support.ds_models import FIXTURES, GROUPED
    names = sys.argv[1:] or list(FIXTURES | GROUPED)
    for n in names:
        print(n, make(n), flush=True)
    for n in ("stage2_fp32", "stage3_fp32"):
        if not sys.argv[1:] or n in names:
            print("universal", universal(n), flush=True)
