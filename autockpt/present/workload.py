"""What the command line runs on: its values parsed (budgets and sizes, the host pool, input specs such as
``input_ids=int64[4,512]:high=50257``) and the workload built from them (a built-in example or the user's
``package.module:factory``, its example inputs and loss). Every mistake is a ``UserInputError`` saying what to give.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autockpt.errors import AutockptError, first_line

# --------------------------------------------------------------------------------------------- parsing values


class UserInputError(AutockptError, ValueError):
    """A command-line value autockpt cannot use; the message says what to give instead."""


_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET = re.compile(r"^\s*(?P<number>(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_budget(text: str) -> int:
    """'8GB' (10^9), '7.5GiB' (2^30), '500MB', '1e9' or '123456789' (bytes) -> bytes."""
    match = _BUDGET.match(text)
    unit = match.group("unit").lower() if match else ""
    scale = _DECIMAL.get(unit) or _BINARY.get(unit)
    if match is None or scale is None:
        raise UserInputError(
            f"budget {text!r} not understood: give a number and a unit, e.g. 8GB (GB = 10^9 bytes), 7.5GiB "
            "(GiB = 2^30 bytes), 500MB, or a plain number of bytes"
        )
    value = float(match.group("number")) * scale
    if value < 1:
        raise UserInputError(f"budget {text!r} is less than one byte; give a positive budget such as 8GB")
    return round(value)


def parse_host_pool(text: str) -> float | str:
    """'0' (no pool), 'auto' (half the host memory available), or a size like '--budget' -> ``host_pool_gb``."""
    if text.strip().lower() == "auto":
        return "auto"
    if text.strip() in ("0", "0GB", "0.0"):
        return 0
    try:
        return parse_budget(text) / 1e9
    except UserInputError:
        raise UserInputError(
            f"--host-pool {text!r} not understood: give 0 (no offloading), auto (up to half the host memory available), "
            "or a size such as 16GB (GB = 10^9 bytes) or 8GiB"
        ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class InputSpec:
    """One example input described on the command line: ``name=dtype[d0,d1,...]:fill``."""

    name: str | None  # None: a positional argument
    dtype: str
    shape: tuple[int, ...]
    fill: str  # randn | rand | zeros | ones | high=N (integers uniform in [0, N))


_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "float16": "float16", "half": "float16",
    "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64", "double": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "int8": "int8",
    "uint8": "uint8", "bool": "bool",
}
_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<dtype>\w+)\[(?P<shape>[\d,\s]*)\](?::(?P<fill>[\w=.]+))?$")
_SPEC_HELP = (
    "write it as name=dtype[d0,d1,...] (a keyword argument) or dtype[d0,...] (positional), optionally followed by "
    ":randn, :rand, :zeros, :ones or :high=N (integers in [0, N)); e.g. input_ids=int64[4,512]:high=50257 or "
    "x=float32[8,3,224,224]"
)


def parse_input_spec(text: str) -> InputSpec:
    match = _SPEC.match(text.strip())
    if match is None:
        raise UserInputError(f"input spec {text!r} not understood: {_SPEC_HELP}")
    dtype = _DTYPES.get(match.group("dtype").lower())
    if dtype is None:
        raise UserInputError(
            f"input spec {text!r}: unknown dtype {match.group('dtype')!r}; use one of {', '.join(sorted(set(_DTYPES.values())))}"
        )
    dims = [d.strip() for d in match.group("shape").split(",") if d.strip()]
    shape = tuple(int(d) for d in dims)
    if any(d <= 0 for d in shape):
        raise UserInputError(f"input spec {text!r}: every dimension must be a positive integer, got {list(shape)}")
    floating = dtype.startswith(("float", "bfloat"))
    fill = match.group("fill") or ("randn" if floating else "high=2")
    if fill.startswith("high="):
        high = fill.removeprefix("high=")
        if floating or not high.isdigit() or int(high) < 1:
            raise UserInputError(f"input spec {text!r}: ':high=N' takes a positive integer N and an integer dtype")
    elif fill not in ("randn", "rand", "zeros", "ones") or (fill in ("randn", "rand") and not floating):
        raise UserInputError(f"input spec {text!r}: fill {fill!r} does not fit dtype {dtype}; {_SPEC_HELP}")
    return InputSpec(name=match.group("name"), dtype=dtype, shape=shape, fill=fill)


def make_tensor(spec: InputSpec, device: str) -> Any:
    import torch

    dtype = getattr(torch, spec.dtype)
    if spec.fill == "randn":
        return torch.randn(spec.shape, dtype=dtype, device=device)
    if spec.fill == "rand":
        return torch.rand(spec.shape, dtype=dtype, device=device)
    if spec.fill in ("zeros", "ones"):
        return getattr(torch, spec.fill)(spec.shape, dtype=dtype, device=device)
    high = int(spec.fill.removeprefix("high="))
    return torch.randint(0, high, spec.shape, device=device).to(dtype)


# ----------------------------------------------------------------------------------------------- loading models


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What a command plans for: a model, its example inputs and its loss."""

    label: str
    model: Any
    args: tuple
    kwargs: dict
    loss_fn: Callable[[Any], Any] | None


def resolve_reference(reference: str, what: str) -> Callable[..., Any]:
    """'package.module:attribute' -> the attribute (the current directory is importable, as with ``python -m``)."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise UserInputError(f"{what} {reference!r} must look like package.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UserInputError(
            f"cannot import {module_name!r} (from {what} {reference!r}): {error}. Check the spelling, and run from the "
            "directory that contains the package or install it"
        ) from error
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise UserInputError(f"{module_name!r} has no attribute {attribute!r} (from {what} {reference!r})")
        found = getattr(found, part)
    if not callable(found):
        raise UserInputError(f"{reference!r} is a {type(found).__name__}, not a function: {what} must name a callable")
    return found


def load_workload(
    model_ref: str | None, size: str, input_texts: tuple[str, ...], inputs_ref: str | None, device: str, seed: int,
    *, meta: bool = False, hf_config: str | None = None, tokens: tuple[int, int] | None = None,
) -> Workload:
    """The model and example inputs the command plans; ``meta``: the model is built on the meta device (no weights
    anywhere: planned from a fake trace), the example inputs on ``device``. ``hf_config``: a Hugging Face config
    (``hf_config_workload``) instead of ``model_ref``."""
    if (model_ref is None) == (hf_config is None):
        raise UserInputError(
            "give MODEL (a built-in example or package.module:factory) or --hf-config PATH_OR_NAME, one of the two"
        )
    if hf_config is not None:
        return hf_config_workload(hf_config, input_texts, inputs_ref, device, seed, tokens or (1, 512))
    if tokens is not None:
        raise UserInputError("--batch and --seq size the token ids of an --hf-config model; give --input for MODEL")
    import contextlib

    import torch
    from torch import nn

    from autockpt.present import zoo

    torch.manual_seed(seed)
    loss_fn = None
    building = torch.device("meta") if meta else contextlib.nullcontext()
    if model_ref in zoo.BUILDERS:
        with building:
            case = zoo.build(model_ref, size, seed=seed)
        model, args, kwargs, loss_fn = case.model, case.args, dict(case.kwargs), case.loss_fn
        label = f"{model_ref} ({size})"
    elif ":" in model_ref:
        factory = resolve_reference(model_ref, "MODEL")
        with building:
            model = _call_user(factory, f"the model factory {model_ref!r}")
        if not isinstance(model, nn.Module):
            raise UserInputError(f"the model factory {model_ref!r} returned a {type(model).__name__}, not a torch.nn.Module")
        args, kwargs, label = (), {}, model_ref
    else:
        raise UserInputError(
            f"MODEL {model_ref!r} is neither a built-in example ({', '.join(sorted(zoo.BUILDERS))}) nor a "
            "package.module:factory reference to a function that returns an nn.Module"
        )
    given = _given_inputs(input_texts, inputs_ref, device)
    if given is not None:
        args, kwargs = given
    elif model_ref not in zoo.BUILDERS:
        raise UserInputError(
            f"no example inputs for {model_ref!r}: give --input SPEC (e.g. --input 'x=float32[8,3,224,224]') or "
            "--inputs package.module:make_inputs"
        )
    if not meta:
        model = model.to(device)
    def placed(value: Any) -> Any:  # an input built on the meta device (--meta) stays there: the trace is fake
        return value.to(device) if isinstance(value, torch.Tensor) and value.device.type != "meta" else value

    args = tuple(placed(a) for a in args)
    kwargs = {k: placed(v) for k, v in kwargs.items()}
    return Workload(label=label, model=model, args=args, kwargs=kwargs, loss_fn=loss_fn)


def hf_config_workload(
    config_ref: str, input_texts: tuple[str, ...], inputs_ref: str | None, device: str, seed: int,
    tokens: tuple[int, int],
) -> Workload:
    """A Hugging Face model built from its config alone, on the meta device (no weights anywhere, as ``accelerate
    estimate-memory`` takes a model name): a causal LM (``AutoModelForCausalLM``), else the bare model
    (``AutoModel``), in the config's dtype. ``config_ref``: a ``config.json``, a folder holding one, or a hub name
    where the network allows. Inputs: ``--input`` specs, or token ids of ``tokens`` (batch, sequence) below the
    vocabulary, the labels the same ids (the model's own loss, ``output.loss``)."""
    import torch

    try:
        import transformers
    except ImportError as missing:
        raise UserInputError("--hf-config needs transformers: pip install 'autockpt[zoo]'") from missing
    try:
        config = transformers.AutoConfig.from_pretrained(config_ref)
    except (OSError, ValueError) as error:
        raise UserInputError(
            f"--hf-config {config_ref!r}: no Hugging Face config there ({type(error).__name__}: {first_line(error)}); "
            "give a config.json, a folder holding one, or a hub name (needs the network)"
        ) from error
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    with torch.device("meta"):
        try:
            model, kind = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype), "causal LM"
        except ValueError:  # not a causal LM: the bare model (an encoder, a vision backbone)
            model, kind = transformers.AutoModel.from_config(config, dtype=dtype), "model"
    label = f"{type(model).__name__} from {config_ref} ({kind}, {str(dtype).removeprefix('torch.')}, meta)"
    given = _given_inputs(input_texts, inputs_ref, device)
    if given is not None:
        return Workload(label=label, model=model, args=given[0], kwargs=given[1], loss_fn=None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or kind != "causal LM":
        raise UserInputError(
            f"{label}: give its inputs with --input SPEC (token ids need a causal LM with a vocab_size)"
        )
    ids = torch.randint(0, vocab, tokens, device=device)
    return Workload(label=label, model=model, args=(), kwargs={"input_ids": ids, "labels": ids}, loss_fn=None)


def _given_inputs(input_texts: tuple[str, ...], inputs_ref: str | None, device: str) -> tuple[tuple, dict] | None:
    """The example inputs given by ``--input`` specs or an ``--inputs`` function; None when neither was given."""
    if input_texts and inputs_ref:
        raise UserInputError("give --input specs or --inputs package.module:function, not both")
    if input_texts:
        specs = [parse_input_spec(text) for text in input_texts]
        return (tuple(make_tensor(s, device) for s in specs if s.name is None),
                {s.name: make_tensor(s, device) for s in specs if s.name is not None})
    if inputs_ref:
        made = _call_user(resolve_reference(inputs_ref, "--inputs"), f"the input function {inputs_ref!r}")
        return _split_inputs(made, inputs_ref)
    return None


def _call_user(function: Callable[[], Any], what: str) -> Any:
    try:
        return function()
    except Exception as error:  # the user's code: report it as one line, the traceback with --debug
        raise UserInputError(f"{what} raised {type(error).__name__}: {error}") from error


def _split_inputs(made: Any, reference: str) -> tuple[tuple, dict]:
    import torch

    if isinstance(made, torch.Tensor):
        return (made,), {}
    if isinstance(made, dict):
        return (), dict(made)
    if isinstance(made, (tuple, list)):
        return tuple(made), {}
    raise UserInputError(
        f"the input function {reference!r} returned a {type(made).__name__}; return a tensor, a tuple of positional "
        "arguments, or a dict of keyword arguments"
    )
