"""Tensor sizes: bytes per element of a dtype, a tensor's bytes under ``dtype`` / ``special_dtypes`` / ``size_fn``,
and the counted bytes of every subtree.

Every size comes in two: the real bytes, and the bytes as accelerate counts them (``dtype_byte_size``: a bool element
is 1/8 byte there), which ``sequential`` follows to reproduce accelerate's maps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from ..errors import InvalidOption

__all__ = ["SizeFn", "SizeOf", "DTYPE_ALIASES", "as_dtype", "dtype_bytes", "is_packed", "PerElement", "size_rule",
           "subtree_sizes"]

SizeFn = Callable[[str, object], "int | None"]
"""A caller's ``size_fn(name, tensor) -> bytes or None`` (quantized weights; ``None``: the dtype rule decides)."""

SizeOf = Callable[[str, object, int, bool], "tuple[int, float]"]
"""``size_of(name, tensor, numel, keeps) -> (bytes, accelerate's bytes)``: one tensor's size under a build's options;
``keeps``: a non-persistent buffer, in no checkpoint, which no loader casts: a floating ``dtype`` leaves its real
bytes as they are (llama's float32 ``inv_freq``), while accelerate's bytes follow ``dtype`` as accelerate counts."""

_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_SUB_BYTE = {f"torch.{sign}int{bits}": bits for sign in ("", "u") for bits in range(1, 8)}
"""torch's sub-byte integer dtypes (``torch.int4``, ``torch.uint2``, ...) -> bits per element. torch reports an
element size of 1 byte for them; stored, they are packed (``int4``: two per byte)."""


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
"""Short names people type for dtypes (``--dtype bf16``), read as the torch names."""


def as_dtype(dtype, what: str):
    """``dtype`` as a ``torch.dtype``: a dtype, or its name (``"float16"``, ``"torch.bfloat16"``, or an alias of
    :data:`DTYPE_ALIASES` such as ``"bf16"``); ``what`` names it in the :class:`~allocator.errors.InvalidOption` raised
    for anything else.

    >>> as_dtype("bfloat16", "dtype"), as_dtype("bf16", "dtype"), as_dtype("FP32", "dtype")
    (torch.bfloat16, torch.bfloat16, torch.float32)
    """
    import torch

    if isinstance(dtype, str):
        name = dtype.strip().replace("torch.", "")
        name = DTYPE_ALIASES.get(name.lower(), name)
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise InvalidOption(f"{what}: {dtype!r} is not a torch dtype; use e.g. 'bfloat16', 'bf16', "
                                f"'float16', 'fp16' or torch.bfloat16.")
        return value
    if not isinstance(dtype, torch.dtype):
        raise InvalidOption(f"{what}: expected a torch.dtype or its name, got {type(dtype).__name__} {dtype!r}.")
    return dtype


def dtype_bytes(dtype) -> tuple[float, float]:
    """(real bytes per element, bytes per element as accelerate's ``dtype_byte_size`` says).

    Sub-byte integers are packed: ``int4`` is half a byte, as accelerate counts its ``CustomDtype.INT4`` (its
    ``dtype_byte_size(torch.int4)`` says 0, ``4 // 8``). Every other dtype has a whole number of bytes.

    >>> import torch
    >>> dtype_bytes(torch.bool), dtype_bytes(torch.float16), dtype_bytes(torch.int4)
    ((1, 0.125), (2, 2), (0.5, 0.5))
    """
    found = _DTYPE_BYTES.get(dtype)
    if found is None:
        found = _DTYPE_BYTES[dtype] = _dtype_bytes(dtype)
    return found


_DTYPE_BYTES: dict = {}  # dtype -> dtype_bytes(dtype); torch dtypes are few and immutable


def _dtype_bytes(dtype) -> tuple[float, float]:
    import torch

    bits = _SUB_BYTE.get(str(dtype))
    if bits is not None:
        return bits / 8, bits / 8
    real = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return real, 1 / 8
    if dtype in [getattr(torch, n) for n in _FLOAT8 if hasattr(torch, n)]:
        return real, 1
    return real, real


def is_packed(dtype) -> bool:
    """Whether ``dtype`` is a sub-byte integer (``torch.int4``, ...), stored several elements to a byte: a tensor's
    bytes are then rounded up per tensor, so they do not follow from its dtype alone."""
    return str(dtype) in _SUB_BYTE


def _keeps_dtype(dtype) -> bool:
    """Integer and bool tensors are not converted by ``dtype`` (accelerate's ``set_module_tensor_to_device``)."""
    return str(dtype).startswith(("torch.uint", "torch.int", "torch.bool"))


class PerElement:
    """Bytes per element of a tensor dtype under the ``dtype`` rule (real, accelerate's), memoised per dtype:
    ``PerElement(target)(tensor.dtype)``, where floating tensors count at ``min(target, own)`` bytes and int and bool
    keep their size. ``known`` is the memo (dtype -> the pair), which a hot loop may read directly."""

    def __init__(self, target):
        self.target = target
        self.known: dict = {}
        self.casts = target is not None and target.is_floating_point   # the loaders cast to it (not quantizers)

    def __call__(self, dtype) -> tuple[int, float]:
        found = self.known.get(dtype)
        if found is None:
            own_real, own_acc = dtype_bytes(dtype)
            if self.target is None or _keeps_dtype(dtype):
                found = own_real, own_acc
            else:
                t_real, t_acc = dtype_bytes(self.target)
                found = min(t_real, own_real), min(t_acc, own_acc)
            self.known[dtype] = found
        return found


def size_rule(target, special: Mapping[str, object], size_fn: SizeFn | None) -> tuple[SizeOf, PerElement | None]:
    """The size rule of one build, as ``(size_of, by_dtype)``.

    ``size_of(name, tensor, numel, keeps=False)`` gives any tensor's (bytes, accelerate's bytes): ``size_fn``'s answer
    when it gives one, else the tensor's ``special_dtypes`` entry, else ``target`` (``dtype``, or None) for floating
    tensors (but those that ``keeps``: :data:`SizeOf`).
    ``by_dtype`` is the :class:`PerElement` table when the dtype alone decides every size (no ``size_fn``, no
    ``special_dtypes``, no packed ``target``), so that a walk can multiply instead of calling ``size_of``; else None.
    """
    per_element = PerElement(target)

    def size_of(name, tensor, numel, keeps=False):
        if size_fn is None and name not in special:
            real, accel = per_element(tensor.dtype)
            if keeps and per_element.casts:
                real = dtype_bytes(tensor.dtype)[0]
            return _whole(numel * real), numel * accel
        return _tensor_bytes(name, tensor, target, special, size_fn, numel, keeps)

    packed = target is not None and is_packed(target)
    return size_of, (per_element if size_fn is None and not special and not packed else None)


def _tensor_bytes(name, tensor, target, special, size_fn, numel, keeps=False) -> tuple[int, float]:
    if size_fn is not None:
        custom = size_fn(name, tensor)
        if custom is not None:
            if not isinstance(custom, (int, float)) or custom < 0 or custom != custom:
                raise InvalidOption(f"size_fn returned {custom!r} for {name!r}; it must return bytes >= 0 or None.")
            return int(custom), custom
    own_real, own_acc = dtype_bytes(tensor.dtype)
    if name in special:
        real, acc = dtype_bytes(special[name])
        return _whole(numel * real), numel * acc
    if target is None or _keeps_dtype(tensor.dtype):
        return _whole(numel * own_real), numel * own_acc
    t_real, t_acc = dtype_bytes(target)
    if keeps and target.is_floating_point:
        t_real = own_real
    return _whole(numel * min(t_real, own_real)), numel * min(t_acc, own_acc)


def _whole(nbytes: float) -> int:
    """Whole bytes: a packed (sub-byte) tensor's last byte is stored whole."""
    return nbytes if isinstance(nbytes, int) else math.ceil(nbytes)


def subtree_sizes(direct: list[int], direct_accelerate: list[float],
                  parents: Sequence[int]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Counted bytes of every node's subtree (real, accelerate's), from each node's direct counted bytes, with
    ``parents`` the nodes' parents in preorder. The two lists are summed in place.

    Sums run in accelerate's order (the float sums of accelerate's sizes depend on it): each subtree into its
    parent, last node first. O(nodes).
    """
    for i, parent in zip(range(len(direct) - 1, 0, -1), reversed(parents)):  # preorder: children after parents
        direct[parent] += direct[i]
        direct_accelerate[parent] += direct_accelerate[i]
    return tuple(direct), tuple(direct_accelerate)
