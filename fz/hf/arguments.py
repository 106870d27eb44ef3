"""TEMPORARY STUB (helper A replaces it)."""
from __future__ import annotations

import fz


def spec_from_args(args, model, *, max_steps, spec=None):
    if spec is not None:
        return spec
    kw = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
              weight_decay=args.weight_decay, micro_batch=args.per_device_train_batch_size,
              grad_accum=args.gradient_accumulation_steps, clip_grad_norm=args.max_grad_norm,
              precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32", total_steps=max_steps,
              warmup_steps=args.get_warmup_steps(max_steps))
    cfg = args.deepspeed or {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto",
                             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    return fz.Spec.from_deepspeed(cfg, **kw).replace(seed=args.seed)

def unsupported(args, model):
    return None
