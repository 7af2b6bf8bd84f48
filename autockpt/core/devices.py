"""Device descriptions: what a roofline needs to know of an accelerator, and a table of common ones.

``DeviceSpec`` holds memory, dense peak TFLOPS per dtype, device-memory bandwidth and the host link each way, and
the public source of every figure. ``DEVICE_SPECS`` is the table; ``device_spec("h100-sxm-80gb")`` looks a name up
(a ``DeviceSpec`` passes through). The local device is calibrated by a short measurement instead
(``autockpt.measure.devices_local``).

Units: GB = 10^9 bytes, GB/s = 10^9 bytes per second, TFLOPS = 10^12 floating-point operations per second (a
multiply-add counts 2, as ``torch.utils.flop_counter`` counts). Every TFLOPS figure is the *dense* one: vendors print
the 2:4 structured-sparsity figure first (twice the dense one) for tensor-core dtypes; the table halves it. Memory is
the datasheet's capacity read as decimal GB (the parts hold binary gibibytes: an "80 GB" H100 SXM reports 85.0e9 bytes
to CUDA), which leaves the difference as headroom for the CUDA context and the allocator when it is a default budget.

The figures are the vendors' peaks, which kernels do not reach: on an H100 SXM (PyTorch 2.11, measured 2026-11-26)
8192-square matmuls ran at 787 TFLOPS in bfloat16 (80% of 989.4), 409 in TF32 (83%) and 51.6 in float32 (77%), and a
1 GiB device copy at 3.0 TB/s read plus written (90% of 3.35), so a roofline on the table is optimistic by 10 to 25%
before any overhead.

Host link figures are what a pinned copy reaches one way, not the bus's raw rate: PCIe 4.0 x16 moves 31.5 GB/s each
way on paper (16 GT/s x 16 lanes x 128/130), and NVIDIA's nvbandwidth measured 24.8 GB/s host to device on
A100-SXM4-80GB (forums.developer.nvidia.com/t/352186); the table uses 25 GB/s. PCIe 5.0 x16 doubles the raw rate
(63.0 GB/s each way); the table assumes the same ~79% of it, 50 GB/s.

The core imports no torch: dtypes are names ("float32", "bfloat16"; "torch.bfloat16" and torch dtypes are read by
their names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autockpt.units import GB

# dtypes the table knows; "tfloat32" is float32 matmuls on tensor cores (torch.backends.cuda.matmul.allow_tf32,
# off by default in PyTorch: a float32 model gets the "float32" peak)
DTYPES = ("float32", "tfloat32", "bfloat16", "float16")

# eager PyTorch spends microseconds of host time per op (dispatch and kernel launch); a kernel shorter than that
# waits for its launch. Measured on an H100 SXM machine (PyTorch 2.11, 2026-11-26): 8.2 us per asynchronous
# torch.add on 8 numbers (an nn.Linear call: 22.6 us). The table's GPUs all take this figure (``op_overhead_us``).
GPU_OP_OVERHEAD_US = 8.0
# the fixed cost of one host <-> device copy (cudaMemcpyAsync of a small buffer: launch and DMA set-up)
GPU_LINK_LATENCY_US = 10.0

PCIE4_GB_PER_S = 25.0
PCIE5_GB_PER_S = 50.0
_PCIE4 = (
    "PCIe 4.0 x16: 31.5 GB/s each way on paper; nvbandwidth measured 24.8 GB/s host to device on A100-SXM4-80GB "
    "(https://forums.developer.nvidia.com/t/asymmetric-pcie-bandwidth-in-bidirectional-transfers-h2d-drops-56-while-"
    "d2h-maintains-performance/352186); 25 GB/s used"
)
_PCIE5 = (
    "PCIe 5.0 x16: 63.0 GB/s each way on paper (32 GT/s x 16 lanes x 128/130); 50 GB/s used, the ~79% of the raw "
    "rate that pinned copies reach on PCIe 4.0 (an H100 SXM measured here, 2026-11-26: 1 GiB pinned copies at "
    "49.0 GB/s to the device, 55.0 from it)"
)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16``, ``"torch.bfloat16"`` and ``"bfloat16"`` -> ``"bfloat16"`` (also "bf16", "fp32", ...)."""
    name = str(dtype).removeprefix("torch.").lower()
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "tf32": "tfloat32"}.get(name, name)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """What a roofline needs to know of a device: memory, dense peak TFLOPS per dtype, memory bandwidth, the host
    link each way, and where each figure comes from.

    ``peak_tflops``: (dtype name, dense TFLOPS) pairs, e.g. ``(("float32", 66.9), ("bfloat16", 989.4))``.
    ``op_overhead_us``: host time per op (dispatch and launch), added to every unit's roofline time.
    ``link_latency_us``: fixed cost of one host <-> device copy. ``copies_overlap_compute``: copies run beside the
    compute (a GPU's copy engines); False on a CPU, whose "link" is a memcpy on the same cores.
    ``source``: (figure, where it comes from) pairs: a datasheet URL, or "measured on this machine: ...".
    GB = 10^9 bytes.
    """

    name: str
    memory_bytes: int
    peak_tflops: tuple[tuple[str, float], ...]
    hbm_gb_per_s: float  # device-memory bandwidth (HBM, GDDR; DRAM for a CPU)
    host_to_device_gb_per_s: float
    device_to_host_gb_per_s: float
    source: tuple[tuple[str, str], ...]
    description: str = ""
    op_overhead_us: float = GPU_OP_OVERHEAD_US
    link_latency_us: float = GPU_LINK_LATENCY_US
    copies_overlap_compute: bool = True
    aliases: tuple[str, ...] = field(default=())
    # the torch device type the device runs as ("cuda" for NVIDIA and ROCm GPUs): what torch's defaults follow, e.g.
    # an optimizer's foreach implementation, whose temporaries a plan for the device counts
    device_type: str = "cuda"
    # the GPU-to-GPU link each way, per GPU (GB/s): what a ring all-gather or reduce-scatter among the node's GPUs
    # moves through each one (FSDP's collectives, ``autockpt.fsdp``); None: not known (collectives priced at 0)
    interconnect_gb_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a DeviceSpec needs a name")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(
                f"DeviceSpec {self.name!r}: memory_bytes must be a positive int, got {self.memory_bytes!r}"
            )
        if not self.peak_tflops:
            raise ValueError(
                f"DeviceSpec {self.name!r}: give peak_tflops for at least one dtype, e.g. (('float32', 20.0),)"
            )
        for dtype, tflops in self.peak_tflops:
            if dtype_name(dtype) != dtype:
                raise ValueError(f"DeviceSpec {self.name!r}: dtype {dtype!r} must be written {dtype_name(dtype)!r}")
            if not math.isfinite(tflops) or tflops <= 0:
                raise ValueError(f"DeviceSpec {self.name!r}: peak TFLOPS of {dtype} must be positive, got {tflops!r}")
        for figure in ("hbm_gb_per_s", "host_to_device_gb_per_s", "device_to_host_gb_per_s"):
            value = getattr(self, figure)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {figure} must be positive, got {value!r}")
        if self.interconnect_gb_per_s is not None and (
                not math.isfinite(self.interconnect_gb_per_s) or self.interconnect_gb_per_s <= 0):
            raise ValueError(
                f"DeviceSpec {self.name!r}: interconnect_gb_per_s must be positive or None, got "
                f"{self.interconnect_gb_per_s!r}"
            )
        if self.op_overhead_us < 0 or self.link_latency_us < 0:
            raise ValueError(f"DeviceSpec {self.name!r}: op_overhead_us and link_latency_us must be >= 0")

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(dtype for dtype, _ in self.peak_tflops)

    def tflops(self, dtype: Any) -> float:
        """Dense peak TFLOPS for ``dtype`` (a name or a torch dtype); float16 falls back to bfloat16's figure and
        back (the same tensor-core rate on every device of the table)."""
        name = dtype_name(dtype)
        table = dict(self.peak_tflops)
        for candidate in (name, {"float16": "bfloat16", "bfloat16": "float16"}.get(name)):
            if candidate in table:
                return table[candidate]
        raise ValueError(
            f"DeviceSpec {self.name!r} has no peak TFLOPS for {name!r}; it has {', '.join(self.dtypes)}. Plan with "
            "timing='measured', or give a DeviceSpec with that dtype in peak_tflops"
        )

    def source_of(self, figure: str) -> str:
        """Where ``figure`` ("memory", "peak_tflops", "hbm", "host_link", ...) comes from."""
        for name, text in self.source:
            if name == figure:
                return text
        raise KeyError(f"DeviceSpec {self.name!r} names no source for {figure!r}; it has {[n for n, _ in self.source]}")

    def describe(self) -> str:
        peaks = ", ".join(f"{d} {t:g}" for d, t in self.peak_tflops)
        return (
            f"{self.name}{f' ({self.description})' if self.description else ''}: {self.memory_bytes / GB:g} GB, "
            f"dense TFLOPS {peaks}, memory {self.hbm_gb_per_s:g} GB/s, host link {self.host_to_device_gb_per_s:g} / "
            f"{self.device_to_host_gb_per_s:g} GB/s (to / from the device), {self.op_overhead_us:g} us per op"
        )


def _gpu(
    name: str, description: str, *, memory_gb: float, tflops: dict[str, float], hbm: float, link: float,
    sources: dict[str, str], aliases: tuple[str, ...] = (), interconnect: tuple[float, str] | None = None,
) -> DeviceSpec:
    link_source = _PCIE5 if link == PCIE5_GB_PER_S else _PCIE4
    # without NVLink (or Infinity Fabric) the GPUs talk over their PCIe link
    peer_gb_per_s, peer_source = interconnect or (link, f"no GPU-to-GPU link: over PCIe, {link_source}")
    return DeviceSpec(
        name=name, description=description, memory_bytes=int(memory_gb * GB),
        peak_tflops=tuple((d, tflops[d]) for d in DTYPES if d in tflops), hbm_gb_per_s=hbm,
        host_to_device_gb_per_s=link, device_to_host_gb_per_s=link,
        source=(*sources.items(), ("host_link", link_source),
                ("op_overhead", (f"{GPU_OP_OVERHEAD_US:g} us per op: an asynchronous torch.add on an H100 SXM "
                                 "host, measured 2026-11-26 (8.2 us)")),
                ("interconnect", peer_source)),
        aliases=aliases, interconnect_gb_per_s=peer_gb_per_s,
    )


_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H100_COPY = "NVIDIA's H100 SXM/PCIe table as copied at https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"
_A100 = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_MI300X = (
    "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"
)
_L4 = "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"
_A10G = "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/"
_HALVED = "the datasheet's figure with sparsity, halved"
_NVLINK4 = (450.0, f"NVLink 4: 900 GB/s per GPU, both ways together (18 links), 450 each way: {_H100}")
_NVLINK4_H200 = (450.0, ("NVLink 4: 900 GB/s per GPU, both ways together, 450 each way: "
                        "https://www.nvidia.com/en-us/data-center/h200/"))
_NVLINK3 = (300.0, f"NVLink 3: 600 GB/s per GPU, both ways together (12 links), 300 each way: {_A100}")
_INFINITY_FABRIC = (448.0, ("Infinity Fabric: 7 links of 128 GB/s both ways together (896 GB/s peer to peer), 448 each "
                           f"way to all peers together (a single ring uses less): {_MI300X}"))

DEVICE_SPECS: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    _gpu("h100-sxm-80gb", "NVIDIA H100 SXM5 80 GB", interconnect=_NVLINK4, memory_gb=80, hbm=3350, link=PCIE5_GB_PER_S,
         tflops={"float32": 66.9, "tfloat32": 494.7, "bfloat16": 989.4, "float16": 989.4},
         sources={"memory": f"80 GB HBM3: {_H100}", "hbm": f"3.35 TB/s: {_H100}",
                  "peak_tflops": f"BF16/FP16 1,979 and TF32 989 TFLOPS with sparsity, {_HALVED}; FP32 67: {_H100}; "
                                 f"also {_H100_COPY}"},
         aliases=("h100", "h100-sxm")),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80 GB", memory_gb=80, hbm=2000, link=PCIE5_GB_PER_S,
         tflops={"float32": 51.0, "tfloat32": 378.0, "bfloat16": 756.0, "float16": 756.0},
         sources={"memory": f"80 GB HBM2e: {_H100_COPY}",
                  "hbm": "2,000 GB/s: NVIDIA H100 PCIe product brief PB-11133-001 ('greater than 2,000 GBps'); "
                         f"{_H100_COPY}",
                  "peak_tflops": f"BF16/FP16 1,513 and TF32 756 TFLOPS with sparsity, {_HALVED}; FP32 51: "
                                 f"{_H100_COPY}"},
         aliases=("h100-pcie-80gb",)),
    _gpu("h200", "NVIDIA H200 SXM 141 GB", interconnect=_NVLINK4_H200, memory_gb=141, hbm=4800, link=PCIE5_GB_PER_S,
         tflops={"float32": 66.9, "tfloat32": 494.7, "bfloat16": 989.4, "float16": 989.4},
         sources={"memory": "141 GB HBM3e: https://www.nvidia.com/en-us/data-center/h200/",
                  "hbm": "4.8 TB/s: https://www.nvidia.com/en-us/data-center/h200/",
                  "peak_tflops": "BF16/FP16 1,979 TFLOPS with sparsity (the H100 SXM's compute, same GH100), "
                                 f"{_HALVED}: https://www.nvidia.com/en-us/data-center/h200/"},
         aliases=("h200-sxm", "h200-141gb")),
    _gpu("a100-80gb", "NVIDIA A100 SXM4 80 GB", interconnect=_NVLINK3, memory_gb=80, hbm=2039, link=PCIE4_GB_PER_S,
         tflops={"float32": 19.5, "tfloat32": 156.0, "bfloat16": 312.0, "float16": 312.0},
         sources={"memory": f"80 GB HBM2e: {_A100}", "hbm": f"2,039 GB/s (SXM): {_A100}",
                  "peak_tflops": f"BF16/FP16 312, TF32 156 (dense), FP32 19.5 TFLOPS: {_A100}"},
         aliases=("a100-sxm-80gb", "a100")),
    _gpu("a100-40gb", "NVIDIA A100 SXM4 40 GB", interconnect=_NVLINK3, memory_gb=40, hbm=1555, link=PCIE4_GB_PER_S,
         tflops={"float32": 19.5, "tfloat32": 156.0, "bfloat16": 312.0, "float16": 312.0},
         sources={"memory": f"40 GB HBM2: {_A100}", "hbm": f"1,555 GB/s: {_A100}",
                  "peak_tflops": f"BF16/FP16 312, TF32 156 (dense), FP32 19.5 TFLOPS: {_A100}"},
         aliases=("a100-sxm-40gb",)),
    _gpu("l4", "NVIDIA L4 24 GB", memory_gb=24, hbm=300, link=PCIE4_GB_PER_S,
         tflops={"float32": 30.3, "tfloat32": 60.0, "bfloat16": 121.0, "float16": 121.0},
         sources={"memory": f"24 GB GDDR6: {_L4}", "hbm": f"300 GB/s: {_L4}",
                  "peak_tflops": f"BF16/FP16 242 and TF32 120 TFLOPS with sparsity, {_HALVED}; FP32 30.3: {_L4}"}),
    _gpu("a10g", "NVIDIA A10G 24 GB (AWS G5)", memory_gb=24, hbm=600, link=PCIE4_GB_PER_S,
         tflops={"float32": 35.0, "tfloat32": 35.0, "bfloat16": 70.0, "float16": 70.0},
         sources={"memory": f"24 GB GDDR6: {_A10G}", "hbm": f"600 GB/s: {_A10G}",
                  "peak_tflops": "BF16/FP16 70 (dense, FP32 accumulate), TF32 35, FP32 35 TFLOPS: third-party; AWS "
                                 f"and NVIDIA publish no A10G datasheet: {_A10G}"}),
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24 GB", memory_gb=24, hbm=1008, link=PCIE4_GB_PER_S,
         tflops={"float32": 82.6, "tfloat32": 82.6, "bfloat16": 165.2, "float16": 165.2},
         sources={"memory": f"24 GB GDDR6X: {_ADA}", "hbm": f"1,008 GB/s: {_ADA}",
                  "peak_tflops": "BF16/FP16 tensor 165.2 TFLOPS with FP32 accumulate (dense; 330.4 with sparsity), "
                                 f"TF32 82.6, FP32 82.6 (Ada whitepaper, appendix table): {_ADA}"},
         aliases=("4090",)),
    _gpu("mi300x", "AMD Instinct MI300X 192 GB", interconnect=_INFINITY_FABRIC, memory_gb=192, hbm=5300, link=PCIE5_GB_PER_S,
         tflops={"float32": 163.4, "tfloat32": 653.7, "bfloat16": 1307.4, "float16": 1307.4},
         sources={"memory": f"192 GB HBM3: {_MI300X}", "hbm": f"5.3 TB/s: {_MI300X}",
                  "peak_tflops": f"BF16/FP16 1,307.4 (dense; 2,614.9 with sparsity), TF32 653.7, FP32 matrix 163.4: "
                                 f"{_MI300X}"}),
)}


def device_spec(name_or_spec: str | DeviceSpec) -> DeviceSpec:
    """The table's ``DeviceSpec`` named ``name_or_spec`` (case, '_' and spaces ignored; aliases such as "h100"
    accepted), or the ``DeviceSpec`` itself."""
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise TypeError(
            f"a device target is a table name ({', '.join(DEVICE_SPECS)}) or an autockpt.DeviceSpec, got "
            f"{type(name_or_spec).__name__}"
        )
    key = name_or_spec.strip().lower().replace("_", "-").replace(" ", "-")
    for spec in DEVICE_SPECS.values():
        if key == spec.name or key in spec.aliases:
            return spec
    raise ValueError(
        f"unknown device {name_or_spec!r}: the table has {', '.join(DEVICE_SPECS)} (autockpt.core.devices."
        "DEVICE_SPECS); for another device give an autockpt.DeviceSpec(name=..., memory_bytes=..., peak_tflops=..., "
        "hbm_gb_per_s=..., host_to_device_gb_per_s=..., device_to_host_gb_per_s=..., source=...)"
    )
