"""`deepspeed.utils.zero_to_torch` on fz: DeepSpeed's `zero_to_torch.py` command line, a ZeRO
checkpoint's weights in float32, float16 or bfloat16 (fz/deepspeed/utils/zero_to_fp32.py)."""
from __future__ import annotations

from fz.deepspeed.utils.zero_to_fp32 import main as _main


def main(args: list[str] | None = None) -> None:
    """`python zero_to_torch.py checkpoint_dir output_dir --dtype bf16 [...]`, as DeepSpeed's."""
    _main(args, with_dtype=True)


if __name__ == "__main__":
    main()
