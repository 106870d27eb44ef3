"""Hugging Face Trainer: the same script on transformers.Trainer + DeepSpeed and on fz.hf.Trainer,
ZeRO stages 2 and 3, world 2 on CPU (gloo), and on plain transformers.Trainer in one process.

    OMP_NUM_THREADS=1 ../venv-ds/bin/python benchmarks/trainer.py --rounds 2
    OMP_NUM_THREADS=1 ../venv-ds/bin/python benchmarks/trainer.py --engines fz3 --profile   # cProfile, rank 0
    OMP_NUM_THREADS=1 ../venv-ds/bin/python benchmarks/trainer.py --trl --rounds 2          # TRL's SFTTrainer
    OMP_NUM_THREADS=1 ../venv-ds/bin/python benchmarks/trainer.py --grpo --rounds 2         # TRL's GRPOTrainer

(`../venv-ds`: a venv beside the checkout with torch, DeepSpeed and fz's `hf` extra; see
RESULTS.md.) The worker is one Trainer script; the only difference between the engines is the
import line (`from transformers import Trainer, TrainingArguments` for `ds*` and `hf`, `from
fz.hf import ...` for `fz*`); `ds*` and `fz*` get `TrainingArguments(deepspeed=cfg)` with the
same DeepSpeed config ("auto" values, an AdamW optimizer section, the stage). `hf` is plain
transformers.Trainer (its AdamW) in one process with 2 threads and twice the per-device batch:
the same global batch on the same 2 cores. The model is a GPT-2 built from a config (byte
vocabulary, dropout 0, seed 0), trained on windows of a few standard-library modules' source
read in order (`train_sampling_strategy="sequential"`), fp32. The windows have seeded random
lengths from seq/4 to seq (`--fixed`: all seq), and each micro-batch is padded to its own
longest row (labels -100 on the padding), as a padding collator does.

Each engine run is a fresh world-2 group (benchmarks/_harness.launch, the equivalent of
`torchrun --standalone --nproc-per-node 2`); with `--rounds R` every round runs all engines,
in reverse order on even rounds. A TrainerCallback stamps on_step_begin / on_step_end on every
rank: "step ms" is begin -> end (the training step itself), "samples/s" is the global batch over
the interval between consecutive on_step_end (the whole loop: data, step, logging), both the
median over steps [warmup, steps) on rank 0. "first step s" is from the process's start
(/proc/self/stat) to the first on_step_end, max over ranks. Peak RSS is VmHWM per rank.
DeepSpeed needs DS_ACCELERATOR=cpu (set here); its CPU ops JIT-build on first use (~70 s once),
so run one warm-up invocation first (e.g. `--engines ds2,ds3 --steps 2`).
"""
from __future__ import annotations

import os


def _process_start() -> float:
    """time.time() at which this process started (its /proc/self/stat start time, 10 ms ticks)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        import time
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import time
        return time.time()


T_START = _process_start()

import argparse  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import finish, git_state, launch, load_average, markdown, median, report, rss_mb  # noqa: E402

ENGINES = ["hf", "ds2", "fz2", "ds3", "fz3"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--fixed", action="store_true", help="every window seq tokens long (no padding)")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer (fz: fz.hf.on_fz(trl.SFTTrainer)) on the "
                   "windows as text, its own collator and loss")
    p.add_argument("--grpo", action="store_true", help="TRL's GRPOTrainer (fz: fz.hf.on_fz(trl.GRPOTrainer)): "
                   "prompts of seq/4 bytes, 4 completions each of up to seq/4 bytes, a length reward; a sample is a "
                   "completion")
    p.add_argument("--profile", action="store_true", help="cProfile rank 0's trainer.train(); print the top costs")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW",
                          "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}


def byte_tokenizer():
    """A byte-level tokenizer whose ids are the bytes (the GPT-2 here has a vocabulary of 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's byte -> character map (ByteLevel's)
    char = dict(zip(printable + others, map(chr, printable + [256 + i for i in range(len(others))])))
    vocab = {ch: b for b, ch in char.items()}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    zero = char[0]  # byte 0 (absent from source text) as padding and end of text
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token=zero, eos_token=zero)


def sft_texts(windows):
    """The windows as a text dataset, one less byte each (SFT adds the end-of-text token)."""
    import datasets
    rows = [bytes(windows[i]["input_ids"][:-1].tolist()).decode("latin-1") for i in range(len(windows))]
    return datasets.Dataset.from_dict({"text": rows})


def worker(args) -> None:
    engine, stage = args.worker[:2], int(args.worker[2:] or 0)
    if engine == "ds":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import argparse as _ap
    import inspect
    import json
    import textwrap

    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    if engine == "fz":
        from fz.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    torch.set_num_threads(2 if engine == "hf" else 1)

    class Windows(torch.utils.data.Dataset):
        """Windows of some standard-library source, `seq` bytes apart, each of a seeded length in
        [seq / 4, seq] (all `seq` with --fixed)."""

        def __init__(self, seq: int):
            text = "".join(inspect.getsource(m) for m in (_ap, json, textwrap, inspect)).encode()
            data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
            self.rows = data[: len(data) // seq * seq].view(-1, seq)
            g = torch.Generator().manual_seed(0)
            self.lengths = [seq] * len(self.rows) if args.fixed else \
                torch.randint(seq // 4, seq + 1, (len(self.rows),), generator=g).tolist()

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.rows[i, :self.lengths[i]]}

    def pad(rows: list) -> dict:
        """Each micro-batch padded to its own longest row (input 0, label -100, attention mask 0)."""
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])] = r["input_ids"]
            mask[i, :len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    stamps: dict = {"begin": [], "end": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            stamps["begin"].append(time.time())

        def on_step_end(self, *a, **k):
            stamps["end"].append(time.time())

    out_dir = tempfile.mkdtemp(prefix=f"fzbench-trainer-{args.worker}-")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra: dict = {}
    if args.trl:  # TRL's SFT on the same windows, as text: its config class, collator and loss
        import trl
        if engine == "fz":
            import fz.hf
            Trainer, TrainingArguments = fz.hf.on_fz(trl.SFTTrainer), fz.hf.on_fz(trl.SFTConfig)
        else:
            Trainer, TrainingArguments = trl.SFTTrainer, trl.SFTConfig
        extra = {"max_length": args.seq, "packing": False, "gradient_checkpointing": False}
    if args.grpo:  # TRL's GRPO on prompts cut from the windows: generation, scoring and the policy loss
        import trl
        if engine == "fz":
            import fz.hf
            Trainer, TrainingArguments = fz.hf.on_fz(trl.GRPOTrainer), fz.hf.on_fz(trl.GRPOConfig)
        else:
            Trainer, TrainingArguments = trl.GRPOTrainer, trl.GRPOConfig
        extra = {"num_generations": 4, "max_completion_length": args.seq // 4, "gradient_checkpointing": False,
                 "beta": 0.0}
    targs = TrainingArguments(output_dir=out_dir, deepspeed=ds_config(stage) if engine != "hf" else None,
                              per_device_train_batch_size=args.batch * 2 // world,
                              max_steps=args.steps, logging_steps=1, learning_rate=args.lr, warmup_steps=2,
                              weight_decay=0.01, max_grad_norm=1.0, seed=0, use_cpu=True, bf16=False, report_to=[],
                              save_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential", **extra)
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=args.width // 64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(targs.seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    if args.trl:
        trainer = Trainer(model=model, args=targs, train_dataset=sft_texts(Windows(args.seq)),
                          processing_class=byte_tokenizer(), callbacks=[Clock()])
    elif args.grpo:
        import datasets
        texts = sft_texts(Windows(args.seq))["text"]
        prompts = datasets.Dataset.from_dict({"prompt": [t[:args.seq // 4] for t in texts]})
        trainer = Trainer(model=model, args=targs, train_dataset=prompts, processing_class=byte_tokenizer(),
                          reward_funcs=lambda completions, **kw: [len(c.split()) / 8 for c in completions],
                          callbacks=[Clock()])
    else:
        trainer = Trainer(model=model, args=targs, train_dataset=Windows(args.seq), data_collator=pad,
                          callbacks=[Clock()])
    rank = targs.process_index
    prof = None
    if args.profile and rank == 0:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    trainer.train()
    if prof is not None:
        prof.disable()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    try:  # what really ran: the engine's ZeRO stage and optimizer
        if engine == "ds":
            ran = (f"ZeRO {trainer.model_wrapped.zero_optimization_stage()}, "
                   f"{type(trainer.model_wrapped.basic_optimizer).__name__}")
        elif engine == "hf":
            ran = f"one process, {torch.get_num_threads()} threads, {type(trainer.optimizer).__name__}"
        else:
            ran = f"ZeRO {trainer.fz_state.spec.stage}, {type(trainer.fz_state.spec.optimizer).__name__}"
    except Exception as e:  # noqa: BLE001 - a label only
        ran = f"? ({e})"
    mine = {"rss_mb": rss_mb("VmHWM"), "first_step_s": stamps["end"][0] - T_START if stamps["end"] else None}
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    if rank == 0:
        out = {"begin": stamps["begin"], "end": stamps["end"], "loss": losses, "params": params,
               "world": len(every), "ran": ran, "rss_mb": [m["rss_mb"] for m in every],
               "first_step_s": max(m["first_step_s"] for m in every if m["first_step_s"] is not None)}
        if prof is not None:
            import io
            import pstats
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("cumulative").print_stats(45)
            stats.sort_stats("tottime").print_stats(30)
            out["profile"] = buf.getvalue()
        report(out)
    finish(dist)


def summary(r: dict, warmup: int, batch: int) -> dict:
    steps = [e - b for b, e in zip(r["begin"], r["end"])][warmup:]
    gaps = [b - a for a, b in zip(r["end"], r["end"][1:])][max(0, warmup - 1):]
    per_step = batch * 2  # the global batch: batch per rank x 2 ranks, or 2 x batch in one process
    return {"step": median(steps), "sps": per_step / median(gaps), "rss": max(r["rss_mb"]),
            "first": r["first_step_s"], "loss": r["loss"]}


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    import deepspeed
    import torch
    import transformers

    argv = sys.argv[1:]
    print("$ " + shlex.join(["OMP_NUM_THREADS=1", sys.executable, *sys.argv]), flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {load_average()}, {git_state()}", flush=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}",
          flush=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    runs: dict = {e: [] for e in engines}
    for rnd in range(args.rounds):
        order = engines if rnd % 2 == 0 else engines[::-1]
        for e in order:
            t0 = time.monotonic()
            res = launch([sys.executable, os.path.abspath(__file__), *argv, "--worker", e], 1 if e == "hf" else 2,
                         args.timeout, {"DS_ACCELERATOR": "cpu"} if e.startswith("ds") else None)
            runs[e].append(res)
            if "error" in res:
                status = res["error"]
            else:
                s = summary(res, args.warmup, args.batch)
                status = (f"step {1e3 * s['step']:.0f} ms, {s['sps']:.2f} samples/s, RSS {s['rss']:.0f} MB, "
                          f"first step {s['first']:.1f} s; {res.get('ran')}")
            print(f"  round {rnd + 1} {e:<4} {status} ({time.monotonic() - t0:.0f}s, load {load_average()})",
                  flush=True)
            for line in res.get("tail", []) if "error" in res else []:
                print(f"      | {line}", flush=True)
            if "profile" in res:
                print(res["profile"], flush=True)
    ok = {e: [summary(r, args.warmup, args.batch) for r in rs if "error" not in r] for e, rs in runs.items()}
    meta = next((r for rs in runs.values() for r in rs if "params" in r), {})
    print(f"\nGPT-2 {meta.get('params', 0) / 1e6:.1f}M params ({args.layers} layers x {args.width}, vocab 256), fp32, "
          f"world 2, {args.batch} x seq {args.seq} per rank, {args.steps} steps, median of steps "
          f"{args.warmup}-{args.steps - 1}, {args.rounds} round(s); load average at end {load_average()}\n")

    def per_round(e, k):
        return [s[k] for s in ok.get(e, [])]

    def ratio(e: str, ref: str, k: str) -> str:
        if not e.startswith("fz") or not ok.get(ref):
            return "-"
        return f"{median([a / b for a, b in zip(per_round(e, k), per_round(ref, k))]):.2f}x"

    rows = []
    stages = sorted({int(e[2]) for e in engines if e != "hf"})
    for e in (["hf"] if "hf" in runs else []) + [f"{k}{st}" for st in stages for k in ("ds", "fz")]:
        if e not in runs:
            continue
        if not ok[e]:
            rows.append([e, f"FAILED: {runs[e][-1]['error']}"] + [""] * 7)
            continue
        ds = f"ds{e[2:]}"
        rows.append([e, " / ".join(f"{1e3 * x:.0f}" for x in per_round(e, "step")),
                     " / ".join(f"{x:.2f}" for x in per_round(e, "sps")), ratio(e, ds, "sps"), ratio(e, "hf", "sps"),
                     f"{median(per_round(e, 'rss')):.0f}", ratio(e, ds, "rss"),
                     " / ".join(f"{x:.1f}" for x in per_round(e, "first")), ratio(e, ds, "first")])
    print(markdown(["engine", "step ms (per round)", "samples/s (per round)", "samples/s fz/DS", "samples/s fz/hf",
                    "peak RSS MB/rank (max rank, median)", "RSS fz/DS", "start to first step s", "first step fz/DS"],
                   rows))
    print()
    for stage in stages:
        a, b = ok.get(f"ds{stage}"), ok.get(f"fz{stage}")
        if a and b:
            la, lb = a[0]["loss"], b[0]["loss"]
            diff = [abs(x - y) for x, y in zip(la, lb)]
            rel = max((d / abs(x) for d, x in zip(diff, la) if x), default=0.0)  # GRPO's loss may be 0
            print(f"stage {stage} losses (round 1), max |fz - ds| {max(diff):.2e} (relative {rel:.1e}):")
            print("  ds: " + " ".join(f"{x:.4f}" for x in la))
            print("  fz: " + " ".join(f"{x:.4f}" for x in lb))
            same = all(r["loss"] == la for r in a) and all(r["loss"] == lb for r in b)
            print(f"  each engine's losses identical across rounds: {same}")


if __name__ == "__main__":
    main()
