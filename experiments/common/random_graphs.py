"""Random small DAG programs for solver tests and experiments: ``random_model(seed) -> (module, example_input)``.

A program is 4-12 ops (Linear, relu, gelu, tanh, sigmoid, add/mul of two earlier values, layer_norm, softmax,
matmul of two earlier values) on 2-D fp32 values. Each op reads values chosen among the most recent ones, so the
graph has skip connections; the last value is reduced to the output. Everything is drawn from the seed: the same
seed gives the same program, shapes and weights. No in-place ops and no data-dependent control flow, so
``torch.fx.symbolic_trace`` captures one fx node per op (plus the final reduction). Used by the solver tests
(tests/core/solve/, tests/planning/test_static_first.py) and experiments/bench/bench_optimality.py.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import autockpt
from autockpt.core.solve.base import Scorer
from autockpt.types import Action, ActionPrice, CostModel, StepTrace

UNARY = ("relu", "gelu", "tanh", "sigmoid", "softmax")
_RECENT = 4  # inputs are drawn among the last few values: short skip connections, like real networks


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # "linear", "layer_norm", one of UNARY, "add", "mul", "matmul" (a @ b) or "matmul_t" (a @ b.T)
    inputs: tuple[int, ...]  # indices into the program's values (0 is the model input)
    module: str = ""  # submodule name for ops with parameters


class RandomProgram(nn.Module):
    """Runs a fixed op list; the Python loop is over a static list, so fx unrolls it."""

    def __init__(self, ops: list[Op], shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.ops = tuple(ops)
        self.layers = nn.ModuleDict()
        for op in ops:
            if op.kind == "linear":
                self.layers[op.module] = nn.Linear(shapes[op.inputs[0]][1], _out_width(op))
            elif op.kind == "layer_norm":
                self.layers[op.module] = nn.LayerNorm(shapes[op.inputs[0]][1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for op in self.ops:
            args = [values[i] for i in op.inputs]
            values.append(_apply(self, op, args))
        return values[-1].mean()

    def extra_repr(self) -> str:
        lines = (f"v{i + 1} = {op.kind}({', '.join(f'v{j}' for j in op.inputs)})" for i, op in enumerate(self.ops))
        return "\n".join(lines)


def _out_width(op: Op) -> int:
    return int(op.module.rsplit("_", 1)[1])  # the output width is encoded in the name: "linear3_64"


def _apply(program: RandomProgram, op: Op, args: list[torch.Tensor]) -> torch.Tensor:
    if op.kind in ("linear", "layer_norm"):
        return program.layers[op.module](args[0])
    if op.kind == "relu":
        return F.relu(args[0])
    if op.kind == "gelu":
        return F.gelu(args[0])
    if op.kind == "tanh":
        return torch.tanh(args[0])
    if op.kind == "sigmoid":
        return torch.sigmoid(args[0])
    if op.kind == "softmax":
        return F.softmax(args[0], dim=-1)
    if op.kind == "add":
        return args[0] + args[1]
    if op.kind == "mul":
        return args[0] * args[1]
    if op.kind == "matmul":
        return torch.matmul(args[0], args[1])
    if op.kind == "matmul_t":
        return F.linear(args[0], args[1])  # a @ b.T in one fx node
    raise ValueError(f"unknown op {op.kind!r}")


def random_program(seed: int) -> tuple[list[Op], list[tuple[int, int]], int, int]:
    """(ops, shape of every value, batch, width) for ``seed``; shapes[0] is the input's."""
    rng = random.Random(seed)
    batch, width = rng.randint(8, 64), rng.randint(16, 96)
    widths = (width, rng.randint(16, 96))  # a second width so Linear changes shapes and matmuls have choices
    shapes: list[tuple[int, int]] = [(batch, width)]
    ops: list[Op] = []
    num_ops = rng.randint(4, 12)

    def recent() -> list[int]:
        # the model input is only read by the first op: every later op works on computed values
        return list(range(max(1, len(shapes) - _RECENT), len(shapes)))

    def pick(candidates: list[int]) -> int:
        return rng.choices(candidates, weights=[1 + k for k in range(len(candidates))])[0]  # favour the newest

    while len(ops) < num_ops:
        if not ops:  # start with a Linear so the model has a parameter on the gradient path
            kind = "linear"
        else:
            kind = rng.choice(("linear", "linear", "layer_norm", *UNARY, "add", "mul", "matmul", "matmul"))
        op = _draw(kind, len(ops), recent() if ops else [0], shapes, widths, rng, pick)
        if op is None:
            continue  # no compatible operands among the recent values: draw another kind
        ops.append(op)
        shapes.append(_shape(op, shapes))
    return ops, shapes, batch, width


def _draw(
    kind: str,
    index: int,
    recent: list[int],
    shapes: list[tuple[int, int]],
    widths: tuple[int, int],
    rng: random.Random,
    pick: Callable[[list[int]], int],
) -> Op | None:
    if kind == "linear":
        return Op(kind, (pick(recent),), f"linear{index}_{rng.choice(widths)}")
    if kind == "layer_norm":
        return Op(kind, (pick(recent),), f"layer_norm{index}")
    if kind in UNARY:
        return Op(kind, (pick(recent),))
    a = pick(recent)
    if kind in ("add", "mul"):
        partners = [b for b in recent if b != a and shapes[b] == shapes[a]]
        return Op(kind, (a, pick(partners))) if partners else None
    # matmul: a (m, k) @ b (k, n), or a (m, k) @ b.T for b (n, k); attention-like (batch, batch) values appear
    direct = [("matmul", b) for b in recent if shapes[a][1] == shapes[b][0]]
    transposed = [("matmul_t", b) for b in recent if shapes[a][1] == shapes[b][1]]
    options = direct + transposed
    if not options:
        return None
    kind, b = rng.choice(options)
    return Op(kind, (a, b))


def _shape(op: Op, shapes: list[tuple[int, int]]) -> tuple[int, int]:
    a = shapes[op.inputs[0]]
    if op.kind == "linear":
        return (a[0], _out_width(op))
    if op.kind == "matmul":
        return (a[0], shapes[op.inputs[1]][1])
    if op.kind == "matmul_t":
        return (a[0], shapes[op.inputs[1]][0])
    return a


def random_model(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A random small DAG program and an example input, both determined by ``seed`` (global RNG untouched)."""
    ops, shapes, batch, width = random_program(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = RandomProgram(ops, shapes)
        x = torch.randn(batch, width)
    return model, x


def modelled_costs(trace: StepTrace) -> StepTrace:
    """``trace`` with forward times from a fixed cost model instead of the clock.

    Measured times of microsecond ops on a shared CPU are mostly noise (and warm-up outliers), which would make the
    production solver's choices, and so an optimality test, vary from run to run. Memory is measured exactly and
    kept. Model: 1 us per op, 1 TFLOP/s, 100 GB/s for the op's outputs; backward twice the forward.
    """
    units = tuple(
        dataclasses.replace(u, forward_ms=1e-3 + u.flops * 1e-9 + u.output_bytes * 1e-8) for u in trace.units
    )
    forward_ms = sum(u.forward_ms for u in units)
    return dataclasses.replace(trace, units=units, forward_ms=forward_ms, step_ms=3 * forward_ms)


def modelled_machinery(*, region_ms: float = 0.0, saved_tensor_ms: float = 0.0) -> CostModel:
    """Every action's machinery at fixed prices (zero by default) instead of the device's calibration."""
    return CostModel(
        device="cpu",
        prices=tuple(ActionPrice(action=a, region_ms=region_ms, saved_tensor_ms=saved_tensor_ms) for a in Action),
    )


# the action whose semantics the exact solver's scorer follows below (torch's); plans compared with it use it too
TORCH_CHECKPOINT = autockpt.SolverOptions(checkpoint="torch_non_reentrant")


@functools.cache
def modelled_planner(seed: int) -> autockpt.Planner:
    """A Planner for ``random_model(seed)`` that plans on ``modelled_costs`` and machinery priced at zero, made once
    per seed (the solver tests of several files share it)."""
    torch.manual_seed(seed)
    model, x = random_model(seed)
    planner = autockpt.Planner.from_model(model, example_inputs=(x,), checkpoint=Action.RECOMPUTE_TORCH)
    planner.trace = modelled_costs(planner.trace)  # before the first plan: the solver plans on these costs
    planner.costs = modelled_machinery()
    return planner


def scorer_of(planner: autockpt.Planner) -> Scorer:
    """The simulator the planner's plans are judged by (its first action, its trace and prices)."""
    return Scorer(planner.trace, planner.costs, planner.actions[0])
