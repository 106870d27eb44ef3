#!/usr/bin/env bash
# On a GPU machine with torch preinstalled and no network (the project's lent H100):
# install what it lacks from .whl/ (torchdata and xxhash, cp312 manylinux; DeepSpeed and its needs for the comparison),
# then run what the arguments name: `tests` (tests/cuda), `headline` (benchmarks/gpu_offload.py),
# `deepspeed` (benchmarks/gpu_offload_deepspeed.py), `snapshot` (benchmarks/gpu_peak_snapshot.py), `compare`
# (the two headlines and tests/cuda in one call, about 4 minutes: RESULTS.md's 2026-11-28 run), `zero2`
# (stage 2 with the optimizer offloaded, fz then DeepSpeed; after `compare`), `diagnose`
# (phases, variants, a profile). Logs go to $OUT (default /tmp/fz-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fz-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, fz; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'fz', fz.__version__)"
for what in "$@"; do
  case "$what" in
    tests) timeout 420 python3 -m pytest -q -m cuda tests/cuda -p no:cacheprovider -rs 2>&1 | tee "$OUT/cuda-tests.log" ;;
    headline) timeout 480 python3 benchmarks/gpu_offload.py 2>&1 | tee "$OUT/headline.log" ;;
    smoke) python3 benchmarks/gpu_offload.py --dim 512 --layers 4 --heads 8 --vocab 4096 --seq 256 --steps 3 2>&1 | tee "$OUT/smoke.log" ;;
    snapshot) timeout 300 python3 benchmarks/gpu_peak_snapshot.py 2>&1 | tee "$OUT/snapshot.log" ;;
    deepspeed) timeout 480 python3 benchmarks/gpu_offload_deepspeed.py 2>&1 | tee "$OUT/deepspeed.log" ;;
    # RESULTS.md's headline, fz then DeepSpeed on the same machine, in one call: fz (the peak's
    # blocks, the widening variants), then tests/cuda while DeepSpeed's CPU Adam builds (its JIT
    # build is not in its timings), then DeepSpeed
    compare)
      timeout 200 python3 benchmarks/gpu_offload.py --same-batch --steps 4 --snapshot 8 \
        --variants "base;widen=device,copies=2" --variant-steps 3 2>&1 | tee "$OUT/fz.log"
      (cd /tmp && timeout 200 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
        > "$OUT/dsbuild.log" 2>&1) &
      timeout 300 python3 -m pytest -q -m cuda tests/cuda -p no:cacheprovider -rs 2>&1 | tee "$OUT/cuda-tests.log"
      wait
      timeout 240 python3 benchmarks/gpu_offload_deepspeed.py --same-batch --lr 3e-4 --weight-decay 0.01 --steps 4 \
        2>&1 | tee "$OUT/deepspeed.log" ;;
    # stage 2, the optimizer alone on the CPU (DeepSpeed's most common offload), the same model and batch:
    # fz (each bucket copied up while the next is updated: fz/offload/landing.py) then DeepSpeed. After
    # `compare` in the same call (its DeepSpeed op is built); about 3 minutes
    zero2)
      timeout 200 python3 benchmarks/gpu_offload.py --same-batch --steps 4 --stage 2 --offload optimizer \
        --variants "base" --variant-steps 3 2>&1 | tee "$OUT/fz-zero2.log"
      timeout 240 python3 benchmarks/gpu_offload_deepspeed.py --same-batch --lr 3e-4 --weight-decay 0.01 --steps 4 \
        --stage 2 --phase-steps 2 2>&1 | tee "$OUT/deepspeed-zero2.log" ;;
    # the diagnostics of RESULTS.md's 2026-11-27 run: phases, every variant, a profile
    diagnose)
      timeout 300 python3 benchmarks/gpu_offload.py --same-batch --steps 4 --snapshot 12 --profile "$OUT/profile" \
        --variants "base;prefetch=0;widen=device;widen=device,copies=2;widen=device,streams=2" \
        2>&1 | tee "$OUT/fz.log"
      timeout 240 python3 benchmarks/gpu_offload_deepspeed.py --same-batch --lr 3e-4 --weight-decay 0.01 --steps 4 \
        --phase-steps 2 2>&1 | tee "$OUT/deepspeed.log" ;;
    *) echo "unknown: $what" ;;
  esac
done
