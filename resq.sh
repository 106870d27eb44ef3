#!/bin/bash
cd /tmp/probe_trl4
while ! grep -q "done r4_sft_bf16_modeldtype_z3 " logs/batch.progress; do sleep 5; done
for c in "$@"; do OMP_NUM_THREADS=1 timeout 1200 /work/venv-ds/bin/python resume.py $c > logs/res_$c.txt 2>&1; echo "done res_$c $(date +%T)" >> logs/batch.progress; done
