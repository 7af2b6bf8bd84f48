"""Offload: the runtime of the offload action, which keeps what a region saves for backward in host memory.

A region's forward runs inside ``HostPool.offloading(region_index)``: ``torch.autograd.graph.saved_tensors_hooks``
hands every tensor autograd saves to the pool, which copies the tensor's storage into one host buffer (allocated
once, pinned when the device is CUDA, reused every step) and gives autograd a small handle instead; backward turns
the handles back into tensors on the device. ``HostPool.begin_step()`` starts every forward. Regions are numbered in
forward order; backward reaches them from the highest number down.

The rules, exact so that the simulator can predict device bytes and pool size (constants of this module):

What is moved. Every tensor packed inside ``offloading`` except these, kept as autograd keeps them (the pack hook
returns the tensor, or an alias of it without autograd history):

* a leaf that requires grad, an ``nn.Parameter`` (frozen too), or a view of one (``t._base``): torch hands the pack
  hook views such as ``weight.t()`` for a Linear, not the parameter;
* a dtype copy of such a leaf (autocast's low-precision weight, ``ToCopyBackward0`` of the leaf): autocast caches it
  for as long as its context lasts, so moving it would free nothing;
* anything but a plain strided ``torch.Tensor`` on the pool's device: other devices, subclasses other than
  ``nn.Parameter``, sparse, nested and quantized tensors, tensors with the negative bit;
* a tensor whose storage is smaller than ``MIN_STORAGE_BYTES`` (1 KiB);
* a tensor on the storage of one of the tensors passed to ``begin_step(kept=...)``: what exists before the step
  and outlives it (the rewriter passes the step's inputs and the model's buffers), which moving would not free.

Everything else is moved: activations (autocast's casts of them too), dropout masks, and (unless passed as
``kept``) buffers of 1 KiB or more that a region saves (BatchNorm's running statistics) and the batch. A moved tensor
whose storage something else still holds (the model, a later use in forward) keeps that storage alive on the
device as well: then the move costs copies and saves nothing.

Slots. The unit moved is the tensor's whole untyped storage. A step gets one slot per distinct (storage, version)
it moves: views of one storage packed in one step share a slot, across regions too; a storage packed again after an
in-place change gets a new slot (autograd forbids changing a saved tensor, so this does not happen in programs it
accepts). A storage of ``n`` bytes takes ``slot_bytes(n) = ceil(n / SLOT_ALIGNMENT_BYTES) * SLOT_ALIGNMENT_BYTES``;
slots are laid out in pack order from offset 0 at each ``begin_step``, so a step needs ``capacity_bytes`` = the sum
of ``slot_bytes`` over the distinct storages it moves (``PoolStats.peak_occupancy_bytes`` is the largest such sum
seen). A slot that does not fit raises ``PoolCapacityError`` in forward before anything is copied.

When device memory is freed.

* Forward on CPU: the copy is synchronous inside the pack hook, and the pool keeps no reference to the storage.
* Forward on CUDA: the copy runs ``non_blocking`` on the pool's copy stream after the compute stream's work so far,
  and the pool holds the storage until an event recorded after the copy has completed (held references rather than
  ``record_stream``: the caching allocator then reports the bytes as allocated until they really are free, and
  nothing is reused early). Completed copies are dropped at every pack and region exit, and at a region's exit the
  host waits for the copies of the region entered before it, so the host cannot run more than one region ahead of
  the link. A moved storage is therefore released at the latest at the exit of the next region entered; the last
  region's at the next ``prefetch``, unpack or ``begin_step``.
* Backward (both): a storage is restored into a freshly allocated device storage when a region that saved it is
  prefetched: by ``prefetch(i)``; when the first tensor of the next higher region holding slots is unpacked (one
  region ahead); or at its own first unpack (a demand fetch, counted in ``PoolStats.copy_waits``). On CUDA the copy
  runs on a second stream and an unpack makes the compute stream wait on its event; on CPU it is synchronous. The
  pool drops the restored storage once every tensor packed from it has been unpacked once; autograd frees it after
  its last use, as it frees saved tensors.

Steps. One forward and its backward at a time. ``begin_step`` never fails on what the last step left behind: a
forward under ``torch.no_grad()`` packs nothing, and a graph built and dropped without backward (validation without
``no_grad``) leaves slots that are simply reused. A tensor packed in an earlier step, whose host slot the new step
may have overwritten, raises ``OffloadError`` when unpacked: gradient accumulation must run each micro-batch's
backward before the next forward (as Hugging Face's loop does). A second backward through a retained graph before
the next ``begin_step`` works: its storages are fetched again from the host, one demand fetch each.

Like ``torch.autograd.graph.save_on_cpu``, torch skips its check that a saved tensor was not changed in place when
hooks pack it; a moved tensor comes back with the values it had when it was packed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

# the pool's rules live in the planning core, which predicts them without importing this runtime
from autockpt.core.offload_model import MIN_STORAGE_BYTES, SLOT_ALIGNMENT_BYTES, slot_bytes  # noqa: F401

logger = logging.getLogger(__name__)



class OffloadError(RuntimeError):
    """The offload runtime cannot go on as asked; the message says why and what to change."""


class PoolCapacityError(OffloadError):
    """A step moves more bytes than the host pool holds. ``needed_bytes`` is what the step needed when it stopped
    (a lower bound on the whole step's need)."""

    def __init__(self, message: str, *, needed_bytes: int, capacity_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes


def available_host_bytes() -> int:
    """Host memory the system can give without swapping (Linux ``MemAvailable``; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Cumulative over the pool's life, except ``peak_occupancy_bytes`` (the largest step)."""

    bytes_in: int  # copied device -> host (storage bytes, not slot bytes)
    bytes_out: int  # copied host -> device
    peak_occupancy_bytes: int  # the largest sum of slot bytes one step used
    copy_waits: int  # restores an unpack had to start itself: no prefetch came first
    steps: int  # begin_step calls
    allocations: int  # host buffers allocated: 1 for the pool's life
    tensors_moved: int
    tensors_kept: int


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """One slot of the current step, in pack order."""

    region_index: int  # the region that packed the storage first
    offset_bytes: int
    storage_bytes: int
    slot_bytes: int
    source_data_ptr: int  # the device storage's address when it was packed


def moves(tensor: torch.Tensor, device: torch.device, *, fake: bool = False) -> bool:
    """Whether a pool on ``device`` moves ``tensor`` when a region saves it (the rules above); ``fake``: a pool
    measuring under ``FakeTensorMode``, where a plain tensor is a ``FakeTensor``."""
    plain = type(tensor) is torch.Tensor or (fake and type(tensor) is _fake_tensor_type())
    if not plain or tensor.device != device:  # Parameter included: it is kept
        return False
    if tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized or tensor.is_neg():
        return False
    if tensor.requires_grad and tensor.grad_fn is None:
        return False
    base = tensor._base
    if base is not None and (isinstance(base, nn.Parameter) or (base.requires_grad and base.grad_fn is None)):
        return False
    if _is_parameter_cast(tensor):
        return False
    try:
        return tensor.untyped_storage().nbytes() >= MIN_STORAGE_BYTES
    except (RuntimeError, NotImplementedError):  # wrappers without a storage of their own (functorch's)
        return False


def _fake_tensor_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def _is_parameter_cast(tensor: torch.Tensor) -> bool:
    """A dtype copy of a leaf (autocast's low-precision weight), kept like the leaf (the rules above)."""
    grad_fn = tensor.grad_fn
    if grad_fn is None or grad_fn.name() != "ToCopyBackward0":
        return False
    return all(fn is not None and fn.name() == "torch::autograd::AccumulateGrad" for fn, _ in grad_fn.next_functions)


def _normalized(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"autockpt offload runs on 'cpu' or 'cuda' devices, got {device}")
    return device


def _unpin(host: torch.Tensor, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy may still be using the buffer
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass(eq=False, slots=True)
class _Slot:
    record: SlotRecord
    step: int
    version: int
    storage_ref: StorageWeakRef  # keeps the StorageImpl's address from being reused while the step lasts
    pending_unpacks: int = 0  # packed tensors of this storage not yet unpacked once
    stored: torch.cuda.Event | None = None  # CUDA: the device -> host copy is done
    restored: torch.Tensor | None = None  # the device copy made in backward (uint8, whole storage)
    ready: torch.cuda.Event | None = None  # CUDA: the host -> device copy into ``restored`` is done


@dataclass(eq=False, slots=True)
class _Region:
    index: int
    slots: dict[int, _Slot] = field(default_factory=dict)  # by id: ordered, each slot once
    prefetched: bool = False
    unpack_started: bool = False


@dataclass(eq=False, slots=True)
class _Packed:
    """What autograd holds instead of a moved tensor: where its storage went and how to view it again."""

    slot: _Slot
    region: _Region
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    conj: bool
    unpacked: bool = False


class HostPool:
    """One host buffer of ``capacity_bytes``, allocated once (page-locked with ``cudaHostRegister`` when the device
    is CUDA) and reused every step, that regions' saved tensors are moved into between their forward and their
    backward.

    ``fake_tensors``: a pool that measures a step run under ``FakeTensorMode`` on the CPU (the FSDP planner's fake
    world): it moves fakes by the same rules, its buffer is on the meta device (so a tracker of the CPU's bytes does
    not count it, as none counts host memory beside a GPU), and it knows storages by their ``StorageImpl`` instead
    of their address, which fakes do not have."""

    def __init__(self, capacity_bytes: int, device: torch.device | str, *, fake_tensors: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.device = _normalized(device)
        self._cuda = self.device.type == "cuda"
        self._fake = fake_tensors
        if fake_tensors and self._cuda:
            raise ValueError("a HostPool for fake tensors measures a CPU step: give device='cpu'")
        self._host = self._allocate()
        if self._cuda:
            self._d2h_stream = torch.cuda.Stream(self.device)
            self._h2d_stream = torch.cuda.Stream(self.device)
        # CUDA: (event, device storage) per copy to host not yet seen complete, in stream order
        self._in_flight: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = collections.deque()
        self._last_entry_stored: torch.cuda.Event | None = None  # the last copy of the region entered last
        self._step = 0
        self._used_bytes = 0
        self._slots: list[_Slot] = []
        self._by_storage: dict[int, _Slot] = {}  # StorageImpl address -> its latest slot this step
        self._regions: dict[int, _Region] = {}
        self._bytes_in = self._bytes_out = self._peak_bytes = self._copy_waits = 0
        self._moved = self._kept_count = 0
        self._kept: set[int] = set()  # storage addresses this step never moves (``begin_step(kept=...)``)

    def _allocate(self) -> torch.Tensor:
        kind = "pinned host" if self._cuda else "host"
        try:
            host = torch.empty(self.capacity_bytes, dtype=torch.uint8, device="meta" if self._fake else "cpu")
            if self._cuda and self.capacity_bytes:
                # pinned by hand: torch's pinned allocator (``pin_memory=True``) rounds every allocation up to a
                # power of two, so a 9 GB pool would lock 16 GB of host memory
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), self.capacity_bytes, 0))
                weakref.finalize(self, _unpin, host, self.device)
        except RuntimeError as error:  # torch.cuda.CudaError included
            raise OffloadError(
                f"autockpt offload: could not allocate the {kind} pool of {self.capacity_bytes} bytes "
                f"({self.capacity_bytes / 1e9:.2f} GB): {error}. Lower host_pool_gb or offload fewer regions."
            ) from error
        return host

    def stats(self) -> PoolStats:
        return PoolStats(
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            peak_occupancy_bytes=self._peak_bytes,
            copy_waits=self._copy_waits,
            steps=self._step,
            allocations=1,
            tensors_moved=self._moved,
            tensors_kept=self._kept_count,
        )

    def step_slots(self) -> tuple[SlotRecord, ...]:
        """The current step's slots, in pack order."""
        return tuple(slot.record for slot in self._slots)

    def begin_step(self, kept: Iterable[torch.Tensor] = ()) -> None:
        """Start a forward: every slot is free again. Tensors packed before now can no longer be unpacked.

        ``kept``: tensors whose storages this step never moves, whatever saves them: what existed before the step
        (its inputs, the model's buffers), which the plan's trace does not count among the storages it moves."""
        self._kept = {self._address(t.untyped_storage()) for t in kept if isinstance(t, torch.Tensor)}
        if self._cuda:
            self._release_stored(wait=True)
            # the new step's copies overwrite slots that earlier restores read, and restored storages the pool drops
            # here must not be reused by compute while a restore still writes them
            self._d2h_stream.wait_stream(self._h2d_stream)
            torch.cuda.current_stream(self.device).wait_stream(self._h2d_stream)
        if self._slots:
            logger.debug("offload step %d: %d slots, %d bytes", self._step, len(self._slots), self._used_bytes)
        for slot in self._slots:
            slot.restored = None
        self._step += 1
        self._used_bytes = 0
        self._slots = []
        self._by_storage = {}
        self._regions = {}
        self._last_entry_stored = None

    @contextlib.contextmanager
    def offloading(self, region_index: int) -> Iterator[None]:
        """Run a region's forward with what it saves for backward moved into the pool."""
        if self._step == 0:
            raise OffloadError("autockpt offload: call HostPool.begin_step() at the start of every forward")
        region = self._regions.get(region_index)
        if region is None:
            region = self._regions[region_index] = _Region(region_index)
        entry_stored: list[torch.cuda.Event | None] = [None]

        def pack(tensor: torch.Tensor) -> torch.Tensor | _Packed:
            return self._pack(tensor, region, entry_stored)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        if self._cuda:
            if self._last_entry_stored is not None:  # at most one region's copies behind: see the module docstring
                self._last_entry_stored.synchronize()
            self._release_stored()
            if entry_stored[0] is not None:
                self._last_entry_stored = entry_stored[0]

    def prefetch(self, region_index: int) -> None:
        """Start restoring a region's storages to the device (on CUDA, on the pool's second stream)."""
        region = self._regions.get(region_index)
        if region is not None:
            self._fetch(region)

    def _pack(self, tensor: torch.Tensor, region: _Region, entry_stored: list[torch.cuda.Event | None]) -> object:
        if not moves(tensor, self.device, fake=self._fake) or self._address(tensor.untyped_storage()) in self._kept:
            self._kept_count += 1
            # an alias without autograd history: a tensor its own node saves (an output) would otherwise hold that
            # node, which holds this hook's result, a cycle that keeps a graph dropped without backward forever
            return tensor if tensor.grad_fn is None else tensor.detach()
        storage = tensor.untyped_storage()
        slot = self._by_storage.get(storage._cdata)
        if (
            slot is None
            or slot.version != tensor._version
            or slot.record.source_data_ptr != self._address(storage)
            or slot.record.storage_bytes != storage.nbytes()
        ):
            slot = self._store(storage, tensor._version, region.index)
            if slot.stored is not None:
                entry_stored[0] = slot.stored
        region.slots[id(slot)] = slot
        slot.pending_unpacks += 1
        self._moved += 1
        return _Packed(
            slot=slot, region=region, dtype=tensor.dtype, size=tuple(tensor.size()), stride=tuple(tensor.stride()),
            storage_offset=tensor.storage_offset(), conj=tensor.is_conj(),
        )

    def _address(self, storage: torch.UntypedStorage) -> int:
        """What tells storages apart: the address, or for fakes (which have none) the ``StorageImpl``."""
        return storage._cdata if self._fake else storage.data_ptr()

    def _store(self, storage: torch.UntypedStorage, version: int, region_index: int) -> _Slot:
        """A new slot for ``storage``, its bytes copied (or being copied) into the host buffer."""
        nbytes = storage.nbytes()
        offset, size = self._used_bytes, slot_bytes(nbytes)
        if offset + size > self.capacity_bytes:
            raise PoolCapacityError(
                f"autockpt offload: the host pool is too small: region {region_index} needs a slot of {size} bytes "
                f"at offset {offset}, so this step needs at least {offset + size} bytes "
                f"({(offset + size) / 1e9:.3f} GB) but capacity_bytes is {self.capacity_bytes} "
                f"({self.capacity_bytes / 1e9:.3f} GB). Raise host_pool_gb (or offload fewer regions).",
                needed_bytes=offset + size,
                capacity_bytes=self.capacity_bytes,
            )
        record = SlotRecord(
            region_index=region_index, offset_bytes=offset, storage_bytes=nbytes, slot_bytes=size,
            source_data_ptr=self._address(storage),
        )
        slot = _Slot(record=record, step=self._step, version=version, storage_ref=StorageWeakRef(storage))
        if self._fake:
            pass  # no data to copy; and a view made by ``set_`` would keep the fake storage counted as alive
        elif self._cuda:
            host, source = self._host[offset : offset + nbytes], _byte_view(storage)
            self._release_stored()
            self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is written by then
            with torch.cuda.stream(self._d2h_stream):
                host.copy_(source, non_blocking=True)
                slot.stored = torch.cuda.Event()
                slot.stored.record(self._d2h_stream)
            self._in_flight.append((slot.stored, source))  # the storage lives until its copy is done
        else:
            self._host[offset : offset + nbytes].copy_(_byte_view(storage))
        self._used_bytes += size
        self._peak_bytes = max(self._peak_bytes, self._used_bytes)
        self._bytes_in += nbytes
        self._slots.append(slot)
        self._by_storage[storage._cdata] = slot
        return slot

    def _release_stored(self, *, wait: bool = False) -> None:
        """Drop the device storages whose copy to host is done (all of them, waiting, with ``wait``)."""
        while self._in_flight and (wait or self._in_flight[0][0].query()):
            event, _ = self._in_flight.popleft()
            if wait:
                event.synchronize()

    def _unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        slot, region = packed.slot, packed.region
        if slot.step != self._step:
            raise OffloadError(
                f"autockpt offload: a tensor saved in step {slot.step} was unpacked in step {self._step}; its host "
                "slot has been reused. Run each forward's backward before the next begin_step() (for gradient "
                "accumulation: backward after every micro-batch's forward)."
            )
        if self._cuda:
            self._release_stored()
        if not region.unpack_started:
            region.unpack_started = True
            if not region.prefetched:
                self._fetch(region, on_demand=True)
            below = [index for index, other in self._regions.items() if index < region.index and other.slots]
            if below:
                self._fetch(self._regions[max(below)])
        if slot.restored is None:  # a second backward through a retained graph: fetch it again
            self._restore(slot, on_demand=True)
        assert slot.restored is not None
        with torch.no_grad():
            if self._cuda:
                assert slot.ready is not None
                torch.cuda.current_stream(self.device).wait_event(slot.ready)
            if self._fake:  # a view: a tensor made by ``set_`` keeps a fake storage counted after it is freed
                tensor = slot.restored.view(packed.dtype).as_strided(packed.size, packed.stride, packed.storage_offset)
            else:
                tensor = torch.empty(0, dtype=packed.dtype, device=self.device).set_(
                    slot.restored.untyped_storage(), packed.storage_offset, packed.size, packed.stride
                )
        if not packed.unpacked:
            packed.unpacked = True
            slot.pending_unpacks -= 1
            if slot.pending_unpacks == 0:
                slot.restored = None  # what autograd holds now keeps it alive as long as it is needed
        return tensor.conj() if packed.conj else tensor

    def _fetch(self, region: _Region, *, on_demand: bool = False) -> None:
        """Restore the region's storages that are neither restored nor done with."""
        region.prefetched = True
        for slot in region.slots.values():
            if slot.restored is None and slot.pending_unpacks > 0:
                self._restore(slot, on_demand=on_demand)
                on_demand = False  # one wait per demand fetch of a region

    def _restore(self, slot: _Slot, *, on_demand: bool) -> None:
        nbytes, offset = slot.record.storage_bytes, slot.record.offset_bytes
        if on_demand:
            self._copy_waits += 1
        # allocated on the compute stream, where it is used and freed; the copy stream waits for that stream, so
        # memory the allocator just handed back is no longer being read or written there
        restored = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._fake:
            pass  # a fake has no data to restore
        elif self._cuda:
            assert slot.stored is not None
            self._h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._h2d_stream.wait_event(slot.stored)
            with torch.cuda.stream(self._h2d_stream):
                restored.copy_(self._host[offset : offset + nbytes], non_blocking=True)
                slot.ready = torch.cuda.Event()
                slot.ready.record(self._h2d_stream)
        else:
            restored.copy_(self._host[offset : offset + nbytes])
        slot.restored = restored
        self._bytes_out += nbytes
