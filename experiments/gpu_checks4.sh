#!/usr/bin/env bash
# CUDA check 4 of 2026-11-26 (device tool): optimize() past the device memory with the benchmark timing on CUDA
# (timing="auto" on a fake trace: each op timed alone on the GPU), and the benchmark timing's own tests there.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
timeout 150 python3 experiments/probe_unfit_step_cuda.py --out $OUT --fractions 0.8,0.75 2>&1 | tee $OUT/unfit_step_cuda.log | grep -v Warning | tail -6
