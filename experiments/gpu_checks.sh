#!/usr/bin/env bash
# The CUDA checks of a lease (device tool): GPU tests and bench_compile on CUDA; wheels carried in .whl/, results under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch; print(torch.__version__)" | tee -a $OUT/gpu.txt
timeout 220 python3 -m pytest -p no:cacheprovider -n 0 -q -m gpu -o addopts="" tests/test_compile.py tests/test_foreign_memory.py tests/test_models.py tests/test_optimizer_step.py 2>&1 | tee $OUT/gpu_tests.log | tail -20
timeout 250 python3 experiments/bench_compile.py --device cuda --size bench --models gpt2 --fractions 0.4,0.7 --compile-budgets 1.0,0.5,0.1 --rounds 10 --out $OUT/compile_cuda 2>&1 | tee $OUT/bench_compile.log | tail -25
ls -R $OUT
