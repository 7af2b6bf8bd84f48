"""Roofline times: a step's unit times from its FLOPs and bytes moved against a ``DeviceSpec``, without running it.

Per unit of the forward pass::

    forward_ms = max(flops / peak TFLOPS of the dtype, bytes moved / memory GB/s) + op overhead

* FLOPs are the trace's (``UnitCost.flops``, torch's FLOP counter: matmuls, convolutions, attention; an elementwise
  op counts 0 and is bounded by its bytes).
* Bytes moved are what the unit reads and writes of the step's storages: every storage it reads in forward
  (``StorageLife.user_units``) or writes in place (``mutator_units``), what it allocates (``UnitCost.output_bytes``),
  and the parameters and buffers it reads (``parameter_read_bytes``, from the graph: the trace does not record them).
  A unit that allocates nothing and writes nothing in place is a view or a metadata op: it moves no bytes and costs
  its overhead alone.
* The op overhead is ``DeviceSpec.op_overhead_us``: one op per unit (an fx node is one torch call).
* Backward: autograd computes two products per matmul (the input's and the weight's gradient), so twice the forward
  FLOPs, and reads and writes about twice the bytes; ``BACKWARD_FACTOR`` = 2 for every unit, so
  ``step_ms = (1 + BACKWARD_FACTOR) * forward_ms``. The loss function and autograd's own work are not counted.

The result is the trace with these times (``forward_ms_timed_at`` None: every unit has its own): the memory events
are untouched, so the simulator and the solvers plan exactly as from a measured trace. ``link_price`` prices the
host link of offloading from the spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autockpt.core.devices import DeviceSpec
from autockpt.types import LinkPrice, StepTrace

BACKWARD_FACTOR = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UnitRoofline:
    """One unit's roofline: which bound it hit and its time."""

    index: int
    flops: int
    bytes_moved: int
    compute_ms: float
    memory_ms: float
    overhead_ms: float

    @property
    def forward_ms(self) -> float:
        return max(self.compute_ms, self.memory_ms) + self.overhead_ms

    @property
    def bound(self) -> str:
        """"compute", "memory" or "overhead" (the largest of the three parts)."""
        parts = {"compute": self.compute_ms, "memory": self.memory_ms, "overhead": self.overhead_ms}
        return max(parts, key=parts.__getitem__)


def bytes_moved(trace: StepTrace, parameter_read_bytes: Sequence[int] | None = None) -> list[int]:
    """Per unit, the bytes its forward reads and writes (see the module's docstring)."""
    count = len(trace.units)
    read = [0] * count
    written = [unit.output_bytes for unit in trace.units]
    for storage in trace.storages:
        for unit in set(storage.user_units):
            if 0 <= unit < count:
                read[unit] += storage.nbytes
        for unit in set(storage.mutator_units):
            if 0 <= unit < count:
                written[unit] += storage.nbytes
    if parameter_read_bytes is not None:
        if len(parameter_read_bytes) != count:
            raise ValueError(f"parameter_read_bytes has {len(parameter_read_bytes)} entries for {count} units")
        read = [r + p for r, p in zip(read, parameter_read_bytes)]
    return [r + w if w > 0 else 0 for r, w in zip(read, written)]  # nothing written: a view, no traffic


def unit_rooflines(
    trace: StepTrace, spec: DeviceSpec, dtype: Any, *, parameter_read_bytes: Sequence[int] | None = None
) -> list[UnitRoofline]:
    """Each unit's roofline on ``spec`` for ``dtype`` (its dense peak TFLOPS)."""
    flop_per_ms = spec.tflops(dtype) * 1e9  # TFLOPS = 1e12 per second = 1e9 per millisecond
    byte_per_ms = spec.hbm_gb_per_s * 1e6  # GB/s = 1e9 bytes per second = 1e6 per millisecond
    overhead_ms = spec.op_overhead_us / 1e3
    return [
        UnitRoofline(
            index=unit.index, flops=unit.flops, bytes_moved=moved, compute_ms=unit.flops / flop_per_ms,
            memory_ms=moved / byte_per_ms, overhead_ms=overhead_ms,
        )
        for unit, moved in zip(trace.units, bytes_moved(trace, parameter_read_bytes))
    ]


def roofline_trace(
    trace: StepTrace, spec: DeviceSpec, dtype: Any, *, parameter_read_bytes: Sequence[int] | None = None,
    backward_factor: float = BACKWARD_FACTOR,
) -> StepTrace:
    """``trace`` with its unit times, forward time and step time replaced by the roofline of ``spec``."""
    rooflines = unit_rooflines(trace, spec, dtype, parameter_read_bytes=parameter_read_bytes)
    units = tuple(
        dataclasses.replace(unit, forward_ms=line.forward_ms, forward_ms_timed_at=None)
        for unit, line in zip(trace.units, rooflines)
    )
    forward_ms = sum(line.forward_ms for line in rooflines)
    return dataclasses.replace(trace, units=units, forward_ms=forward_ms, step_ms=forward_ms * (1.0 + backward_factor))


def link_price(spec: DeviceSpec) -> LinkPrice:
    """The host link of ``spec`` as the cost model prices offloading (``LinkPrice``)."""
    return LinkPrice(
        device_to_host_gb_per_s=spec.device_to_host_gb_per_s, host_to_device_gb_per_s=spec.host_to_device_gb_per_s,
        latency_ms=spec.link_latency_us / 1e3, overlaps_compute=spec.copies_overlap_compute,
    )
