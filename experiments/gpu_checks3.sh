#!/usr/bin/env bash
# The CUDA check of 2026-11-26, third session (device tool): a Llama-2-7B planned on meta as a laptop would, then
# materialised and run on the H100 under each plan; optimize() under a device memory below the unmodified peak.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee $OUT/versions.txt
timeout 330 python3 experiments/probe_big_model_cuda.py --out $OUT 2>&1 | tee $OUT/big_model_cuda.log | grep -v Warning | tail -8
timeout 150 python3 experiments/probe_unfit_step_cuda.py --out $OUT 2>&1 | tee $OUT/unfit_step_cuda.log | grep -v Warning | tail -5
