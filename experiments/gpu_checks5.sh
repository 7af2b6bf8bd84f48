#!/usr/bin/env bash
# CUDA check 5 of 2026-11-26 (device tool): an FSDP2 plan made on CPU fakes against the real CUDA step (NCCL, world 1).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
timeout 100 python3 experiments/probe_fsdp_cuda.py 2>&1 | tee $OUT/probe_fsdp_cuda.log | grep -v Warning | tail -8
