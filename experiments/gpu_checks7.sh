#!/usr/bin/env bash
# CUDA check 7 of 2026-11-26 (device tool): FSDP2 plans with checkpointed parts (a block's MLP or attention alone)
# at Llama-3-8B's block shape on one GPU (NCCL, world 1), 2 x 8192 tokens so that activations, not the foreach
# optimizer step, make the peak: every plan's peak against its prediction, step times against full per block.
# The plans were made beforehand on a CPU (torch 2.13; the device's torch 2.11 cannot fake-trace the meta model):
#   python experiments/probe_fsdp_cuda_llama.py --parts --batch 2 --pool-gb 0 --plan-only \
#       --out experiments/results/fsdp_cuda_parts/plans
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python3 experiments/probe_fsdp_cuda_llama.py --plans experiments/results/fsdp_cuda_parts/plans --out /tmp/res/parts --batch 2 --parts --pool-gb 0 --rounds 6 --no-tracker 2>&1 | grep -v "Warning\|cls.__new\|storage = " | tee $OUT/parts.log | grep -v "^{'plan'"
cp /tmp/res/parts/fsdp_cuda_llama.* $OUT/ 2>/dev/null
