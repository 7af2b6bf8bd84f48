#!/usr/bin/env bash
# The device machine's runner: one named check per former experiments/gpu_checks*.sh, and the other device runs the
# results record. Pass it to the device tool's `run`, from the repository root:
#
#     bash experiments/device/run.sh fsdp_parts              # one check
#     bash experiments/device/run.sh fake_vs_cuda fsdp       # several, in turn (their timeouts add up: 600 s a call)
#     bash experiments/device/run.sh list                    # the checks, what each writes, where its results live
#
# Each check writes under $OUT/<check>/ (the device tool brings $OUT back); copy that folder's files into the results
# folder `list` names, then run the folder's summarize script where it has one (experiments/README.md). Wheels the
# machine lacks (pulp, highspy, transformers, ...) travel in .whl/ (run's carry=[".whl"]) and are installed into
# /tmp/site first; without .whl/ the machine's own packages are used. The timeouts are the ones each check was run
# with. Timing on the device, as everywhere: ratios of alternating runs in one process, never absolute times.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}

setup() {
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site:$PWD
    else
        echo "no wheels in .whl/: using the machine's own packages" >&2
        export PYTHONPATH=$PWD
    fi
    export PYTHONUNBUFFERED=1
}

machine() {  # the GPU and versions, into the check's folder (the summarize scripts read gpu.txt and versions.txt)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$1/gpu.txt"
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee "$1/versions.txt"
}

quiet() { grep -v "Warning\|cls.__new\|storage = "; }  # torch's and transformers' warnings off a probe's log

# compile (was gpu_checks.sh, 2026-11-26, first CUDA session; results/compile_cuda/, README there by hand): the GPU
# tests of compile, foreign memory, the models and the optimizer step, then bench_compile on CUDA (GPT-2 at size
# bench; its 250 s limit stopped it before the timing rounds, so the recorded log has peaks only).
check_compile() {
    machine "$1"
    timeout 220 python3 -m pytest -p no:cacheprovider -n 0 -q -m gpu -o addopts="" tests/runtime/test_compile.py \
        tests/measure/test_foreign_memory.py tests/planning/test_models.py tests/measure/test_optimizer_step.py 2>&1 \
        | tee "$1/gpu_tests.log" | tail -20
    timeout 250 python3 -m experiments.bench.bench_compile --device cuda --size bench --models gpt2 --fractions 0.4,0.7 \
        --compile-budgets 1.0,0.5,0.1 --rounds 10 --out "$1/compile_cuda" 2>&1 | tee "$1/bench_compile.log" | tail -25
}

# fake_vs_cuda (was gpu_checks2.sh, 2026-11-26, second CUDA session; results/fake_vs_cuda/ and
# results/compile_cuda/gpu_compile_test_*.log): the fixed compiled=True GPU test, and a zoo model's fake trace on CPU
# tensors against its measured trace on CUDA (probe_fake_vs_cuda).
check_fake_vs_cuda() {
    machine "$1"
    timeout 110 python3 -m pytest -p no:cacheprovider -n 0 -q -m gpu -o addopts="" tests/runtime/test_compile.py 2>&1 \
        | tee "$1/gpu_compile_test.log" | tail -3
    timeout 120 python3 -m experiments.probes.probe_fake_vs_cuda --out "$1" 2>&1 | tee "$1/fake_vs_cuda.log" \
        | grep -v Warning | tail -8
}

# big_model (was gpu_checks3.sh, 2026-11-26, third CUDA session; results/big_model_cuda/, then
# `python -m experiments.probes.summarize_big_model_cuda`): a Llama-2-7B planned on meta as a laptop would plan it,
# then materialised and run on the GPU under each plan; optimize() under a device memory below the unmodified peak.
check_big_model() {
    machine "$1"
    timeout 330 python3 -m experiments.probes.probe_big_model_cuda --out "$1" 2>&1 | tee "$1/big_model_cuda.log" \
        | grep -v Warning | tail -8
    timeout 150 python3 -m experiments.probes.probe_unfit_step_cuda --out "$1" 2>&1 | tee "$1/unfit_step_cuda.log" \
        | grep -v Warning | tail -5
}

# unfit_step (was gpu_checks4.sh, 2026-11-26, CUDA check 4; results/big_model_cuda/benchmark_timing/, then the
# summarize script above): optimize() past the device memory with the benchmark timing on CUDA (timing="auto" on a
# fake trace: each op timed alone on the GPU), at f = 0.8 and 0.75 of the unmodified peak.
check_unfit_step() {
    machine "$1"
    timeout 150 python3 -m experiments.probes.probe_unfit_step_cuda --out "$1" --fractions 0.8,0.75 2>&1 \
        | tee "$1/unfit_step_cuda.log" | grep -v Warning | tail -6
}

# fsdp (was gpu_checks5.sh, 2026-11-26, CUDA check 5; results/fsdp/probe_fsdp_cuda.log): an FSDP2 plan made on CPU
# fakes against the real CUDA step (NCCL, world 1), the tests' decoder.
check_fsdp() {
    machine "$1"
    timeout 100 python3 -m experiments.probes.probe_fsdp_cuda 2>&1 | tee "$1/probe_fsdp_cuda.log" | grep -v Warning \
        | tail -8
}

# fsdp_llama (was gpu_checks6.sh, 2026-11-26, CUDA check 6; results/fsdp_cuda_llama/, then
# `python -m experiments.probes.summarize_fsdp_cuda_llama`): FSDP2 plans at Llama-3-8B's block shape on one GPU (NCCL,
# world 1): every plan's peak against its prediction, step times against full checkpointing per block, offload into
# the pool. The plans are made beforehand on a CPU (torch 2.13; the device's torch 2.11 could not fake-trace the meta
# model) and carried in the working tree:
#   python -m experiments.probes.probe_fsdp_cuda_llama --plan-only --out experiments/results/fsdp_cuda_llama/plans/main
#   python -m experiments.probes.probe_fsdp_cuda_llama --plan-only --vocab 128256 \
#       --out experiments/results/fsdp_cuda_llama/plans/vocab128k
check_fsdp_llama() {
    machine "$1"
    local res=/tmp/res/fsdp_llama
    timeout 100 python3 -m experiments.probes.probe_fsdp_cuda_llama --plans experiments/results/fsdp_cuda_llama/plans/main \
        --out "$res/main" --rounds 6 2>&1 | quiet | tee "$1/main.log" | grep -v "^{'plan'"
    tar czf "$1/results.tgz" -C "$res" .
    timeout 45 python3 -m experiments.probes.probe_fsdp_cuda_llama \
        --plans experiments/results/fsdp_cuda_llama/plans/vocab128k --out "$res/vocab128k" --vocab 128256 --rounds 0 2>&1 \
        | quiet | tee "$1/vocab128k.log" | grep -v "^{'plan'"
    tar czf "$1/results.tgz" -C "$res" .
}

# fsdp_parts (was gpu_checks7.sh, 2026-11-26, CUDA check 7; results/fsdp_cuda_parts/, then
# `python -m experiments.probes.summarize_fsdp_cuda_parts`): FSDP2 plans with checkpointed parts (a block's MLP or
# attention alone) at Llama-3-8B's block shape on one GPU (NCCL, world 1), 2 x 8192 tokens so that activations, not
# the foreach optimizer step, make the peak: every plan's peak against its prediction, step times against full per
# block. The plans were made beforehand on a CPU (torch 2.13; the device's torch 2.11 cannot fake-trace the meta model):
#   python -m experiments.probes.probe_fsdp_cuda_llama --parts --batch 2 --pool-gb 0 --plan-only \
#       --out experiments/results/fsdp_cuda_parts/plans
check_fsdp_parts() {
    machine "$1"
    local res=/tmp/res/fsdp_parts
    timeout 400 python3 -m experiments.probes.probe_fsdp_cuda_llama --plans experiments/results/fsdp_cuda_parts/plans \
        --out "$res" --batch 2 --parts --pool-gb 0 --rounds 6 --no-tracker 2>&1 | quiet | tee "$1/parts.log" \
        | grep -v "^{'plan'"
    cp "$res"/fsdp_cuda_llama.* "$1/" 2>/dev/null
}

# eager_program (issue 45 item 5, results/eager_program_cuda/): a Hugging Face GQA Llama and GPT-2-medium on CUDA, the
# eager model against autockpt's unmodified program (peak, reserved, step time) and autockpt's floor against Hugging
# Face gradient checkpointing's measured peak, with where each peak is.
check_eager_program() {
    machine "$1"
    timeout 480 python3 -m experiments.probes.probe_eager_program_cuda --out "$1" 2>&1 | quiet \
        | tee "$1/eager_program_cuda.log" | tail -80
}

# loss_chunks (issue 48 item 8, results/loss_chunks_cuda/): a Llama-3.2-1B-shaped decoder (4 layers, bf16, 2 x 4096)
# on CUDA: the eager model, autockpt's floor with the loss as captured and with the loss in chunks, and Liger-Kernel's
# fused linear cross-entropy beside them when its wheel is in .whl/.
check_loss_chunks() {
    machine "$1"
    timeout 500 python3 -m experiments.probes.probe_loss_chunks_cuda --out "$1" --rounds 3 --at-liger-peak 2>&1 | quiet \
        | tee "$1/loss_chunks_cuda.log" | tail -60
}

# edges (issue 46, items 1-3, results/edges_cuda/): the loop that drops the output before backward against the one
# that holds it (GPT-NeoX under bf16 autocast), conv nets, a UNet and a VAE at the stated minimum, the VAE's
# gradients against the eager model's; then the GPU tests (compile, foreign memory, models, optimizer step).
# Prepared 2026-11-29 and dry-run on CPU (`--device cpu`, about 3 minutes); not yet run on a GPU: none was lent that day.
check_edges() {
    machine "$1"
    timeout 300 python3 -m experiments.probes.probe_edges_cuda --out "$1" 2>&1 | quiet | tee "$1/edges_cuda.log" \
        | tail -40
    timeout 180 python3 -m pytest -p no:cacheprovider -n 0 -q -m gpu -o addopts="" tests/runtime/test_compile.py \
        tests/measure/test_foreign_memory.py tests/planning/test_models.py tests/measure/test_optimizer_step.py 2>&1 \
        | tee "$1/gpu_tests.log" | tail -20
}

# The device runs below were made by hand on earlier leases (commands as HISTORY.md records them); they are named here
# so that a rerun is one call. Not yet run through this runner.

# offload_runtime (2026-11-24, results/offload_cuda/): the offload runtime alone (no planner), every layer of a
# GPT-2-medium-like stack offloaded but the last: gradients against the plain model, peaks, step-time ratio, link rates.
check_offload_runtime() {
    machine "$1"
    OUT="$1" timeout 300 python3 -m experiments.probes.offload_runtime_cuda 2>&1 | tee "$1/offload_runtime_cuda.log" \
        | grep -v Warning | tail -40
    gzip -f "$1/offload_trace.json" 2>/dev/null
}

# cuda_prediction (2026-11-24, results/cuda_prediction/): autockpt's predicted peak against max_memory_allocated, plans
# applied without verification. A second label for older code: PYTHONPATH=/path/to/old:$PYTHONPATH python3 -P -m ...
check_cuda_prediction() {
    machine "$1"
    timeout 500 python3 -m experiments.bench.bench_cuda_prediction --label "this checkout" \
        --models gpt2_medium_8l,gpt2,llama,cnn,vit --out "$1" 2>&1 | tee "$1/cuda_prediction.log" | tail -30
}

# offload_bench (2026-11-24, results/offload_bench_cuda/; that run was stopped at 400 s, GPT-2 medium only):
# recompute only vs recompute + offload vs HF checkpointing (and save_on_cpu) at equal budgets.
check_offload_bench() {
    machine "$1"
    timeout 550 python3 -m experiments.bench.bench_offload --device cuda --models gpt2-medium,llama --out "$1" 2>&1 \
        | tee "$1/bench_offload.log" | tail -30
}

# sweep_cuda (2026-11-24, results/sweep_cuda/; that lease ran it in two parts, each stopped by its limit): the sweep on
# the GPU at the zoo's bench size. Where the markdown does not come back: `sweep.rerender` (experiments/bench/sweep.py).
check_sweep_cuda() {
    machine "$1"
    timeout 550 python3 -m experiments.bench.sweep --device cuda --size bench --models gpt2,vit,unet,cnn \
        --compile-models gpt2 --batch-models '' --quiet --out "$1/sweep_cuda" 2>&1 | tee "$1/sweep.log" | tail -30
}

# saved_tensors (2026-11-26, results/saved_tensors/saved_cuda.*): what autograd saves in one Llama-3-8B-shaped
# decoder layer on the GPU (the CPU-fake listing is `python -m experiments.probes.probe_saved_tensors fake`).
check_saved_tensors() {
    machine "$1"
    timeout 200 python3 -m experiments.probes.probe_saved_tensors cuda --out "$1" 2>&1 | quiet \
        | tee "$1/saved_cuda.log" | tail -20
}

list() {
    cat <<'END'
Checks: bash experiments/device/run.sh CHECK [CHECK ...]; each writes under $OUT/CHECK/. Copy into the results folder
named, then run its summarize script where it has one.
  compile          GPU tests (compile, foreign memory, models, optimizer step) + bench_compile on CUDA
                   -> results/compile_cuda/                                        (was gpu_checks.sh)
  fake_vs_cuda     compiled=True GPU test + fake trace on CPU vs measured trace on CUDA
                   -> results/fake_vs_cuda/                                        (was gpu_checks2.sh)
  big_model        Llama-2-7B planned on meta, run on the GPU under each plan; optimize() under the device memory
                   -> results/big_model_cuda/, summarize_big_model_cuda            (was gpu_checks3.sh)
  unfit_step       optimize() past the device memory with the benchmark timing (f = 0.8, 0.75)
                   -> results/big_model_cuda/benchmark_timing/                     (was gpu_checks4.sh)
  fsdp             FSDP2 plan made on CPU fakes against the real CUDA step (NCCL, world 1)
                   -> results/fsdp/probe_fsdp_cuda.log                             (was gpu_checks5.sh)
  fsdp_llama       FSDP2 plans at Llama-3-8B's block shape: peaks vs predictions, steps vs full per block
                   -> results/fsdp_cuda_llama/, summarize_fsdp_cuda_llama          (was gpu_checks6.sh)
  fsdp_parts       the same with checkpointed parts (a block's MLP or attention alone), 2 x 8192 tokens
                   -> results/fsdp_cuda_parts/, summarize_fsdp_cuda_parts          (was gpu_checks7.sh)
  offload_runtime  the offload runtime alone on a GPT-2-medium-like stack      -> results/offload_cuda/
  cuda_prediction  predicted peak vs max_memory_allocated, plans unverified     -> results/cuda_prediction/
  offload_bench    recompute vs recompute + offload vs HF checkpointing         -> results/offload_bench_cuda/
  sweep_cuda       the sweep on the GPU, zoo size bench                         -> results/sweep_cuda/
  eager_program    eager model vs autockpt's unmodified program, floor vs HF checkpointing (issue 45)
                   -> results/eager_program_cuda/
  loss_chunks      Llama-3.2-1B shape: eager vs autockpt's floors, loss as captured and in chunks; Liger beside
                   -> results/loss_chunks_cuda/
  saved_tensors    what autograd saves in one Llama-3-8B layer on the GPU       -> results/saved_tensors/
  edges            issue 46 on CUDA: output dropped vs held, floors of conv nets/UNet/VAE, VAE gradients; GPU tests
                   -> results/edges_cuda/
END
}

if [ $# -eq 0 ] || [ "$1" = "list" ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    list
    exit 0
fi
for check in "$@"; do
    if [ "$(type -t "check_$check")" != "function" ]; then
        echo "unknown check '$check'" >&2
        list >&2
        exit 2
    fi
done
setup
for check in "$@"; do
    mkdir -p "$OUT/$check"
    echo "=== $check -> $OUT/$check" >&2
    "check_$check" "$OUT/$check"
done
ls -R "$OUT"
