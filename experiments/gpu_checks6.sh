#!/usr/bin/env bash
# CUDA check 6 of 2026-11-26 (device tool): FSDP2 plans at Llama-3-8B's block shape on one GPU (NCCL, world 1):
# every plan's peak against its prediction, step times against full checkpointing per block, offload into the pool.
# The plans are made beforehand on a CPU (torch 2.13; the device's torch 2.11 cannot fake-trace the meta model;
# the measured run read them from gpuplans/, since moved here):
#   python experiments/probe_fsdp_cuda_llama.py --plan-only --out experiments/results/fsdp_cuda_llama/plans/main
#   python experiments/probe_fsdp_cuda_llama.py --plan-only --vocab 128256 --out experiments/results/fsdp_cuda_llama/plans/vocab128k
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 100 python3 experiments/probe_fsdp_cuda_llama.py --plans experiments/results/fsdp_cuda_llama/plans/main --out /tmp/res/main --rounds 6 2>&1 | grep -v "Warning\|cls.__new\|storage = " | tee $OUT/main.log | grep -v "^{'plan'"
tar czf $OUT/results.tgz -C /tmp/res .
timeout 45 python3 experiments/probe_fsdp_cuda_llama.py --plans experiments/results/fsdp_cuda_llama/plans/vocab128k --out /tmp/res/vocab128k --vocab 128256 --rounds 0 2>&1 | grep -v "Warning\|cls.__new\|storage = " | tee $OUT/vocab128k.log | grep -v "^{'plan'"
tar czf $OUT/results.tgz -C /tmp/res .
