"""The `fz` command (also `python -m fz`): offline tools on checkpoints (one process, no torch.distributed).

    fz consolidate CKPT OUT.safetensors [--dtype bf16]   full weights to one file (fz or DeepSpeed CKPT)
    fz consolidate CKPT OUT_DIR --hf                     a folder from_pretrained loads
    fz inspect CKPT                                      step, world, stage, sizes, verification
    fz --version                                         fz's version, and torch's
    fz estimate ... / fz plan ...                        memory estimates and plans (fz/planning/cli.py)
    fz run [--hostfile H] script.py args...              launch on one machine or many (fz/launch/cli.py)
"""
from __future__ import annotations

import argparse
import sys

from fz.errors import ConfigError, NonFiniteError
from fz.version import __version__


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MB"


def _consolidate(args: argparse.Namespace) -> int:
    from fz.ckpt.export import consolidate

    info = consolidate(args.ckpt, args.out, dtype=args.dtype, step=args.step, verify=not args.no_verify,
                       progress=True if args.progress else None, hf=args.hf, max_shard_size=args.max_shard_size)
    print(f"wrote {info.out}: {info.tensors} tensors from {info.checkpoint} ({_mb(info.bytes)} read)")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from fz.ckpt.export import inspect

    info = inspect(args.ckpt, step=args.step, verify=not args.no_verify, progress=True if args.progress else None)
    rows = [
        ("checkpoint", info.path + (" (DeepSpeed's own files)" if info.format == "deepspeed" else "")),
        ("step", info.step),
        ("train step", info.train_step),
        ("world size", info.world),
        ("ZeRO stage", info.stage),
        ("precision", info.precision),
        ("fp32 master", info.master),
        ("fz version", info.fz_version),
        ("torch version", info.torch_version),
        ("tensors", f"{info.tensors} ({_mb(info.bytes)})"),
        ("model tensors", f"{info.model_tensors} ({_mb(info.model_bytes)})"),
    ]
    if info.meta_error is not None:
        rows.append(("metadata", f"UNREADABLE: {info.meta_error}"))
    if info.signed:
        signed = "yes (HMAC-SHA256), " + ("checked below with FZ_CKPT_KEY" if info.key and not args.no_verify
                                          else "not checked (set FZ_CKPT_KEY to check it)")
    else:
        signed = "no" if info.signed is False else "?"
    rows.append(("signed", signed))
    if info.format == "deepspeed":
        rows.append(("manifest", "none (DeepSpeed writes none): its files parse (fz consolidate reads it)"))
    elif args.no_verify:
        rows.append(("manifest", "not checked (--no-verify)"))
    else:
        rows.append(("manifest", "verified" if info.verified else f"FAILED: {info.verify_error}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if info.verified is not False and info.meta_error is None else 1


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fz", description=(
        "fz, DeepSpeed's ZeRO as functional training: checkpoints (consolidate, inspect), memory "
        "(estimate, plan) and the launcher (run)"))
    parser.add_argument("--version", action="version", version=f"fz {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="cmd")
    c = sub.add_parser("consolidate", help="write the full parameters of a checkpoint to one safetensors file")
    c.add_argument("ckpt", help="checkpoint root (uses its `latest`) or a step_<N> directory; or a DeepSpeed "
                   "save_dir / tag folder (read without unpickling code, as zero_to_fp32 consolidates it)")
    c.add_argument("out", help="output .safetensors file (with --hf: a folder)")
    c.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="cast (default: as stored)")
    c.add_argument("--hf", action="store_true", help="write a Hugging Face folder that from_pretrained loads: "
                   "sharded safetensors, their index, and the config/tokenizer files found beside the checkpoint")
    c.add_argument("--max-shard-size", default="5GB", help="with --hf: bytes per shard file (default 5GB)")
    c.set_defaults(fn=_consolidate)
    i = sub.add_parser("inspect", help="show what a checkpoint holds and verify its manifest")
    i.add_argument("ckpt", help="checkpoint root (uses its `latest`) or a step_<N> directory")
    i.set_defaults(fn=_inspect)
    for p in (c, i):
        p.add_argument("--step", type=int, default=None, help="a step of the root instead of `latest`")
        p.add_argument("--no-verify", action="store_true", help="skip the checksum pass")
        p.add_argument("--progress", action="store_true", help="show the progress bar even when not a terminal")
    # the memory estimator and automatic plan (fz estimate, fz plan)
    from fz.planning.cli import add_commands
    add_commands(sub)
    # the launcher (fz run: torchrun underneath)
    from fz.launch.cli import add_command
    add_command(sub)
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 0
    try:
        return args.fn(args)
    except (ConfigError, NonFiniteError) as e:  # NonFiniteError: consolidate refuses NaN weights
        print(f"fz {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file it cannot read or write (the disk filled up while writing...): said, not a traceback
        print(f"fz {args.cmd}: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
