"""StorageTracker: the live bytes of every storage a step's ops create, split into events (windows of the step).

A ``TorchDispatchMode`` sees every storage that ops create (the same accounting as
``torch.distributed._tools.mem_tracker.MemTracker``) and weak references tell when each one is freed. ``trace.py``
drives it through one tracked step (with ``saved_tensors_hooks`` and unit callbacks) to make the ``StepTrace``;
``step.py`` and ``loop.py`` measure real steps with it. ``GradientRecorder`` links forward storages to the
storages of their gradients (how long a region's output gradients live).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

from autockpt.types import OUTSIDE_GRAPH_UNIT, Phase

if TYPE_CHECKING:
    from typing_extensions import Self  # a dependency of torch's


@dataclass(slots=True, eq=False)
class StorageRecord:
    index: int
    nbytes: int
    phase: Phase
    producer_unit: int
    alloc_event: int
    last_use_event: int
    free_event: int | None = None
    users: set[int] = field(default_factory=set)
    mutators: set[int] = field(default_factory=set)
    release_event_by_saver: dict[int, int] = field(default_factory=dict)
    weak: Any = None
    # forward: storages of the gradients computed for it, per unit that wrote the version each is for
    # (``GradientRecorder``: an in-place op's output is a new version with a gradient of its own)
    gradients_by_writer: dict[int, list[StorageRecord]] = field(default_factory=dict)
    is_gradient: bool = False  # a gradient linked to a forward storage: its free event's later peak is followed
    late_peak_bytes: int | None = None  # gradients: the highest live bytes of the free event after the free
    autocast_cast: Any = None  # a weak reference to the leaf this is autocast's (cacheable) low-precision copy of


@dataclass(slots=True)
class _EventRecord:
    phase: Phase
    unit: int
    start_bytes: int
    peak_bytes: int
    pack_peak_bytes: int | None = None  # forward: peak up to the event's last pack for backward


# what tensor subclasses with a custom device or sizes (fake tensors: the device) dispatch when autograd or an op
# asks for their metadata; plain tensors answer without dispatching
_METADATA_QUERIES = frozenset({
    torch.ops.prim.device.default, torch.ops.prim.layout.default, torch.ops.aten.sym_size.default,
    torch.ops.aten.sym_stride.default, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default,
})

_CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator hands out multiples of this (MemTracker rounds the same way)


class StorageTracker(TorchDispatchMode):
    """Live bytes of every storage ops create on ``device``, split into events (windows of the step).

    On CUDA, sizes are rounded up to allocator blocks, device memory that no tracked tensor explains (cuBLAS
    workspaces, other tensors the process holds) is counted from the start, and every op's own high-water mark (read
    from the allocator's peak around it) raises its event's peak, so the figures are comparable with
    ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self, device: torch.device, static_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.device = device
        self.records: list[StorageRecord] = []
        self.events: list[_EventRecord] = []
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live_bytes = 0
        self._static_bytes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # static storage -> its bytes now
        self._plain_resize: Any = None  # torch.UntypedStorage.resize_ while this tracker is active
        self._freed_gradients: list[StorageRecord] = []  # gradients freed in the current event
        for tensor in (plain for given in static_tensors for plain in _plain_tensors(given)):
            storage = tensor.untyped_storage()  # counted from the start, never attributed to a unit
            if storage not in self._known:
                self._known[storage] = None
                self._static_bytes[storage] = self.allocation_bytes(storage)
                self.live_bytes += self._static_bytes[storage]
        self.static_bytes = self.live_bytes
        # the dtype autocast casts leaves to and caches on this device (None: autocast or its cache is off); read
        # here, outside the mode: inside it autocast reads as off
        self.cached_cast_dtype = (
            torch.get_autocast_dtype(device.type)
            if torch.is_autocast_enabled(device.type) and torch.is_autocast_cache_enabled()
            else None
        )
        if device.type == "cuda":
            self.live_bytes = max(self.live_bytes, torch.cuda.memory_allocated(device))
        self.begin_event(Phase.FORWARD, OUTSIDE_GRAPH_UNIT)

    def __enter__(self) -> Self:
        # FSDP2 frees and refills its unsharded parameters with UntypedStorage.resize_, which no dispatch mode
        # sees (MemTracker patches it the same way)
        self._plain_resize = torch.UntypedStorage.resize_
        plain, tracker = self._plain_resize, self

        @functools.wraps(plain)
        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = plain(storage, size)
            tracker._on_resize(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._plain_resize
        super().__exit__(*exc)

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        if storage not in self._known:
            return
        record, now = self._known[storage], self.allocation_bytes(storage)
        before = record.nbytes if record is not None else self._static_bytes[storage]
        if record is not None:
            record.nbytes = now
        else:
            self._static_bytes[storage] = now
        self.live_bytes += now - before
        current = self.events[-1]
        current.peak_bytes = max(current.peak_bytes, self.live_bytes)
        self._raise_late_peaks(self.live_bytes)

    def allocation_bytes(self, storage: torch.UntypedStorage) -> int:
        nbytes = storage.nbytes()
        if self.device.type == "cuda":
            return -(-nbytes // _CUDA_BLOCK_BYTES) * _CUDA_BLOCK_BYTES
        return nbytes

    @property
    def phase(self) -> Phase:
        return self.events[-1].phase

    @property
    def unit(self) -> int:
        return self.events[-1].unit

    def begin_event(self, phase: Phase, unit: int) -> None:
        self.events.append(_EventRecord(phase, unit, self.live_bytes, self.live_bytes))
        self._freed_gradients = []

    def _raise_late_peaks(self, live_bytes: int) -> None:
        for record in self._freed_gradients:
            record.late_peak_bytes = max(record.late_peak_bytes or 0, live_bytes)

    def record_of(self, tensor: torch.Tensor) -> StorageRecord | None:
        """The record of the storage behind ``tensor`` (a wrapper subclass's: its first inner tensor's)."""
        tensor = next(_plain_tensors(tensor), tensor)
        try:
            return self._known.get(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_QUERIES:  # reads no tensor data: no unit uses a storage by asking where it lives
            return func(*args, **kwargs)
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            allocated_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        out = func(*args, **kwargs)
        event = len(self.events) - 1
        if on_cuda:
            # the op's own high-water mark: its outputs and the buffers its kernels allocate and free inside it
            # (attention and cuBLAS workspaces, a loss's temporaries), which no storage the step sees explains
            rise = torch.cuda.max_memory_allocated(self.device) - allocated_before
            self.events[event].peak_bytes = max(self.events[event].peak_bytes, self.live_bytes + rise)
            self._raise_late_peaks(self.live_bytes + rise)
        if self.phase is Phase.FORWARD:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    record = self.record_of(leaf)
                    if record is not None:
                        record.users.add(self.unit)
                        record.last_use_event = event
            for leaf in _written_arguments(func, args, kwargs):
                record = self.record_of(leaf)
                if record is not None:
                    record.mutators.add(self.unit)
        cast = func is torch.ops.aten._to_copy.default and self._caches_cast_of(args)
        for leaf in (plain for value in pytree.tree_leaves(out) if isinstance(value, torch.Tensor)
                     for plain in _plain_tensors(value)):
            if leaf.device == self.device:
                record = self._register(leaf, event)
                if record is not None and cast and leaf.dtype == self.cached_cast_dtype:
                    record.autocast_cast = weakref.ref(args[0])
        return out

    def _caches_cast_of(self, args: tuple) -> bool:
        """Whether autocast caches a cast of ``args[0]``: a float32 leaf that requires grad (a parameter), not a
        view, while autocast and its cache are on (the conditions of ``cached_cast`` in ATen's autocast)."""
        source = args[0] if args else None
        return (
            self.cached_cast_dtype is not None
            and isinstance(source, torch.Tensor)
            and source.dtype == torch.float32
            and source.is_leaf
            and source.requires_grad
            and not source._is_view()
        )

    def _register(self, tensor: torch.Tensor, event: int) -> StorageRecord | None:
        """Start tracking the storage behind ``tensor`` (None: it is known already, or has none)."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        if storage in self._known:
            return None
        nbytes = self.allocation_bytes(storage)
        record = StorageRecord(len(self.records), nbytes, self.phase, self.unit, event, event)
        record.weak = weakref.ref(storage, functools.partial(self._on_free, record))
        self._known[storage] = record
        self.records.append(record)
        self.live_bytes += nbytes
        current = self.events[-1]
        current.peak_bytes = max(current.peak_bytes, self.live_bytes)
        self._raise_late_peaks(self.live_bytes)
        return record

    def _on_free(self, record: StorageRecord, _ref: Any) -> None:
        self.live_bytes -= record.nbytes
        record.free_event = len(self.events) - 1
        if record.is_gradient:
            record.late_peak_bytes = self.live_bytes
            self._freed_gradients.append(record)


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data: itself, or for a traceable wrapper subclass (DTensor, FSDP2's
    sharded parameters and their states) its inner tensors, whose storages are the ones allocated and freed (a
    wrapper's own storage is not)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # the names may include other attributes (a DTensor's mesh)
                yield from _plain_tensors(inner)
    else:
        yield tensor


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an op writes into in place (``relu_``, ``add_``, ``out=``), from its schema."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    return written


class GradientRecorder(TorchFunctionMode):
    """Links each forward storage to the storages of the gradients backward computes for tensors on it, so the
    profile knows how long those gradients lived (autockpt's checkpoint keeps a region's output gradients until the
    region's backward is done). Above autograd, where outputs can take a gradient hook; the hook holds the storage
    record, never the tensor."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.tracker.phase is Phase.FORWARD:
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                    record = self.tracker.record_of(leaf)
                    if record is not None and record.phase is Phase.FORWARD:
                        # the unit writing this version: an in-place op's output is a new version of its input's
                        # storage, whose gradient is another tensor than the old version's
                        leaf.register_hook(functools.partial(self._on_gradient, record, self.tracker.unit))
        return out

    def _on_gradient(self, record: StorageRecord, writer_unit: int, gradient: torch.Tensor | None) -> None:
        if gradient is None:  # an output backward gives no gradient (a multi-output op's unused part: a VAE's chunk)
            return
        gradient_record = self.tracker.record_of(gradient)
        if gradient_record is not None:
            record.gradients_by_writer.setdefault(writer_unit, []).append(gradient_record)
            gradient_record.is_gradient = True
