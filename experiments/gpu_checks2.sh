#!/usr/bin/env bash
# The second CUDA check of 2026-11-26 (device tool): the fixed compiled=True GPU test and fake-on-CPU vs measured-on-CUDA.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -p no:cacheprovider -n 0 -q -m gpu -o addopts="" tests/runtime/test_compile.py 2>&1 | tee $OUT/gpu_compile_test.log | tail -3
timeout 120 python3 experiments/probe_fake_vs_cuda.py --out $OUT 2>&1 | tee $OUT/fake_vs_cuda.log | grep -v Warning | tail -8
