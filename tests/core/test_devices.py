"""The device table (issue 36, item 2): lookup, its error, a source for every figure, units, and the roofline on it."""

from __future__ import annotations

import dataclasses

import pytest

import autockpt
from autockpt.core.devices import DEVICE_SPECS, DTYPES, DeviceSpec, device_spec, dtype_name
from autockpt.core.roofline import BACKWARD_FACTOR, bytes_moved, link_price, roofline_trace, unit_rooflines
from autockpt.types import MemoryEvent, Phase, StepTrace, StorageLife, UnitCost
from autockpt.units import GB

REQUIRED = ("h100-sxm-80gb", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "l4", "a10g", "rtx-4090", "mi300x")


def test_the_table_has_the_issues_devices_and_the_facade_exports_devicespec() -> None:
    assert set(REQUIRED) <= set(DEVICE_SPECS)
    assert autockpt.DeviceSpec is DeviceSpec and "DeviceSpec" in autockpt.__all__


@pytest.mark.parametrize("name", sorted(DEVICE_SPECS))
def test_every_spec_names_a_source_for_every_figure_and_has_sane_units(name: str) -> None:
    spec = DEVICE_SPECS[name]
    figures = dict(spec.source)
    for figure in ("memory", "peak_tflops", "hbm", "host_link", "op_overhead"):
        assert figures.get(figure), f"{name}: no source for {figure}"
    for figure in ("memory", "peak_tflops", "hbm"):
        assert "http" in figures[figure] or "product brief" in figures[figure], (name, figure)
    # GB = 10^9 bytes: every accelerator of the table holds between 16 and 200 GB
    assert 16 * GB <= spec.memory_bytes <= 200 * GB and spec.memory_bytes % GB == 0
    assert 200 <= spec.hbm_gb_per_s <= 6000  # GB/s
    assert 10 <= spec.host_to_device_gb_per_s <= 64 and 10 <= spec.device_to_host_gb_per_s <= 64
    assert set(spec.dtypes) <= set(DTYPES) and "float32" in spec.dtypes and "bfloat16" in spec.dtypes
    # dense figures: a tensor-core dtype is at least the float32 rate and at most 20 times it (the H100's 989 / 67
    # is 14.8; a sparse figure read as dense would give 29.6)
    assert spec.tflops("float32") <= spec.tflops("bfloat16") <= 20 * spec.tflops("float32")
    assert spec.tflops("torch.float16") == spec.tflops("bfloat16")
    assert spec.describe().startswith(name)


def test_dense_figures_match_the_datasheets_halved_sparse_ones() -> None:
    assert device_spec("h100-sxm-80gb").tflops("bfloat16") == pytest.approx(989.4)
    assert device_spec("h100-pcie").tflops("bf16") == pytest.approx(756)
    assert device_spec("h200").hbm_gb_per_s == 4800 and device_spec("h200").memory_bytes == 141 * GB
    assert device_spec("a100-40gb").hbm_gb_per_s == 1555 and device_spec("a100-80gb").hbm_gb_per_s == 2039
    assert device_spec("l4").tflops("bfloat16") == pytest.approx(121)
    assert device_spec("rtx-4090").tflops("bfloat16") == pytest.approx(165.2)
    assert device_spec("mi300x").tflops("bfloat16") == pytest.approx(1307.4)


def test_lookup_accepts_aliases_case_and_a_spec_and_its_error_lists_the_table() -> None:
    assert device_spec("H100") is device_spec("h100_sxm_80gb") is DEVICE_SPECS["h100-sxm-80gb"]
    spec = DEVICE_SPECS["l4"]
    assert device_spec(spec) is spec
    with pytest.raises(ValueError) as raised:
        device_spec("tpu-v5")
    message = str(raised.value)
    assert "tpu-v5" in message and all(name in message for name in REQUIRED) and "DeviceSpec(" in message
    with pytest.raises(TypeError, match="table name"):
        device_spec(80)
    with pytest.raises(ValueError, match="has no peak TFLOPS for 'float64'; it has float32"):
        spec.tflops("float64")


def test_a_spec_checks_its_figures() -> None:
    good = DEVICE_SPECS["l4"]
    with pytest.raises(ValueError, match="memory_bytes"):
        dataclasses.replace(good, memory_bytes=0)
    with pytest.raises(ValueError, match="must be written 'bfloat16'"):
        dataclasses.replace(good, peak_tflops=(("torch.bfloat16", 1.0),))
    with pytest.raises(ValueError, match="hbm_gb_per_s"):
        dataclasses.replace(good, hbm_gb_per_s=-1.0)
    assert dtype_name("torch.bfloat16") == dtype_name("bf16") == "bfloat16"


def _trace() -> StepTrace:
    """Three units: a matmul (1e9 FLOPs, writes 4 MB), a view (allocates nothing) and an elementwise op reading the
    matmul's output (4 MB in, 4 MB out)."""
    units = (
        UnitCost(index=0, forward_ms=1.0, flops=10**9, output_bytes=4 * 10**6, saved_bytes=0),
        UnitCost(index=1, forward_ms=1.0, flops=0, output_bytes=0, saved_bytes=0),
        UnitCost(index=2, forward_ms=1.0, flops=0, output_bytes=4 * 10**6, saved_bytes=0, forward_ms_timed_at=0),
    )
    storages = (
        StorageLife(index=0, nbytes=4 * 10**6, producer_unit=0, alloc_event=0, last_forward_use_event=2,
                    free_event=None, user_units=(1, 2), saver_units=(), saver_release_events=()),
    )
    events = tuple(MemoryEvent(index=i, phase=Phase.FORWARD, unit=i, start_bytes=0, peak_bytes=1) for i in range(3))
    return StepTrace(units=units, storages=storages, events=events, parameter_bytes=0, buffer_bytes=0, input_bytes=0,
                     gradient_bytes=0, baseline_peak_bytes=1, forward_ms=3.0, step_ms=9.0)


def test_roofline_times_are_the_bound_plus_the_overhead_and_backward_is_twice_forward() -> None:
    spec = DEVICE_SPECS["h100-sxm-80gb"]
    trace = _trace()
    assert bytes_moved(trace, [2 * 10**6, 0, 0]) == [6 * 10**6, 0, 8 * 10**6]
    lines = unit_rooflines(trace, spec, "bfloat16", parameter_read_bytes=[2 * 10**6, 0, 0])
    assert lines[0].compute_ms == pytest.approx(1e9 / 989.4e12 * 1e3) and lines[0].bound == "overhead"
    assert lines[1].forward_ms == pytest.approx(spec.op_overhead_us / 1e3) and lines[1].memory_ms == 0
    assert lines[2].memory_ms == pytest.approx(8e6 / 3350e9 * 1e3)
    timed = roofline_trace(trace, spec, "bfloat16", parameter_read_bytes=[2 * 10**6, 0, 0])
    assert [u.forward_ms for u in timed.units] == pytest.approx([line.forward_ms for line in lines])
    assert all(u.forward_ms_timed_at is None for u in timed.units)
    assert timed.forward_ms == pytest.approx(sum(u.forward_ms for u in timed.units))
    assert timed.step_ms == pytest.approx((1 + BACKWARD_FACTOR) * timed.forward_ms)
    assert timed.events == trace.events and timed.storages == trace.storages  # memory untouched
    # a slower device, and float32 on it, take longer
    slow = roofline_trace(trace, DEVICE_SPECS["l4"], "bfloat16")
    assert slow.step_ms > roofline_trace(trace, spec, "bfloat16").step_ms
    assert roofline_trace(trace, spec, "float32").units[0].forward_ms > timed.units[0].forward_ms


def test_roofline_time_grows_with_flops() -> None:
    spec = dataclasses.replace(DEVICE_SPECS["a100-80gb"], op_overhead_us=0.0)
    trace = _trace()
    times = []
    for flops in (10**9, 10**10, 10**11, 10**12):
        units = (dataclasses.replace(trace.units[0], flops=flops), *trace.units[1:])
        times.append(roofline_trace(dataclasses.replace(trace, units=units), spec, "bfloat16").units[0].forward_ms)
    assert times == sorted(times) and times[-1] == pytest.approx(1e12 / 312e12 * 1e3)


def test_the_link_price_is_the_specs() -> None:
    link = link_price(DEVICE_SPECS["h100-sxm-80gb"])
    assert link.host_to_device_gb_per_s == 50 and link.overlaps_compute
    assert link.host_to_device_ms(50 * 10**9) == pytest.approx(1000 + link.latency_ms)
