"""`fz estimate` and `fz plan`: the estimator table and the automatic plan from the command line.

    fz estimate --params 2.8e9 --largest-layer 65e6 --gpus-per-node 8 --nodes 1
    fz estimate --params 2.8e9 --largest-layer 65e6 --stage 3 --offload-optimizer cpu --offload-param cpu
    fz estimate --model pkg.mod:factory [--loss-fn pkg.mod:fn] [--micro-batch 4 --seq-len 1024]
    fz plan --model path/to/file.py:factory [--world-size 2] [--device-gb 80 --host-gb 512 --disk-gb 2000]
    fz estimate --model path/to/config.json     # or a Hugging Face model's folder: built from its config

Budgets given are the target machine's, planned for on any machine (a login node, a laptop);
those not given are this machine's. `--device-gb` makes device and host separate budgets even
without a GPU here; with neither it nor a GPU, the device is the host.

A factory is called with no arguments under `torch.device("meta")` (nothing is allocated);
it returns an nn.Module. Importing it runs that module's code, as `python file.py` would.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fz.errors import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn

    from fz.planning.counts import Counts
    from fz.spec import Spec

GB = 2**30


def load(ref: str) -> Callable[..., Any]:
    """`pkg.mod:name` or `path/to/file.py:name` -> the object it names."""
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"{ref!r}: expected module:function (pkg.mod:factory or path/to/file.py:factory)")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ConfigError(f"{ref!r}: no file {where}")
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{ref!r}: {where} cannot be imported as a module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is None or not (e.name == where or where.startswith(e.name + ".")):
                raise  # a module it imports is missing: its own traceback says which
            raise ConfigError(f"{ref!r}: no module {e.name!r} (a module on the path, or path/to/file.py:factory)") \
                from None
    if not hasattr(module, name):
        raise ConfigError(f"{ref!r}: {where} has no {name!r}")
    return getattr(module, name)


def _hf_config(ref: str) -> str | None:
    """The Hugging Face config `ref` names: a config.json, or a folder holding one (a model's folder, a Hub
    cache snapshot); None for a module:factory."""
    if ref.endswith(".json") and os.path.isfile(ref):
        return ref
    return os.path.join(ref, "config.json") if os.path.isfile(os.path.join(ref, "config.json")) else None


def _from_hf_config(path: str) -> nn.Module:
    """The model transformers builds from that config (its causal-LM head where it has one), on meta."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model {path}: a Hugging Face config needs transformers (pip install 'fz-zero[hf]')") \
            from None
    config = transformers.AutoConfig.from_pretrained(path)
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM (an encoder, a seq2seq model): its base model
        return transformers.AutoModel.from_config(config)


def build(ref: str) -> nn.Module:
    import torch
    config = _hf_config(ref)
    with torch.device("meta"):
        model = _from_hf_config(config) if config is not None else load(ref)()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{ref}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def _target(args: argparse.Namespace) -> nn.Module | Counts:
    from fz.planning.counts import Counts
    if args.model:
        return build(args.model)
    if args.params is None or args.largest_layer is None:
        args.parser.print_usage(sys.stderr)
        raise ConfigError("give --model module:factory, or --params and --largest-layer (raw counts)")
    return Counts(int(args.params), int(args.largest_layer))


def _spec(args: argparse.Namespace) -> Spec:
    from fz.spec import Spec
    return Spec(loss_fn=load(args.loss_fn) if args.loss_fn else None)


def _estimate(args: argparse.Namespace) -> int:
    from fz.planning.table import estimate_table
    if args.stage is not None:
        print(_one(args))
        return 0
    print(
        estimate_table(
            _target(args),
            gpus_per_node=args.gpus_per_node,
            nodes=args.nodes,
            precision=args.precision,
            spec=_spec(args),
            nvme_path=args.nvme_path,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
        )
    )
    return 0


def _one(args: argparse.Namespace) -> str:
    """`--stage`: one row of the table, term by term, beside DeepSpeed's terms where it has them."""
    from fz.planning.estimator import estimate
    from fz.planning.table import options
    want = f"offload_param={args.offload_param:<4}, offload_optimizer={args.offload_optimizer:<4}"
    found = dict(options(args.stage, args.nvme_path))
    if want not in found:
        rows = "; ".join(" ".join(k.split()) for k in found)
        raise ConfigError(f"fz estimate --stage {args.stage}: no row offloads param={args.offload_param}, "
                          f"optimizer={args.offload_optimizer}; the rows are: {rows}")
    spec = _spec(args).replace(stage=args.stage, precision=args.precision, offload=found[want])
    return str(estimate(_target(args), spec=spec, world_size=args.gpus_per_node * args.nodes, nodes=args.nodes,
                        micro_batch=args.micro_batch, seq_len=args.seq_len, device_type="cuda"))


def _plan(args: argparse.Namespace) -> int:
    from fz.planning.ladder import plan
    gb = lambda x: None if x is None else x * GB  # noqa: E731
    plan(_target(args), spec=_spec(args), precision=args.precision, world_size=args.world_size,
         nodes=args.nodes, device_budget=gb(args.device_gb), host_budget=gb(args.host_gb), disk_budget=gb(args.disk_gb),
         nvme_path=args.nvme_path, margin=args.margin, micro_batch=args.micro_batch, seq_len=args.seq_len, report=print)
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `fz estimate` and `fz plan` on the `fz` command's subparsers."""
    e = sub.add_parser("estimate", help="memory per GPU / CPU / disk for every stage and offload (DeepSpeed's table)")
    e.add_argument("--gpus-per-node", "--num-gpus", type=int, default=1)
    e.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    e.add_argument("--stage", type=int, choices=[0, 1, 2, 3],
                   help="one row, term by term (beside DeepSpeed's terms where its estimator has the row)")
    e.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"], help="with --stage")
    e.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"], help="with --stage")
    e.set_defaults(fn=_estimate)
    p = sub.add_parser("plan", help="the fastest configuration that fits this machine (or the given budgets)")
    p.add_argument("--world-size", type=int, default=None, help="ranks in all (default: this node's GPUs, else 1)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="where the ladder starts (default: bf16 for a GPU plan, fp32 for a CPU one)")
    p.add_argument("--device-gb", type=float, help="per-device budget: plan for that device, GPU here or not "
                   "(default: this machine's GPU; with none, device and host are one memory, --host-gb)")
    p.add_argument("--host-gb", type=float, help="per-host budget (default: this machine's RAM)")
    p.add_argument("--disk-gb", type=float, help="free disk for the NVMe tier (default: free space under --nvme-path)")
    p.add_argument("--margin", type=float, default=0.2, help="fraction of each budget kept free (default 0.2)")
    p.set_defaults(fn=_plan)
    for c in (e, p):
        c.set_defaults(parser=c)
        c.add_argument("--model", help="module:factory returning the nn.Module (called under the meta device), "
                                        "or a Hugging Face config.json (or a model's folder holding one)")
        c.add_argument("--params", type=float, help="or: total parameters (raw counts), e.g. 2.8e9")
        c.add_argument("--largest-layer", type=float, help="and parameters of the largest layer, e.g. 65e6")
        c.add_argument("--loss-fn", help="module:function (model, batch) -> loss, for the activation trace")
        c.add_argument("--nodes", "--num-nodes", "--num_nodes", type=int, default=1)
        c.add_argument("--micro-batch", type=int, help="rows per micro-batch: traces activations")
        c.add_argument("--seq-len", type=int, help="tokens per row of the traced micro-batch")
        c.add_argument("--nvme-path", default="nvme", help="the disk tier's directory (default ./nvme)")
