"""The offload runtime (``autockpt/runtime/offload.py``) on a GPU: a GPT-2-medium-like stack, every layer offloaded but the last.

    python -m experiments.probes.offload_runtime_cuda        # writes into $OUT (default ./out)
    bash experiments/device/run.sh offload_runtime           # the same on the device machine

24 ``nn.TransformerEncoderLayer`` (d_model 1024, 16 heads, feed-forward 4096, pre-norm, GELU, dropout 0.1), batch 8,
sequence 1024, bf16 autocast, fp32 parameters. The offloaded copy runs layers 0..22 inside ``HostPool.offloading(i)``
and prefetches layer 22 between forward and backward; the pool is sized by a forward that lists what the rules move.

Checks the offloaded step's gradients against the plain model's (exact, or, where the plain model does not even
repeat itself bit for bit, within the plain model's own run-to-run spread), then measures: ``max_memory_allocated``
and ``max_memory_reserved`` per step, step time (alternating runs, median of 10 after warm-up), pool statistics, the
achieved device-to-host and host-to-device rates (GB = 10^9 bytes) from the profiler's copy records and, for
reference, from one isolated 1 GB copy each way; and saves a chrome trace of one offloaded step
(``$OUT/offload_trace.json``) showing the copy streams beside compute. Uses ``autockpt.runtime.offload`` alone (no
planner). Writes ``offload_runtime_cuda.csv``, the trace and the section ``offload_runtime_cuda`` of README.md into
$OUT. Exits 2 without CUDA.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autockpt.runtime import offload
from experiments.common.results_readme import write_section

LAYERS, D_MODEL, HEADS, FFN, BATCH, SEQ = 24, 1024, 16, 4096, 8, 1024
WARMUP_STEPS, TIMED_ROUNDS = 3, 10



def build(layers: int = LAYERS) -> nn.Sequential:
    return nn.Sequential(*[
        nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.1, activation="gelu", batch_first=True, norm_first=True)
        for _ in range(layers)
    ])


def wrap(model: nn.Sequential, pool: Any, offloaded: int) -> None:
    """Run layers 0..offloaded-1 inside ``pool.offloading(i)``."""
    for index in range(offloaded):
        layer = model[index]
        plain = layer.forward

        def forward(*args: Any, _plain: Callable[..., Any] = plain, _index: int = index, **kwargs: Any) -> Any:
            with pool.offloading(_index):
                return _plain(*args, **kwargs)

        layer.forward = forward


def step(
    model: nn.Module, x: torch.Tensor, seed: int, pool: Any = None, last_offloaded: int | None = None,
    forward_peak: list[int] | None = None,
) -> None:
    for param in model.parameters():
        param.grad = None
    torch.manual_seed(seed)
    if pool is not None:
        pool.begin_step()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
    loss = out.float().pow(2).mean()
    if forward_peak is not None:
        torch.cuda.synchronize(x.device)
        forward_peak.append(torch.cuda.max_memory_allocated(x.device))
    if pool is not None and last_offloaded is not None:
        pool.prefetch(last_offloaded)  # its copy overlaps the last layer's backward
    loss.backward()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float]:
    exact = all(torch.equal(x, y) for x, y in zip(a, b))
    return exact, max(float((x - y).abs().max()) for x, y in zip(a, b))


def pool_size(model: nn.Sequential, x: torch.Tensor, offloaded: int, device: torch.device) -> int:
    """The capacity a step needs: one forward listing the distinct storages the rules move."""
    seen: dict[tuple[int, int], int] = {}  # the graph holds every saved tensor: no address is reused meanwhile

    def spy(tensor: torch.Tensor) -> torch.Tensor:
        if offload.moves(tensor, device):
            storage = tensor.untyped_storage()
            seen.setdefault((storage.data_ptr(), tensor._version), storage.nbytes())
        return tensor.detach()  # the tensor itself would tie the graph in a cycle through its own node: a leak

    torch.manual_seed(0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x
        for index, layer in enumerate(model):
            if index < offloaded:
                with torch.autograd.graph.saved_tensors_hooks(spy, lambda t: t):
                    h = layer(h)
            else:
                h = layer(h)
    del h
    return sum(offload.slot_bytes(n) for n in seen.values())


def peak_memory(run: Callable[[], None], device: torch.device) -> tuple[int, int, int]:
    """(bytes allocated before the step, max_memory_allocated, max_memory_reserved) over one step."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return resident, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def exact_check(device: torch.device) -> str:
    """Offloaded against plain on 4 layers, batch 2, with deterministic kernels (the math attention): bit for bit?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(1)
    plain = build(4).to(device)
    offloaded = copy.deepcopy(plain)
    x = torch.randn(2, SEQ, D_MODEL, device=device)
    with sdpa_kernel(SDPBackend.MATH):  # sized under the same kernels: the math attention saves more
        pool = offload.HostPool(pool_size(offloaded, x, 3, device), device)
        wrap(offloaded, pool, 3)
        results = []
        for model, args in ((plain, ()), (offloaded, (pool, 2)), (plain, ())):
            step(model, x, 0, *args)
            results.append(grads(model))
    exact, difference = max_difference(results[1], results[0])
    plain_exact, _ = max_difference(results[2], results[0])
    return (f"{'exact' if exact else f'NOT exact (max |diff| {difference:.3g})'}; plain vs plain "
            f"{'exact' if plain_exact else 'not exact'}")


def timed(run: Callable[[], None], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def isolated_link_gbps(device: torch.device, pinned: torch.Tensor) -> tuple[float, float]:
    """One copy of the pinned buffer each way on a side stream (GB/s, GB = 10^9)."""
    on_device = torch.empty_like(pinned, device=device)
    stream = torch.cuda.Stream(device)
    rates = []
    for dst, src in ((pinned, on_device), (on_device, pinned)):
        dst.copy_(src, non_blocking=True)  # warm
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        rates.append(pinned.numel() / (start.elapsed_time(end) * 1e-3) / 1e9)
    return rates[0], rates[1]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap_us(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    total, spans = 0.0, merged(compute)
    for start, end in merged(copies):
        for c_start, c_end in spans:
            total += max(0.0, min(end, c_end) - max(start, c_start))
    return total


def trace_copies(path: Path) -> dict[str, float]:
    """From the chrome trace: copy time each way, and how much of it ran while a compute kernel ran."""
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e]
    result: dict[str, float] = {}
    for direction in ("DtoH", "HtoD"):
        copies = [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("cat") == "gpu_memcpy" and direction in e.get("name", "") and "dur" in e
        ]
        busy = sum(end - start for start, end in merged(copies))
        result[f"{direction}_busy_us"] = busy
        result[f"{direction}_overlapped_fraction"] = overlap_us(copies, kernels) / busy if busy else 0.0
    return result


def main() -> int:
    if not torch.cuda.is_available():
        print("offload_runtime_cuda needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run.")
        return 2
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    plain = build().to(device)
    offloaded = copy.deepcopy(plain)
    x = torch.randn(BATCH, SEQ, D_MODEL, device=device)
    last = LAYERS - 2  # the last offloaded layer

    capacity = pool_size(offloaded, x, LAYERS - 1, device)
    started = time.perf_counter()
    pool = offload.HostPool(capacity, device)
    pin_s = time.perf_counter() - started
    wrap(offloaded, pool, LAYERS - 1)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; pool {capacity / 1e9:.3f} GB "
          f"pinned in {pin_s:.1f} s")

    def run_plain(seed: int = 0) -> None:
        step(plain, x, seed)

    def run_offloaded(seed: int = 0) -> None:
        step(offloaded, x, seed, pool, last)

    # gradients: offloaded against plain, and plain against itself (are the kernels deterministic?)
    run_plain()
    want = grads(plain)
    run_offloaded()
    got = grads(offloaded)
    run_plain()
    again = grads(plain)
    exact, offload_diff = max_difference(got, want)
    plain_exact, plain_diff = max_difference(again, want)
    if exact:
        verdict = "exact (torch.equal on every gradient)"
    elif not plain_exact and offload_diff <= 4 * plain_diff:
        verdict = (f"not bit-exact, but the plain model does not repeat itself either (nondeterministic kernels: "
                   f"plain vs plain max |diff| {plain_diff:.3g}); offloaded vs plain max |diff| {offload_diff:.3g}")
    else:
        verdict = f"MISMATCH: offloaded vs plain max |diff| {offload_diff:.3g}, plain vs plain {plain_diff:.3g}"
    print("gradients:", verdict)
    del want, got, again

    deterministic = exact_check(device)
    print("gradients with deterministic kernels (4 layers, batch 2, math attention):", deterministic)

    for param in (*plain.parameters(), *offloaded.parameters()):  # resident: both models' parameters alone
        param.grad = None
    plain_forward: list[int] = []
    off_forward: list[int] = []
    plain_resident, plain_alloc, plain_reserved = peak_memory(
        lambda: step(plain, x, 0, None, None, plain_forward), device
    )
    plain.zero_grad(set_to_none=True)
    off_resident, off_alloc, off_reserved = peak_memory(
        lambda: step(offloaded, x, 0, pool, last, off_forward), device
    )

    for _ in range(WARMUP_STEPS):
        run_plain()
        run_offloaded()
    before = pool.stats()
    plain_ms, off_ms = [], []
    for round_index in range(TIMED_ROUNDS):  # alternating, so drifts hit both alike
        plain_ms.append(timed(run_plain, device))
        off_ms.append(timed(run_offloaded, device))
    after = pool.stats()
    per_step_in = (after.bytes_in - before.bytes_in) / TIMED_ROUNDS
    per_step_out = (after.bytes_out - before.bytes_out) / TIMED_ROUNDS
    waits_per_step = (after.copy_waits - before.copy_waits) / TIMED_ROUNDS

    trace_path = out_dir / "offload_trace.json"
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        run_offloaded()
        torch.cuda.synchronize(device)
    profiler.export_chrome_trace(str(trace_path))
    if trace_path.stat().st_size > 15_000_000:  # keep it under the 16 MB that comes back: GPU activity only
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            run_offloaded()
            torch.cuda.synchronize(device)
        profiler.export_chrome_trace(str(trace_path))
    copies = trace_copies(trace_path)
    d2h_gbps = per_step_in / (copies["DtoH_busy_us"] * 1e-6) / 1e9 if copies["DtoH_busy_us"] else 0.0
    h2d_gbps = per_step_out / (copies["HtoD_busy_us"] * 1e-6) / 1e9 if copies["HtoD_busy_us"] else 0.0
    probe = torch.empty(10**9, dtype=torch.uint8, pin_memory=True)
    link_d2h, link_h2d = isolated_link_gbps(device, probe)
    del probe

    stats = pool.stats()
    plain_median, off_median = statistics.median(plain_ms), statistics.median(off_ms)
    rows = [
        ("device", torch.cuda.get_device_name(device), "", ""),
        ("torch", torch.__version__, "", ""),
        ("gradients", verdict, "", ""),
        ("gradients_deterministic_kernels", deterministic, "", "4 layers, batch 2, math attention"),
        ("allocated_before_step_bytes", plain_resident, off_resident, "bytes (both models' parameters, the batch)"),
        ("max_memory_allocated_forward_bytes", plain_forward[0], off_forward[0], "bytes, at the end of forward"),
        ("max_memory_allocated_bytes", plain_alloc, off_alloc, "bytes"),
        ("step_peak_above_resident_bytes", plain_alloc - plain_resident, off_alloc - off_resident, "bytes"),
        ("max_memory_reserved_bytes", plain_reserved, off_reserved, "bytes"),
        ("step_ms_median", f"{plain_median:.2f}", f"{off_median:.2f}", f"ms, median of {TIMED_ROUNDS}"),
        ("step_time_ratio", "", f"{off_median / plain_median:.3f}", "offloaded / plain"),
        ("pool_capacity_bytes", "", capacity, "bytes"),
        ("pool_peak_occupancy_bytes", "", stats.peak_occupancy_bytes, "bytes"),
        ("pool_allocations", "", stats.allocations, ""),
        ("pool_steps", "", stats.steps, ""),
        ("moved_bytes_per_step", "", int(per_step_in), "bytes device->host"),
        ("restored_bytes_per_step", "", int(per_step_out), "bytes host->device"),
        ("copy_waits_per_step", "", waits_per_step, "restores started by an unpack"),
        ("tensors_moved_total", "", stats.tensors_moved, ""),
        ("tensors_kept_total", "", stats.tensors_kept, ""),
        ("d2h_GBps_while_copying", "", f"{d2h_gbps:.1f}", "moved bytes / DtoH busy time (profiled step)"),
        ("h2d_GBps_while_copying", "", f"{h2d_gbps:.1f}", "restored bytes / HtoD busy time (profiled step)"),
        ("d2h_GBps_step", "", f"{per_step_in / (off_median * 1e-3) / 1e9:.1f}", "moved bytes / step time"),
        ("d2h_copy_overlapped_with_compute", "", f"{copies['DtoH_overlapped_fraction']:.2f}", "fraction"),
        ("h2d_copy_overlapped_with_compute", "", f"{copies['HtoD_overlapped_fraction']:.2f}", "fraction"),
        ("link_d2h_GBps_isolated", "", f"{link_d2h:.1f}", "one 1 GB pinned copy"),
        ("link_h2d_GBps_isolated", "", f"{link_h2d:.1f}", "one 1 GB pinned copy"),
        ("pool_pin_seconds", "", f"{pin_s:.2f}", "s"),
    ]
    with open(out_dir / "offload_runtime_cuda.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["metric", "plain", "offloaded", "unit"])
        writer.writerows(rows)
    width = max(len(r[0]) for r in rows)
    table = [f"{name:<{width}}  {a!s:>14}  {b!s:>14}  {unit}" for name, a, b, unit in rows]
    print("\n".join(table))
    print(f"trace: {trace_path} ({trace_path.stat().st_size / 1e6:.1f} MB)")
    write_section("offload_runtime_cuda", "\n".join([
        (f"Offload runtime alone on {torch.cuda.get_device_name(device)} (torch {torch.__version__}): "
         "`python -m experiments.probes.offload_runtime_cuda` (device machine: `bash experiments/device/run.sh "
         f"offload_runtime`); every layer but the last offloaded, no planner. Gradients: {verdict}. Columns: plain, "
         "offloaded, unit. Files: `offload_runtime_cuda.csv`, the profiler trace of one offloaded step."),
        "", "```", *table, "```",
    ]), output=out_dir)
    return 0 if not verdict.startswith("MISMATCH") else 1


if __name__ == "__main__":
    sys.exit(main())
