"""The offload runtime (``autockpt/offload.py``) against plain PyTorch: the same training steps bit for bit, a host
pool allocated once and sized exactly by the rule, and less memory when measured."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from autockpt.runtime.offload import (
    MIN_STORAGE_BYTES,
    SLOT_ALIGNMENT_BYTES,
    HostPool,
    OffloadError,
    PoolCapacityError,
    moves,
    slot_bytes,
)

CPU = torch.device("cpu")


# ---- models ------------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.LayerNorm(2 * width), nn.Linear(2 * width, width))
                for _ in range(depth)
            ]
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)) + x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.block1 = ConvBlock(8)
        self.block2 = ConvBlock(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        dropout = 0.1 if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(Block(dim), Block(dim), Block(dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class Views(nn.Module):
    """Saved tensors that are views, transposes, strided slices, conjugates, and of many dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 48)
        self.out = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # (4, 16, 48)
        t = h.transpose(1, 2)
        a = torch.matmul(t, h)  # saves a transpose and h: two views of one storage
        s = h[:, ::2, 1:40:3].sin()  # a strided slice
        d = h.double().exp()  # float64
        b = h.to(torch.bfloat16).tanh()  # bfloat16 result
        index = torch.argsort(h.detach(), dim=1)  # int64
        g = torch.gather(h, 1, index)
        w = torch.where(h > 0, h, 0.1 * h)  # a bool mask
        z = torch.view_as_complex(h.float().reshape(4, 16, 24, 2))  # complex bf16 does not exist
        c = (z.conj() * z.sin()).abs()  # a conjugate view is saved
        parts = [a.mean(1), s.mean(1).repeat(1, 4), d.float().mean(1), b.float().mean(1), g.mean(1), w.mean(1),
                 c.mean(1).repeat(1, 2)]
        return self.out(sum(p[:, :48] for p in parts))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        g = self.lin(h).add_(1.0)  # h is saved here at the version ReLU left it: one slot for both regions
        g.sigmoid_()  # saves its result, ``g``'s storage
        return self.frozen(g * 2.0) * g  # the frozen weight is kept


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.act, self.gate, self.out = nn.Linear(24, 64), nn.ReLU(inplace=True), Gate(), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.act(self.l1(x))))  # ReLU saves its result, l1's output storage


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    regions: tuple[str, ...]  # submodules offloaded, in forward order


CASES = {
    "mlp": Case("mlp", MLP, lambda: (torch.randn(16, 32),), ("blocks.0", "blocks.1", "blocks.2")),
    "conv-batchnorm-inplace": Case(
        "conv-batchnorm-inplace", ConvNet, lambda: (torch.randn(4, 3, 12, 12),), ("stem", "block1", "block2")
    ),
    "transformer-sdpa": Case(
        "transformer-sdpa", TinyTransformer, lambda: (torch.randint(0, 50, (4, 16)),), ("blocks.0", "blocks.1")
    ),
    # nested: lin's region (0) inside the whole model's (1); the innermost packs, and backward reaches 1 first
    "views-dtypes": Case("views-dtypes", Views, lambda: (torch.randn(4, 16, 32),), ("lin", "")),
    "inplace-frozen": Case("inplace-frozen", InPlace, lambda: (torch.randn(16, 24),), ("act", "gate")),
}


def offload(model: nn.Module, pool: HostPool, names: Sequence[str]) -> None:
    """Run each named submodule's forward (``""``: the whole model) inside ``pool.offloading(i)``, i its position."""
    for index, name in enumerate(names):
        module = model.get_submodule(name)
        plain = module.forward

        def forward(*args: Any, _plain: Callable[..., Any] = plain, _index: int = index, **kwargs: Any) -> Any:
            with pool.offloading(_index):
                return _plain(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]


@dataclass
class StepResult:
    loss: torch.Tensor
    output: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def offloaded(name: str) -> tuple[nn.Module, nn.Module, tuple[torch.Tensor, ...], HostPool]:
    """A case's model (seed 0) with its regions offloaded into a 1 MiB pool, an untouched copy, and its inputs."""
    case = CASES[name]
    torch.manual_seed(0)
    model, inputs = case.build(), case.inputs()
    reference = copy.deepcopy(model)
    pool = HostPool(1 << 20, CPU)
    offload(model, pool, case.regions)
    return model, reference, inputs, pool


def train(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    pool: HostPool | None = None,
    *,
    steps: int = 3,
    prefetch: int | None = None,
    autocast: bool = False,
) -> list[StepResult]:
    """``steps`` SGD steps with a fixed seed per step; what each step computed."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    results = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        if pool is not None:
            pool.begin_step()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output = model(*inputs)
        loss = loss_of(output)
        if pool is not None and prefetch is not None:
            pool.prefetch(prefetch)
        loss.backward()
        results.append(StepResult(
            loss=loss.detach().clone(),
            output=output.detach().clone(),
            grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            buffers={n: b.clone() for n, b in model.named_buffers()},
        ))
        optimizer.step()
    return results


def assert_same(actual: list[StepResult], expected: list[StepResult]) -> None:
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected)):
        assert torch.equal(got.loss, want.loss), f"loss of step {step}"
        assert torch.equal(got.output, want.output), f"output of step {step}"
        assert got.grads.keys() == want.grads.keys() and got.grads
        for name, grad in want.grads.items():
            assert torch.equal(got.grads[name], grad), f"gradient of {name} at step {step}"
        for name, buffer in want.buffers.items():
            assert torch.equal(got.buffers[name], buffer), f"buffer {name} at step {step}"


def moved_storages(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], names: Sequence[str], autocast: bool = False
) -> list[int]:
    """The storage bytes a step moves, found independently of the pool: the named submodules run under a spy that
    keeps every saved tensor (so no address is reused) and lists the distinct (storage, version) pairs ``moves``."""
    model = copy.deepcopy(model)
    seen: dict[tuple[int, int], int] = {}

    def spy(tensor: torch.Tensor) -> torch.Tensor:
        if moves(tensor, CPU):
            storage = tensor.untyped_storage()
            seen.setdefault((storage.data_ptr(), tensor._version), storage.nbytes())
        return tensor.detach()  # the tensor itself would make a reference cycle through its own node

    for name in names:
        module = model.get_submodule(name)
        plain = module.forward

        def forward(*args: Any, _plain: Callable[..., Any] = plain, **kwargs: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(spy, lambda t: t):
                return _plain(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss_of(model(*inputs)).backward()
    return list(seen.values())


def parameter_spans(model: nn.Module) -> list[tuple[int, int]]:
    return [
        (p.untyped_storage().data_ptr(), p.untyped_storage().data_ptr() + p.untyped_storage().nbytes())
        for p in model.parameters()
    ]


# ---- the same step as plain PyTorch --------------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_same_steps_as_plain_pytorch(name: str, autocast: bool) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    model, inputs = case.build(), case.inputs()
    reference = copy.deepcopy(model)
    storages = moved_storages(model, inputs, case.regions, autocast)
    needed = sum(slot_bytes(n) for n in storages)
    pool = HostPool(needed, CPU)  # exactly what the rule says a step needs
    offload(model, pool, case.regions)

    assert_same(train(model, inputs, pool, autocast=autocast), train(reference, inputs, autocast=autocast))

    stats = pool.stats()
    assert stats.allocations == 1 and stats.steps == 3
    assert stats.peak_occupancy_bytes == needed <= pool.capacity_bytes
    assert stats.bytes_in == stats.bytes_out == 3 * sum(storages)  # every storage out once and back once per step
    assert stats.copy_waits == 3  # backward's first offloaded region, each step: nothing prefetched it
    slots = pool.step_slots()
    assert stats.tensors_moved >= 3 * len(slots) > 0
    assert [s.offset_bytes for s in slots] == [sum(s.slot_bytes for s in slots[:i]) for i in range(len(slots))]
    assert all(s.offset_bytes % SLOT_ALIGNMENT_BYTES == 0 and s.storage_bytes >= MIN_STORAGE_BYTES for s in slots)
    for slot in slots:  # parameters (trainable or frozen) are never moved
        assert not any(lo <= slot.source_data_ptr < hi for lo, hi in parameter_spans(model))


def test_prefetch_before_backward_leaves_no_wait() -> None:
    model, reference, inputs, pool = offloaded("mlp")
    assert_same(train(model, inputs, pool, prefetch=len(CASES["mlp"].regions) - 1), train(reference, inputs))
    assert pool.stats().copy_waits == 0


class TwoRegions(nn.Module):
    """Regions entered by hand; ``pool`` is set on the offloaded copy only."""

    pool: HostPool | None = None

    def region(self, index: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.pool is None else self.pool.offloading(index)


class Shared(TwoRegions):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.region(0):
            h = self.first(x)
            y = h.sin()  # saves h
        with self.region(1):
            z = h.cos() * y  # saves h again, then cos(h) and y
        return self.second(z)


class Reuse(TwoRegions):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.region(0):
            a = self.lin(x).exp().mean()  # exp saves its result, freed once the pool has copied it
            b = (self.lin(x) * 2).exp().mean()  # the same size: often the same address
        return a + b


def test_kept_storages_are_not_moved() -> None:
    """``begin_step(kept=...)``: the batch and the buffers exist before the step and after it; they stay put."""
    model, _, inputs, pool = offloaded("conv-batchnorm-inplace")
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in (*inputs, *model.buffers())]
    for kept in ((), (*inputs, *model.buffers())):
        pool.begin_step(kept=kept)
        loss_of(model(*inputs)).backward()
        moved_kept = [s for s in pool.step_slots() if any(lo <= s.source_data_ptr < hi for lo, hi in spans)]
        assert len(moved_kept) == (0 if kept else 1)  # the stem's convolution saves the batch


@pytest.mark.parametrize("build", [Shared, Reuse], ids=["storage-shared-across-regions", "address-reused-in-step"])
def test_storages_are_told_apart_by_identity(build: Callable[[], TwoRegions]) -> None:
    """Views of one storage share a slot, across regions too; a storage freed within the step (the pool dropped it
    at pack) and another allocated at its address get a slot each."""
    torch.manual_seed(0)
    model, inputs = build(), (torch.randn(8, 16) if build is Shared else torch.randn(2, 64),)  # inputs < 1 KiB
    reference = copy.deepcopy(model)
    model.pool = pool = HostPool(1 << 22, CPU)
    assert_same(train(model, inputs, pool), train(reference, inputs))
    stats, slots = pool.stats(), pool.step_slots()
    assert stats.bytes_in == stats.bytes_out
    if build is Shared:
        assert [s.region_index for s in slots] == [0, 1, 1] and stats.tensors_moved == 3 * 4  # h once, not twice
    else:
        assert len(slots) == 2  # also when the second storage got the first one's address


def test_version_change_gets_its_own_slot() -> None:
    pool = HostPool(1 << 16, CPU)
    pool.begin_step()
    x = torch.randn(1024, requires_grad=True)
    with pool.offloading(0):
        h = x * 1.0
        y = h.exp()  # saves its result, version 0
        with torch.no_grad():
            y.add_(0)  # version 1 (autograd would refuse the first save's backward)
        z = y.sin()  # saves the same storage at version 1
    assert [s.source_data_ptr for s in pool.step_slots()] == [y.data_ptr(), y.data_ptr()]
    del z


# ---- sizing and errors ---------------------------------------------------------------------------------------------


def test_capacity_one_byte_short_raises_clearly() -> None:
    case = CASES["mlp"]
    torch.manual_seed(0)
    model, inputs = case.build(), case.inputs()
    needed = sum(slot_bytes(n) for n in moved_storages(model, inputs, case.regions))
    pool = HostPool(needed - 1, CPU)
    offload(model, pool, case.regions)
    pool.begin_step()
    with pytest.raises(PoolCapacityError, match="host_pool_gb") as raised:
        model(*inputs)
    assert raised.value.needed_bytes == needed and raised.value.capacity_bytes == needed - 1
    assert f"{needed - 1}" in str(raised.value)


def test_offloading_needs_begin_step() -> None:
    pool = HostPool(1024, CPU)
    with pytest.raises(OffloadError, match="begin_step"), pool.offloading(0):
        pass


def test_what_is_moved() -> None:
    param = nn.Parameter(torch.randn(64, 64))
    frozen = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    leaf = torch.randn(64, 64, requires_grad=True)
    activation = leaf * 2
    assert moves(activation, CPU) and moves(activation.t()[::2], CPU)
    assert moves(torch.randn(256), CPU) and not moves(torch.randn(255), CPU)  # 1 KiB storages and up
    assert moves(torch.randn(1000)[:2], CPU)  # a small view of a large storage: the storage counts
    for kept in (param, param.t(), frozen, frozen.t(), leaf, leaf[1:]):
        assert not moves(kept, CPU)
    assert not moves(activation.to_sparse(), CPU)
    assert not moves(activation, torch.device("meta"))
    assert [slot_bytes(n) for n in (1, 512, 513, 1024)] == [512, 512, 1024, 1024]


# ---- steps that are not one forward and one backward -------------------------------------------------------------------


def test_forwards_without_backward_do_not_disturb_the_next_step() -> None:
    model, reference, inputs, pool = offloaded("transformer-sdpa")

    def detour(module: nn.Module, with_pool: bool) -> None:
        for _ in range(2):  # evaluation under no_grad: nothing is packed
            if with_pool:
                pool.begin_step()
            with torch.no_grad():
                module(*inputs)
        if with_pool:
            pool.begin_step()
        module(*inputs)  # a forward with grad whose graph is dropped

    torch.manual_seed(5)
    detour(model, True)
    moved_before = pool.stats().bytes_in
    torch.manual_seed(5)
    detour(reference, False)
    assert_same(train(model, inputs, pool, steps=2), train(reference, inputs, steps=2))
    assert pool.stats().steps == 5 and moved_before > 0


def test_graph_dropped_without_backward_is_freed() -> None:
    """Kept tensors that their own node saves (a small output) must not tie the graph in a reference cycle."""
    pool = HostPool(1 << 16, CPU)
    pool.begin_step()
    x = torch.randn(1000, requires_grad=True)
    with pool.offloading(0):
        small = (x[:16] * 2).exp()  # kept (64 bytes), saved by its own node
        large = (x * 2).exp()  # moved
    storages = [StorageWeakRef(t.untyped_storage()) for t in (small, large)]
    assert pool.stats().tensors_kept >= 1 and pool.stats().tensors_moved >= 1
    del small, large
    assert all(s.expired() for s in storages)


def test_two_forwards_then_two_backwards_raise() -> None:
    model, _, inputs, pool = offloaded("mlp")
    pool.begin_step()
    first = loss_of(model(*inputs))
    pool.begin_step()
    second = loss_of(model(*inputs))
    with pytest.raises(OffloadError, match="backward after every micro-batch"):
        first.backward()
    second.backward()  # the current step's graph is fine


def test_retained_graph_second_backward() -> None:
    model, reference, inputs, pool = offloaded("mlp")

    def twice(module: nn.Module) -> dict[str, torch.Tensor]:
        loss = loss_of(module(*inputs))
        loss.backward(retain_graph=True)
        loss.backward()
        return {n: p.grad for n, p in module.named_parameters()}

    pool.begin_step()
    got, want = twice(model), twice(reference)
    assert all(torch.equal(got[n], g) for n, g in want.items())
    slots = len(pool.step_slots())
    assert pool.stats().copy_waits == 1 + slots  # the second backward fetches every storage again, on demand


# ---- memory, measured ----------------------------------------------------------------------------------------------


def peak_bytes(model: nn.Module, inputs: tuple[torch.Tensor, ...], pool: HostPool | None) -> int:
    """MemTracker's peak total over one step, less the pool's whole buffer: MemTracker counts it from the first
    slice the pool takes of it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    for param in model.parameters():
        param.grad = None
    tracker = MemTracker()
    tracker.track_external(model, *inputs)
    with tracker:
        if pool is not None:
            pool.begin_step()
        loss_of(model(*inputs)).backward()
    peak = int(tracker.get_tracker_snapshot("peak")[CPU]["Total"])
    if pool is None:
        return peak
    assert peak > pool.capacity_bytes
    return peak - pool.capacity_bytes


def test_offloaded_step_measures_lower() -> None:
    torch.manual_seed(0)
    model, inputs = MLP(width=64, depth=6), (torch.randn(2048, 64),)  # activations well above parameters
    reference = copy.deepcopy(model)
    regions = ("blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4")
    storages = moved_storages(model, inputs, regions)
    moved = sum(storages)
    pool = HostPool(sum(slot_bytes(n) for n in storages), CPU)
    offload(model, pool, regions)
    plain, offloaded = peak_bytes(reference, inputs, None), peak_bytes(model, inputs, pool)
    print(
        f"\nMemTracker peak, one step: plain {plain / 1e6:.2f} MB, offloaded {offloaded / 1e6:.2f} MB "
        f"(saves {(plain - offloaded) / 1e6:.2f} MB); moved {moved / 1e6:.2f} MB per step, "
        f"pool occupancy {pool.stats().peak_occupancy_bytes / 1e6:.2f} MB (not counted)"
    )
    assert offloaded < plain
    # all but two regions' worth of moved bytes come off the peak (backward restores one region ahead)
    assert plain - offloaded >= moved * (len(regions) - 2) / len(regions)


def test_dtype_copies_of_parameters_stay_on_the_device() -> None:
    """Autocast's low-precision weights are cached for its whole context: moving one would free nothing (and the
    plan's trace does not count them), so they are kept like the parameters themselves; activations still move."""
    layer = nn.Linear(64, 64)
    weight_copy = layer.weight.to(torch.bfloat16)  # what autocast makes of a weight (ToCopyBackward0 of a leaf)
    activation = layer(torch.randn(32, 64)).to(torch.bfloat16)  # a cast too, but of a computed tensor
    assert not moves(weight_copy, torch.device("cpu"))
    assert moves(activation, torch.device("cpu"))
