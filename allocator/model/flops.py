"""FLOPs per module at the user's input shapes: one forward on the meta device under ``FlopCounterMode``.

The rule ``2 · params · tokens`` misses everything a model computes besides its weight products (attention scores,
convolutions over large images) and overcounts what it skips (embeddings are lookups). One forward on the meta
device computes no numbers, only shapes, so it is cheap at any size, and ``torch.utils.flop_counter`` gives the
FLOPs of every matrix product, convolution and attention it dispatches. Each op is charged to the innermost module
running when it is dispatched: the *exclusive* FLOPs of a module (its own ops, not its children's), which sum to the
total. On meta, ``scaled_dot_product_attention`` decomposes into counted products; on a real CPU forward it runs a
fused kernel that ``FlopCounterMode`` has no formula for.

Where the forward fails on meta, or runs ops that do arithmetic without a FLOP formula (MoE grouped products
``aten._grouped_mm``, custom kernels), :attr:`FlopCount.complete` is ``False`` and the result says why, so that a
caller keeps the parameter rule.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import InvalidOption

__all__ = ["FlopCount", "count_flops", "default_inputs", "node_flops", "node_values", "meta_copy", "TOKENS",
           "IMAGE_SIZE", "POINTWISE", "RESAMPLE", "MAX_OPS"]

log = logging.getLogger(__name__)

TOKENS = 512
"""Tokens of the default prompt of a text model (fewer where its position table is shorter)."""
IMAGE_SIZE = 512
"""Side of the default image of a vision model whose config has no ``image_size`` (segmenters)."""

MAX_OPS = 30_000
"""Ops one counted forward may dispatch before the count gives up (incomplete: the compute term keeps the parameter
rule): a reference kernel that loops on meta (mamba's selective scan: 161k ops, 9 s) costs more than it tells.
llama-70b's forward at 512 tokens dispatches 8k."""
_INTEGER_INPUTS = ("ids", "mask", "positions", "position")   # inputs given by shape that hold indices, not values

POINTWISE = frozenset({
    "gelu", "silu", "sigmoid", "tanh", "exp", "log", "erf", "pow", "sqrt", "rsqrt", "reciprocal", "sin", "cos",
    "elu", "softplus", "mish", "hardswish", "hardsigmoid", "leaky_relu", "_softmax", "softmax", "_log_softmax",
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit", "upsample_bilinear2d", "upsample_nearest2d", "upsample_bicubic2d", "grid_sampler_2d",
})
"""Aten ops (without their ``aten.`` namespace) that evaluate a function per element of their output: their bytes go
to :attr:`FlopCount.pointwise`, the others' without a FLOP formula to :attr:`FlopCount.written`."""
RESAMPLE = frozenset({"upsample_bilinear2d", "upsample_nearest2d", "upsample_bicubic2d", "grid_sampler_2d"})
"""The interpolating ops among :data:`POINTWISE`. Given an input that is not contiguous and writing a contiguous
output (a channels-last view whose batch stride torch does not read as channels last, as SegFormer's decode head
makes with ``permute`` and ``reshape``), torch's CPU kernel gathers element by element, an order of magnitude
slower: those bytes go to :attr:`FlopCount.strided` (the meta device keeps strides, so the count sees it)."""


@dataclass(frozen=True, slots=True)
class FlopCount:
    """What one forward at ``inputs`` computes, per module path (``named_modules`` names, ``""`` the root).

    A module object reachable under several paths is reported under its first.
    """

    inputs: Mapping[str, tuple[int, ...]]
    """The shapes the forward ran with (given, or :func:`default_inputs`)."""
    flops: Mapping[str, int]
    """Exclusive FLOPs per module: its own ops, not its children's. They sum to :attr:`total`."""
    ops: Mapping[str, int]
    """Aten ops each module dispatched itself (views and copies included): a per-op launch cost where it runs."""
    output_bytes: Mapping[str, int]
    """Bytes of the tensors each module returned (summed over its calls): the activations leaving it."""
    total: int
    """FLOPs of the whole forward, as ``FlopCounterMode.get_total_flops`` counts them."""
    uncounted: tuple[str, ...] = ()
    """Ops that ran and do arithmetic ``FlopCounterMode`` has no formula for (``aten._grouped_mm``, custom ops)."""
    error: str | None = None
    """Why the forward failed on the meta device (the op and the message), or ``None``."""
    copied: bool = False
    """Whether the forward ran on a meta copy of the model (its weights were not all on the meta device)."""
    defaults: bool = field(default=False)
    """Whether :attr:`inputs` were derived from the config (:func:`default_inputs`)."""
    written: Mapping[str, int] = field(default_factory=dict)
    """Bytes of the outputs of the ops each module dispatched itself that have no FLOP formula, are not views and
    evaluate no function per element (additions, products by a scalar, copies, concatenations): memory traffic."""
    pointwise: Mapping[str, int] = field(default_factory=dict)
    """Bytes of the outputs of the ops each module dispatched itself that evaluate a function per element
    (:data:`POINTWISE`: activations, normalisations, softmax, interpolation): slower per byte than a copy on a CPU."""
    strided: Mapping[str, int] = field(default_factory=dict)
    """Bytes of the outputs of the interpolations each module dispatched itself that gather across memory layouts
    (:data:`RESAMPLE`: a non-contiguous input, a contiguous output); not in :attr:`pointwise`."""

    @property
    def complete(self) -> bool:
        """Whether every op of the forward was counted: it ran, and nothing ran without a formula."""
        return self.error is None and not self.uncounted

    def reason(self) -> str:
        """Why the count is not complete, in words ("" when it is)."""
        if self.error is not None and self.error.startswith("more than"):
            return f"the forward dispatched {self.error}"
        if self.error is not None:
            return f"the forward failed on the meta device ({self.error})"
        if self.uncounted:
            return f"ops without a FLOP formula ran: {', '.join(self.uncounted)}"
        return ""


def default_inputs(model, *, tokens: int = TOKENS, image_size: int = IMAGE_SIZE) -> dict[str, tuple[int, ...]]:
    """Inputs of one forward from a transformers model's config: a ``tokens`` prompt for a text model
    (``input_ids``, and ``decoder_input_ids`` for an encoder-decoder; fewer tokens where its position table is
    shorter), ``pixel_values`` at ``config.image_size`` (``image_size`` without one) for a vision model.

    Raises
    ------
    InvalidOption
        The model has no transformers config, or its main input is neither ``input_ids`` nor ``pixel_values``.

    Examples
    --------
    >>> from transformers import ViTConfig, ViTModel
    >>> default_inputs(ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...                                    intermediate_size=32, image_size=64)))
    {'pixel_values': (1, 3, 64, 64)}
    """
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if config is None or main not in ("input_ids", "pixel_values"):
        raise InvalidOption(f"no default inputs for {type(model).__name__} (main input {main!r}); pass inputs as "
                            "shapes, e.g. inputs={'input_ids': (1, 512)}.")
    if main == "pixel_values":
        size = getattr(config, "image_size", None) or image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        return {"pixel_values": (1, getattr(config, "num_channels", 3), int(height), int(width))}
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    length = min(tokens, limit) if isinstance(limit, int) and limit > 0 else tokens
    found = {"input_ids": (1, length)}
    if getattr(config, "is_encoder_decoder", False):
        found["decoder_input_ids"] = (1, length)
    return found


def count_flops(model, inputs: Mapping | None = None, *, max_ops: int = MAX_OPS) -> FlopCount:
    """Count one forward of ``model`` at ``inputs`` on the meta device, per module.

    Parameters
    ----------
    model : torch.nn.Module
        Never modified: a model on the meta device runs as it is, with hooks that are removed afterwards (also on an
        error); any other runs as a deep copy whose parameters and buffers are meta tensors (no weight is copied).
    inputs : mapping, optional
        Keyword arguments of the forward: shapes (``{"input_ids": (1, 512)}``; names with ``ids``, ``mask`` or
        ``position`` become int64, others the model's floating dtype) or tensors (moved to meta).
        :func:`default_inputs` when ``None``.
    max_ops : int
        Ops the forward may dispatch; past them the count stops, incomplete (:data:`MAX_OPS`).

    Returns
    -------
    FlopCount
        Exclusive FLOPs, op counts and output bytes per module; where the forward fails or an op has no formula,
        what was counted until then with :attr:`FlopCount.complete` ``False``.

    Raises
    ------
    InvalidOption
        ``inputs`` is not a mapping of shapes or tensors, or is ``None`` for a model without defaults.

    Examples
    --------
    >>> import torch.nn as nn
    >>> count = count_flops(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), {"input": (2, 8)})
    >>> count.total, dict(count.flops), count.output_bytes["0"], count.complete
    (128, {'': 0, '0': 128, '1': 0}, 32, True)
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(model, torch.nn.Module):
        raise InvalidOption(f"count_flops takes a torch.nn.Module, got {type(model).__name__}.")
    defaults = inputs is None
    if defaults:
        inputs = default_inputs(model)
    if not isinstance(inputs, Mapping):
        raise InvalidOption(f"inputs must map forward argument names to shapes or tensors, got {inputs!r}; e.g. "
                            "{'input_ids': (1, 512)}.")
    on_meta = all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    run = model if on_meta else meta_copy(model)
    arguments = _meta_inputs(inputs, _floating_dtype(run))
    flops, ops, out_bytes = defaultdict(int), defaultdict(int), defaultdict(int)
    written, pointwise, strided = defaultdict(int), defaultdict(int), defaultdict(int)
    uncounted: set[str] = set()
    stack: list[str] = []
    failed: list[str] = []
    handles = []
    error = None
    try:
        for name, module in run.named_modules():
            handles.append(module.register_forward_pre_hook(_push(stack, name)))
            handles.append(module.register_forward_hook(_pop(stack, out_bytes, name), always_call=True))
        counter = FlopCounterMode(display=False)
        traffic = (written, pointwise, strided)
        with _charge(counter, stack, flops, ops, uncounted, failed, traffic, max_ops), counter, torch.no_grad():
            run(**arguments)
    except _TooManyOps as err:  # reported as the limit, not as a failure
        error = str(err)
        log.info("counting FLOPs of %s on the meta device stopped: %s", type(model).__name__, error)
    except Exception as err:  # reported: the caller falls back to the parameter rule
        error = f"{failed[-1]}: {err}" if failed else f"{type(err).__name__}: {err}"
        error = error.splitlines()[0][:300]
        log.info("counting FLOPs of %s on the meta device failed: %s", type(model).__name__, error)
    finally:
        for handle in handles:
            handle.remove()
    total = counter.get_total_flops() if error is None else sum(flops.values())
    if error is None and sum(flops.values()) != total:   # a higher-order op FlopCounterMode counted itself
        flops[""] += total - sum(flops.values())
    names = [name for name, _ in run.named_modules()]
    return FlopCount(
        inputs={k: tuple(v.shape) for k, v in arguments.items()},
        flops={n: flops.get(n, 0) for n in names}, ops={n: ops.get(n, 0) for n in names},
        output_bytes={n: out_bytes.get(n, 0) for n in names}, total=total, uncounted=tuple(sorted(uncounted)),
        error=error, copied=not on_meta, defaults=defaults, written={n: written.get(n, 0) for n in names},
        pointwise={n: pointwise.get(n, 0) for n in names}, strided={n: strided.get(n, 0) for n in names},
    )


def meta_copy(model):
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the same shapes and dtypes (ties
    kept: one tensor object gives one copy); the weights themselves are never copied."""
    import torch

    memo = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def _floating_dtype(model):
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _meta_inputs(inputs: Mapping, dtype) -> dict:
    import torch

    out = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            out[name] = value.to("meta")
            continue
        shape = tuple(value) if isinstance(value, (tuple, list, torch.Size)) else None
        if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            raise InvalidOption(f"inputs[{name!r}] must be a shape of positive ints or a tensor, got {value!r}; "
                                "e.g. (1, 512).")
        integer = any(part in name for part in _INTEGER_INPUTS)
        out[name] = torch.zeros(shape, dtype=torch.long if integer else dtype, device="meta")
    return out


def _push(stack: list, name: str):
    def hook(module, args):
        stack.append(name)
    return hook


def _pop(stack: list, out_bytes: dict, name: str):
    def hook(module, args, output):
        if stack and stack[-1] == name:
            stack.pop()
        out_bytes[name] += _tensor_bytes(output)
    return hook


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in a module's output (tensors in tuples, lists and mappings, e.g. a ``ModelOutput``)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _does_arithmetic(packet) -> bool:
    """Ops whose work a missing formula would hide: products, convolutions, attention, and any non-aten op."""
    namespace, _, name = str(packet).partition(".")
    return namespace not in ("aten", "prims", "prim") or any(w in name for w in ("mm", "conv", "attention", "einsum"))


class _TooManyOps(Exception):
    """Raised by the counting mode past ``max_ops`` ops: the count stops there."""


def _charge(counter, stack: list, flops: dict, ops: dict, uncounted: set, failed: list, traffic: tuple,
            max_ops: int):
    """A dispatch mode entered outside ``counter``: it sees each op ``counter`` executes (after its decompositions)
    and charges it, with the same formula, to the innermost running module; the bytes an op without a formula
    writes (not a view) go to ``traffic``: ``(written, pointwise, strided)`` by :data:`POINTWISE` and
    :func:`_gathers`; past ``max_ops`` ops it raises :class:`_TooManyOps`."""
    written, pointwise, strided = traffic
    seen = [0]
    from torch.utils._python_dispatch import TorchDispatchMode

    registry = counter.flop_registry

    class Charge(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            packet = func._overloadpacket
            try:
                out = func(*args, **kwargs)
            except Exception:
                failed.append(str(packet))
                raise
            where = stack[-1] if stack else ""
            ops[where] += 1
            seen[0] += 1
            if seen[0] > max_ops:
                raise _TooManyOps(f"more than {max_ops:,} ops (counting stops there; count_flops(max_ops=...) "
                                  "raises the limit)")
            formula = registry.get(packet)
            if formula is not None:
                flops[where] += formula(*args, **kwargs, out_val=out)
            else:
                if _does_arithmetic(packet):
                    uncounted.add(str(packet))
                if not getattr(func, "is_view", False):
                    op = packet.__name__
                    kind = strided if _gathers(op, args, out) else pointwise if op in POINTWISE else written
                    kind[where] += _tensor_bytes(out)
            return out

    return Charge()


def _gathers(op: str, args, out) -> bool:
    """Whether an interpolation (:data:`RESAMPLE`) reads a non-contiguous input into a contiguous output."""
    import torch

    if op not in RESAMPLE or not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return not args[0].is_contiguous() and out.is_contiguous()


def node_flops(count: FlopCount, graph) -> tuple[int, ...]:
    """:attr:`FlopCount.flops` per node of ``graph`` (an :class:`allocator.model.ModelGraph` of the same model), in
    node order; a path the graph does not have is charged to the root, so they sum to the total."""
    return node_values(count.flops, graph)


def node_values(values: Mapping[str, int], graph) -> tuple[int, ...]:
    """Per-module ``values`` (:attr:`FlopCount.flops`, :attr:`FlopCount.ops`, ...) per node of ``graph``, in node
    order; a path the graph does not have is charged to the root."""
    out = [0] * len(graph.nodes)
    index = graph.node_index
    for name, value in values.items():
        out[index.get(name, 0)] += value
    return tuple(out)
