"""Eager paths: run a library's eager code while torch traces it (export, fake tensors).

Libraries change course when they believe they are traced. Hugging Face transformers, seeing an exported or fake
tensor, materialises the causal mask as a T x T tensor, repeats keys and values across heads instead of passing
``enable_gqa`` to scaled-dot-product attention, and skips its value checks (``padding_mask.all()``): measured on a
GQA Llama, +18.7 % peak and a 1.3x slower step than the model as the user runs it. autockpt plans the program it
captured, so that program must be the eager one.

What a library consults to decide it is traced comes in two kinds:

- torch's public flags, ``torch.compiler.is_exporting()`` and ``is_compiling()``: replaced here (torch's own tracing
  reads the flags behind them, never these functions);
- a library's own predicates that look at the tensor (``isinstance(x, FakeTensor)``): each library that has them is
  named in ``_LIBRARY_PREDICATES``, and every module-level binding of those functions (``from ... import
  is_tracing``) answers "not traced" for the duration.

Each replaced function has a stand-in of its own. A module imported inside the block (a library importing lazily as
the model runs) binds the stand-in of a name it imports from a replaced one; once the last block ends, such a binding
gets its own function back, so that no library goes on believing it is never traced (a later ``torch.compile``).

The eager course may read tensor values (``if padding_mask.all()``). Those reads are recorded on one eager forward of
the real model (``recorded_reads``); under ``torch.export`` (``capture.py``) each read is then checked equal to its
recorded value, which the exported graph asserts at run time (``aten._assert_scalar``): a later batch whose values
take the other branch fails the assertion instead of running the wrong program (``runtime/rewrite.py`` hands it to
``planning/courses.py``). A fake run of the eager model (``fsdp/fake_world.py``) is answered the recorded values.
Without values (a meta model) a read raises, and the caller falls back to the traced course and says so.

What is left after this (a library not listed, a course this does not reach) is caught by the plan's self-check:
the captured program's unmodified peak against the eager model's, measured (``Plan.provenance.eager_peak_bytes``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autockpt.measure.fake_copy import without_values
from autockpt.runtime.model_state import BufferState, cuda_devices_of

# module -> names of functions in it that answer "is this traced?"; checked by identity wherever they are bound
_LIBRARY_PREDICATES: dict[str, tuple[str, ...]] = {
    "transformers.utils.import_utils": (
        "is_tracing", "is_fake_tensor", "is_torchdynamo_compiling", "is_torchdynamo_exporting",
    ),
}


# id(stand-in) -> (the stand-in, the predicate it replaces): one stand-in per predicate, so that a binding of one
# found after the block (a module imported inside it took the replaced name: ``from torch.compiler import
# is_compiling``) is put back to its own predicate, not left answering "not traced" for the rest of the process
_STAND_INS: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def _stand_in(predicate: Callable[..., Any]) -> Callable[..., Any]:
    """The function that answers "not traced" in place of ``predicate`` while a block is open, and asks
    ``predicate`` once none is (a binding the put-back cannot reach: a default argument, a cache keyed by the
    function). Made once per predicate; a stand-in passed in is returned as is (a nested block finds torch's flags
    already replaced)."""
    if _replaced_by(predicate) is not None:
        return predicate
    for stand_in, replaced in _STAND_INS.values():
        if replaced is predicate:
            return stand_in

    def _not_traced(*args: Any, **kwargs: Any) -> bool:
        return False if _OPEN_BLOCKS[0] else predicate(*args, **kwargs)

    _STAND_INS[id(_not_traced)] = (_not_traced, predicate)
    return _not_traced


def _replaced_by(value: Any) -> Callable[..., Any] | None:
    """The predicate ``value`` stands in for, or None when it is no stand-in (checked by identity: no attribute of an
    arbitrary object is read, a lazy module's or ``torch.ops``' would import or make one)."""
    known = _STAND_INS.get(id(value))
    return known[1] if known is not None and known[0] is value else None


def _loaded_predicates() -> dict[int, Callable[..., Any]]:
    """The predicates of the libraries already imported (a library not imported has no model to trace), by id; not
    their stand-ins, which answer inside ``eager_library_paths``: an entry nested in another (a capture records value
    reads inside its own) finds none to replace, unless a library was imported since the outer entry. Taking a
    stand-in for a predicate made it forget the remembered scans and scan every module twice, 20 ms each with
    transformers imported."""
    found: dict[int, Callable[..., Any]] = {}
    for module_name, names in _LIBRARY_PREDICATES.items():
        if module_name.split(".")[0] not in sys.modules:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # another version of the library, laid out otherwise: nothing to replace
            continue
        for name in names:
            function = getattr(module, name, None)
            if callable(function) and _replaced_by(function) is None:
                found[id(function)] = function
    return found


def _binds_predicate(value: Any, predicates: dict[int, Callable[..., Any]]) -> bool:
    return callable(value) and predicates.get(id(value)) is value


# id(module namespace) -> (its length when scanned, the names in it bound to a predicate then), for the predicates
# whose ids are _SCANNED_FOR. A module's namespace rarely changes after its import, and a new binding changes its
# length: scanning every value of every loaded module took 15-30 ms a call with transformers imported (issue 46),
# looking up one entry per module about 1 ms
_SCANNED: dict[int, tuple[int, tuple[str, ...]]] = {}
_SCANNED_FOR: set[int] = set()


def _scans_for(predicates: dict[int, Callable[..., Any]]) -> None:
    """Forget the remembered scans when they were of other predicates (a library imported since, or reloaded)."""
    if _SCANNED_FOR != predicates.keys():
        _SCANNED.clear()
        _SCANNED_FOR.clear()
        _SCANNED_FOR.update(predicates)


def _predicate_bindings(namespace: dict[str, Any], predicates: dict[int, Callable[..., Any]]) -> tuple[str, ...]:
    """The names in ``namespace`` bound to one of ``predicates`` (``_scans_for`` them first); rescanned only when the
    namespace's length changed."""
    scanned = _SCANNED.get(id(namespace))
    if scanned is not None and scanned[0] == len(namespace):
        return scanned[1]
    names = tuple(name for name, value in list(namespace.items()) if _binds_predicate(value, predicates))
    _SCANNED[id(namespace)] = (len(namespace), names)
    return names


# how many blocks are open (they nest, on one thread, as torch's flags they replace assume); and the ids and lengths of
# the loaded modules' namespaces as the outermost began: a module imported inside a block, or one whose namespace
# grew (a lazy attribute cached), may have taken a stand-in from a replaced name, which the last exit puts back
_OPEN_BLOCKS = [0]
_AT_ENTRY: list[list[int]] = [[], []]


def _namespaces() -> list[dict[str, Any]]:
    return [namespace for module in list(sys.modules.values())
            if isinstance(namespace := getattr(module, "__dict__", None), dict)]


def _put_back_stand_ins_bound_inside() -> None:
    """The stand-ins still bound once every block has restored what it replaced: names a module imported inside a
    block (or grown since) bound from a replaced one. Each gets its own predicate back."""
    namespaces = _namespaces()
    ids, lengths = _AT_ENTRY
    if list(map(id, namespaces)) == ids and list(map(len, namespaces)) == lengths:
        return  # no module imported, none grown (compared in C: a Python loop over 3,000 modules took 0.8 ms)
    at_entry = dict(zip(ids, lengths))
    for namespace in namespaces:
        if at_entry.get(id(namespace)) == len(namespace):
            continue  # unchanged: every stand-in in it was placed, and restored, by a block
        for name, value in list(namespace.items()):
            predicate = _replaced_by(value)
            if predicate is not None:
                namespace[name] = predicate
                _SCANNED.pop(id(namespace), None)  # scanned with the stand-in bound: its length hides the change


@contextlib.contextmanager
def eager_library_paths() -> Iterator[None]:
    """For the duration, libraries take the course they take in eager mode (see the module docstring)."""
    compiler = torch.compiler
    saved_flags = compiler.is_exporting, compiler.is_compiling
    predicates = _loaded_predicates()
    replaced: list[tuple[dict[str, Any], str, Any]] = []
    outermost = _OPEN_BLOCKS[0] == 0
    # kept to the exit: the ids compared there are of namespaces alive throughout (no id reused)
    namespaces = _namespaces() if predicates or outermost else []
    if outermost:
        _AT_ENTRY[:] = list(map(id, namespaces)), list(map(len, namespaces))
    _OPEN_BLOCKS[0] += 1
    try:  # what was replaced is restored however the block ends, a failed scan included
        if predicates:
            _scans_for(predicates)
            for namespace in namespaces:
                for name in _predicate_bindings(namespace, predicates):
                    value = namespace.get(name)
                    if _binds_predicate(value, predicates):  # still bound (one rebound or deleted since: left alone)
                        replaced.append((namespace, name, value))
                        namespace[name] = _stand_in(value)
        compiler.is_exporting = _stand_in(saved_flags[0])  # type: ignore[assignment]
        compiler.is_compiling = _stand_in(saved_flags[1])  # type: ignore[assignment]
        yield
    finally:
        compiler.is_exporting, compiler.is_compiling = saved_flags
        for namespace, name, value in reversed(replaced):
            namespace[name] = value
        _OPEN_BLOCKS[0] -= 1
        if _OPEN_BLOCKS[0] == 0:
            _put_back_stand_ins_bound_inside()


# the ops that read a tensor's value into Python (``.item()``, ``bool(tensor)``, ``int(tensor)``)
VALUE_READ_OPS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


class ValueReads(TorchDispatchMode):
    """Records the values a step reads from tensors (``.item()``, ``bool(tensor)``), or answers them from a record.

    A traced run of the eager model has no values where the eager course reads one (Hugging Face: "is this batch
    packed?", "does this mask pad anything?"). Recorded on the real model and inputs (``recorded_reads``), the same
    reads come in the same order in a traced run of the same program on the same inputs:

    - ``asserted=False`` (a fake run, ``fsdp/fake_world.py``): each read is answered with the recorded value;
    - ``asserted=True`` (``torch.export``, ``capture.py``): each read stays symbolic and is checked equal to the
      recorded value (``torch._check``), which export keeps as a run-time assertion (``aten._assert_scalar``): the
      graph takes the example's course and a batch that reads otherwise fails there.

    One read more than recorded raises a data-dependent error (``is_data_dependent_error``): the caller falls back
    to the traced course."""

    def __init__(self, answers: list[Any] | None = None, *, asserted: bool = False) -> None:
        super().__init__()
        self.replaying = answers is not None
        self.asserted = asserted
        self.values: list[Any] = list(answers or [])
        self._next = 0

    @contextlib.contextmanager
    def replayed(self) -> Iterator[ValueReads]:
        """Answer the reads of one more run, from the first recorded value."""
        self._next = 0
        with self:
            yield self

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in VALUE_READ_OPS:
            return func(*args, **(kwargs or {}))
        if not self.replaying:
            value = func(*args, **(kwargs or {}))
            self.values.append(value)
            return value
        if self._next >= len(self.values):
            from torch._subclasses.fake_tensor import DataDependentOutputException

            raise DataDependentOutputException(func)
        self._next += 1
        expected = self.values[self._next - 1]
        if not self.asserted:
            return expected
        value = func(*args, **(kwargs or {}))
        if isinstance(value, torch.SymBool):  # a bool tensor's read: the symbol itself, or its negation, holds
            torch._check(value if expected else torch.sym_not(value))
        else:
            torch._check(value == expected)
        return value


def recorded_reads(model: nn.Module, args: tuple, kwargs: dict) -> list[Any] | None:
    """The values one forward of ``model`` on its eager course reads from tensors, in order (no gradients, the
    model's buffers and RNG as they were); None where the model or the inputs have no values (meta, fake)."""
    if without_values(model, args, kwargs):
        return None
    buffers = BufferState(model)
    recorder = ValueReads()
    devices = cuda_devices_of(args, kwargs, list(model.parameters()))
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), eager_library_paths(), recorder:
            model(*args, **kwargs)
    finally:
        buffers.restore()
    return recorder.values


def is_data_dependent_error(error: BaseException) -> bool:
    """True when ``error`` says a value was read that the tracer does not have (a fake tensor's, or an unbacked
    symbol's): the eager course needs values there."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (DataDependentOutputException, GuardOnDataDependentSymNode)):
            return True
        seen = seen.__cause__ or seen.__context__
    return "data-dependent" in str(error) or "data dependent" in str(error)
