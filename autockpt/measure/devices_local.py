"""The local device as a ``DeviceSpec``, calibrated by a short measurement (well under 2 s on a CPU).

* peak TFLOPS per dtype: the fastest of a few square matmuls (1024 on a CPU, 4096 on CUDA) in float32 and bfloat16
  (and float16 on CUDA; a CPU without half-precision kernels takes seconds for one, so it is not measured there);
* memory GB/s: the fastest copy of a 64 MiB buffer (256 MiB on CUDA) into another, read plus written bytes;
* host link each way: ``costs.measure_link`` (pinned copies on CUDA; on a CPU a copy between two host buffers);
* op overhead: the median time of a tiny elementwise op (dispatch and launch);
* memory: physical memory (the cgroup's limit when lower) on a CPU, ``total_memory`` on CUDA.

What the matmul reaches at that size is the calibrated "peak", not the vendor's: smaller matmuls reach less, so the
roofline of a step of small matmuls runs faster than the step (``experiments/bench/bench_roofline.py`` says by how
much). Each device is calibrated once per process.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from autockpt.core.devices import DeviceSpec
from autockpt.measure.costs import measure_link
from autockpt.measure.trace import synchronizer


def local_cpu_spec() -> DeviceSpec:
    """This machine's CPU as a ``DeviceSpec``, measured once per process."""
    return local_device_spec(torch.device("cpu"))


def local_device_spec(device: torch.device | str = "cpu") -> DeviceSpec:
    """``device`` (this machine's CPU, or a local CUDA device; the meta device is the CPU) as a ``DeviceSpec``,
    measured once per process."""
    return _calibrated(local_device(device))


def local_device(device: torch.device | str) -> torch.device:
    """Where a step of a model on ``device`` runs here: the device itself, the CPU for the meta device (which has
    no kernels), a CUDA device with its index."""
    device = torch.device(device)
    if device.type == "meta":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def local_spec_name(device: torch.device | str) -> str:
    """The name ``local_device_spec(device)`` gives its spec ("local-cpu", "local-cuda0"), known without
    calibrating."""
    device = local_device(device)
    return f"local-{device.type}" + (f"{device.index}" if device.type == "cuda" else "")


@functools.cache
def _calibrated(device: torch.device) -> DeviceSpec:
    on_cuda = device.type == "cuda"
    sync = synchronizer(device)
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if on_cuda else (torch.float32, torch.bfloat16)
    size = 4096 if on_cuda else 1024
    peaks = tuple((str(dtype).removeprefix("torch."), _matmul_tflops(device, dtype, size, sync)) for dtype in dtypes)
    copy_bytes = (256 if on_cuda else 64) * 2**20
    memory_gb_per_s = _copy_gb_per_s(device, copy_bytes, sync)
    link = measure_link(device)
    overhead_us = _op_overhead_us(device, sync)
    memory_bytes, memory_source = _memory_bytes(device)
    what = f"measured on this machine ({_device_name(device)}, torch {torch.__version__})"
    return DeviceSpec(
        name=local_spec_name(device),
        description=_device_name(device),
        memory_bytes=memory_bytes,
        peak_tflops=peaks,
        hbm_gb_per_s=memory_gb_per_s,
        host_to_device_gb_per_s=link.host_to_device_gb_per_s,
        device_to_host_gb_per_s=link.device_to_host_gb_per_s,
        op_overhead_us=overhead_us,
        link_latency_us=link.latency_ms * 1e3,
        copies_overlap_compute=link.overlaps_compute,
        device_type=device.type,
        source=(
            ("memory", memory_source),
            ("peak_tflops", f"{what}: the fastest of a few {size}x{size} matmuls per dtype"),
            ("hbm", f"{what}: the fastest copy of a {copy_bytes // 2**20} MiB buffer, read + written bytes"),
            ("host_link", f"{what}: autockpt.measure.costs.measure_link"),
            ("op_overhead", f"{what}: the median time of a tiny elementwise op"),
        ),
    )


def _fastest_s(run: Callable[[], None], sync: Callable[[], None], *, repeats: int, budget_s: float) -> float:
    """The fastest of up to ``repeats`` timed calls of ``run`` (after one warm-up), stopping after ``budget_s``."""
    run()
    sync()
    best = float("inf")
    started = time.perf_counter()
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - began)
        if time.perf_counter() - started > budget_s:
            break
    return max(best, 1e-9)


def _matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, sync: Callable[[], None]) -> float:
    generator = torch.Generator(device="cpu").manual_seed(0)  # the global RNG stays as the user left it
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    seconds = _fastest_s(lambda: torch.mm(a, b), sync, repeats=5, budget_s=0.3)
    return 2 * size**3 / seconds / 1e12


def _copy_gb_per_s(device: torch.device, nbytes: int, sync: Callable[[], None]) -> float:
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = _fastest_s(lambda: target.copy_(source), sync, repeats=5, budget_s=0.2)
    return 2 * nbytes / seconds / 1e9


def _op_overhead_us(device: torch.device, sync: Callable[[], None], *, ops: int = 200, repeats: int = 5) -> float:
    value = torch.ones(8, device=device)

    def chain() -> None:
        for _ in range(ops):
            torch.add(value, 1.0)

    chain()
    sync()
    runs = []
    for _ in range(repeats):
        began = time.perf_counter()
        chain()
        sync()
        runs.append((time.perf_counter() - began) / ops)
    return statistics.median(runs) * 1e6


def _memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, "torch.cuda.get_device_properties(device).total_memory"
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_limit_bytes()
    if limit is not None and limit < physical:
        return limit, "the cgroup's memory limit (/sys/fs/cgroup/memory.max), below the physical memory"
    return physical, "physical memory (os.sysconf SC_PHYS_PAGES x SC_PAGE_SIZE)"


def _cgroup_limit_bytes() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    threads_text = f"{threads} thread{'s' if threads != 1 else ''}"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {threads_text}"
    except OSError:
        pass
    return f"CPU, {threads_text}"
