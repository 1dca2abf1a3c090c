"""Budgets: turn a ``max_memory`` dict (as accelerate accepts it) into ordered devices with byte budgets.

Devices are written the way accelerate's device maps write them: accelerators as integer indices
(``0``, ``1``, ...), or ``"mps"``; then ``"cpu"``, then ``"disk"``. Keys such as ``"cuda:1"``, ``"xpu:0"``,
``"npu:0"`` or ``torch.device("cuda", 1)`` are normalised to their index, because accelerate's
``dispatch_model`` picks the main device from a ``set`` of the map's values, which is only predictable for
integers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import InvalidBudget, InvalidDeviceMap, InvalidOption, warn_caller

__all__ = ["Device", "Budgets", "ByDevice", "canonical", "parse_size", "format_bytes", "format_ms", "normalize_device",
           "normalize_map", "parse_budgets", "is_accelerator", "small_bare_number", "warn_misread"]

Device = int | str

_ACCELERATOR_TYPES = ("cuda", "xpu", "npu", "mlu", "musa", "sdaa", "hpu")
_NAMED = ("mps", "cpu", "disk")
_SIZE_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B|[KMGT]b|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
#: A bare number of bytes below this, for a device, is likely a size in GiB without its unit (``{"cpu": 64}``).
SMALL_BARE_BUDGET = 2**20


def parse_size(size: int | float | str, *, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"10GiB"``, ``"500MB"`` or ``"4Gb"`` (gigabits, as accelerate reads it).

    Parameters
    ----------
    size : int, float or str
        A non-negative number of bytes, or a string of a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB;
        any case), read as accelerate 1.16's ``convert_file_size_to_int`` reads it: the case of ``KiB``, ``MiB``,
        ``GiB`` does not matter (``"3gib"`` and ``"3Gib"`` are 3 GiB), a lower-case final ``b`` after K, M or G means
        bits (``"10gb"`` and ``"10Gb"`` are 1.25 GB; ``"10gB"`` is 10 GB), and a string needs a unit (``"1e9"`` and
        ``"64"`` are rejected: give ints for bytes). accelerate does not read ``TB``, ``TiB`` or ``B``; they are
        accepted here. A float is bytes rounded down, as accelerate compares it with whole byte counts.
    what : str
        Named in the error message.

    Returns
    -------
    int

    Raises
    ------
    InvalidBudget
        For negative, non-finite, boolean or unparsable sizes, and strings without a unit.

    Warns
    -----
    UserWarning
        Once per process for each distinct input: a lower-case ``b`` (bits), a unit spelled in another case than
        ``GiB``, ``GB`` or ``kB`` (``"3gib"``, ``"3gB"``), and a float that is not a whole number of bytes; each says
        the bytes it became and what to write instead.

    Examples
    --------
    >>> parse_size("1MiB"), parse_size("2GB"), parse_size(1024)
    (1048576, 2000000000, 1024)
    """
    if isinstance(size, bool):
        raise InvalidBudget(f"{what} must be a number of bytes or a string like '10GiB', got the boolean {size!r}.")
    if isinstance(size, int):
        value = size
    elif isinstance(size, float):
        value = _parse_float(size, what)
    elif isinstance(size, str):
        value = _parse_text(size, what)
    else:
        raise InvalidBudget(
            f"{what} must be an int of bytes or a string like '10GiB', got {type(size).__name__} {size!r}."
        )
    if value < 0:
        raise InvalidBudget(_negative(what, size))
    return value


#: Unit spellings read without a warning: what accelerate's and allocator's docs write.
_USUAL_UNITS = frozenset({"B", "KB", "kB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"})
#: The units accelerate's ``convert_file_size_to_int`` reads (it rejects ``B``, ``TB``, ``TiB``), upper-cased.
_ACCELERATE_UNITS = frozenset({"KB", "MB", "GB", "KIB", "MIB", "GIB"})
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """:func:`warn_caller`, once per process for each message (a budget is read several times per plan)."""
    if message not in _warned:
        _warned.add(message)
        warn_caller(message)


def _negative(what: str, size) -> str:
    return (f"{what} is negative ({size!r}); budgets are non-negative: give an int of 0 or more bytes, or a string "
            "with a unit such as '10GiB' or '500MB'.")


def _parse_float(size: float, what: str) -> int:
    """A float of bytes, rounded down: accelerate's ``get_max_memory`` passes a float through and
    ``infer_auto_device_map`` compares it with whole byte counts, so the floor holds the same modules."""
    if not math.isfinite(size):
        raise InvalidBudget(f"{what} must be finite, got {size!r}; give bytes as an int or a string like '10GiB'.")
    if size < 0:
        raise InvalidBudget(_negative(what, size))
    value = math.floor(size)
    if value != size:
        meant = f", or a string with a unit such as '{size:g}GiB' if you meant more" if size < SMALL_BARE_BUDGET else ""
        _warn_once(f"{what} = {size!r} is not a whole number of bytes; it is read as {value} bytes, as accelerate "
                   f"compares it with whole byte counts; give the int {value}{meant}.")
    return value


def _parse_text(size: str, what: str) -> int:
    """Bytes from a size string, as accelerate's ``convert_file_size_to_int`` reads it (:func:`parse_size`)."""
    match = _SIZE_RE.match(size)
    if match is None:
        raise InvalidBudget(
            f"{what} {size!r} is not a size; use an int of bytes or a number with a unit such as '10GiB' or '500MB'."
        )
    written, unit = match.group(1), (match.group(2) or "")
    number = float(written)
    if number < 0:
        raise InvalidBudget(_negative(what, size))
    if not unit:
        if number != int(number):
            fix = f"write it with a unit, such as '{written}GiB' or '{written}MB'"
        else:
            fix = f"give the int {int(number)} for bytes, or a string with a unit such as '{written}GiB'"
        raise InvalidBudget(f"{what} {size!r} has no unit, and accelerate rejects a size string without one; {fix}.")
    upper = unit.upper()
    value = int(number * _UNITS[upper])
    if unit.endswith("b") and upper != "B" and not upper.endswith("IB"):   # "Gb", "gb": bits, as accelerate reads
        bits, value = value, value // 8
        prefix = unit[0].upper()
        _warn_once(f"{what} {size!r} is read as {written} {prefix}bit = {value} bytes ({_human(value)}), as accelerate "
                   f"reads a lower-case 'b' (bits); write '{written}{prefix}B' for {_human(bits)}.")
    elif unit not in _USUAL_UNITS:
        usual = _usual_spelling(unit)
        how = ("as accelerate reads it, whatever the case of the unit" if upper in _ACCELERATE_UNITS else
               "whatever the case of the unit (accelerate does not read this unit)")
        _warn_once(f"{what} {size!r} is read as {written} {usual} = {value} bytes ({format_bytes(value)}), {how}; "
                   f"write '{written}{usual}'.")
    return value


def _usual_spelling(unit: str) -> str:
    """``"gib"`` -> ``"GiB"``, ``"gB"`` -> ``"GB"``, ``"b"`` -> ``"B"``.

    >>> _usual_spelling("gib"), _usual_spelling("mB"), _usual_spelling("b"), _usual_spelling("KIB")
    ('GiB', 'MB', 'B', 'KiB')
    """
    upper = unit.upper()
    if upper.endswith("IB"):
        return upper[0] + "iB"
    return upper


def _human(n: int) -> str:
    """``1.25 GB``: decimal units, as the mistaken unit was.

    >>> _human(1_250_000_000), _human(187_500_000), _human(512)
    ('1.25 GB', '187.5 MB', '512 B')
    """
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_ms(seconds: float) -> str:
    """A time in milliseconds, as every plan says it: ``format_ms(0.0123456)`` is ``'12.346 ms'``.

    >>> format_ms(0.0123456)
    '12.346 ms'
    """
    return f"{seconds * 1e3:.3f} ms"


def format_bytes(n: float, *, decimals: int = 2, largest: str = "GiB") -> str:
    """A byte count as people read it: ``format_bytes(3 * 2**20)`` is ``'3.00 MiB'``.

    Parameters
    ----------
    n : float
        A number of bytes (negative keeps its sign).
    decimals : int, default 2
        Digits after the point in KiB and above; a count under 1 KiB is a whole number of bytes.
    largest : {"GiB", "TiB", "MiB", "KiB"}, default "GiB"
        The largest unit used: ``"TiB"`` writes 3 TiB as ``3.00 TiB`` instead of ``3072.00 GiB``.

    Raises
    ------
    InvalidOption
        If ``largest`` is not one of the units above.

    Examples
    --------
    >>> format_bytes(1536), format_bytes(12)
    ('1.50 KiB', '12 B')
    >>> format_bytes(3 * 2**40), format_bytes(3 * 2**40, decimals=1, largest="TiB")
    ('3072.00 GiB', '3.0 TiB')
    """
    units = [unit for unit, _ in _BINARY_UNITS]
    if largest not in units:
        raise InvalidOption(f"format_bytes(largest={largest!r}): use one of {', '.join(units)}.")
    for unit, scale in _BINARY_UNITS[units.index(largest):]:
        if abs(n) >= scale:
            return f"{n / scale:.{decimals}f} {unit}"
    return f"{int(n)} B"


def normalize_device(device) -> Device:
    """The canonical form of a device key or value: an int for an accelerator, else ``"mps"``, ``"cpu"``, ``"disk"``.

    Examples
    --------
    >>> normalize_device("cuda:1"), normalize_device("cpu"), normalize_device(0), normalize_device("xpu")
    (1, 'cpu', 0, 0)
    """
    if isinstance(device, bool):
        raise InvalidBudget(f"device {device!r} is a boolean; use an accelerator index, 'mps', 'cpu' or 'disk'.")
    if isinstance(device, int):
        if device < 0:
            raise InvalidBudget(f"device index {device} is negative; accelerator indices start at 0.")
        return device
    if is_torch_device(device):
        device = str(device)
    if isinstance(device, str):
        text = device.strip().lower()
        if text in _NAMED:
            return text
        if text.isdigit():
            return int(text)
        kind, _, index = text.partition(":")
        if kind in _ACCELERATOR_TYPES and (index == "" or index.isdigit()):
            return int(index or 0)
    raise InvalidBudget(
        f"unknown device {device!r}: use an accelerator index (0, 1, ... or 'cuda:1', 'xpu:0'), 'mps', 'cpu' or 'disk'."
    )


def is_torch_device(value) -> bool:
    """Whether ``value`` is a ``torch.device`` (told without importing torch)."""
    return type(value).__name__ == "device" and hasattr(value, "type")


def canonical(device):
    """:func:`normalize_device` of ``device``, or ``device`` itself where it names no device (a lookup then misses)."""
    try:
        return normalize_device(device)
    except InvalidBudget:
        return device


def normalize_map(device_map) -> dict:
    """A copy of ``device_map`` with devices in canonical form (:func:`normalize_device`); a typed error if it is not a
    device map.

    >>> normalize_map({"": "cuda:1", "lm_head": "CPU"})
    {'': 1, 'lm_head': 'cpu'}
    """
    if not isinstance(device_map, Mapping):
        raise InvalidDeviceMap(
            f"device_map must be a dict of module names to devices, got {type(device_map).__name__}."
        )
    try:  # a map has few distinct values: normalise each once (type too: True == 1, but True is no device)
        values = device_map.values()
        if set(map(type, values)) <= {int, str}:   # the usual map: no value equals one of another type
            distinct = {(type(value), value) for value in set(values)}
        else:
            distinct = set(zip(map(type, values), values))
        forms = {kind: normalize_device(kind[1]) for kind in distinct}
    except (TypeError, InvalidBudget):  # unhashable or bad values: the loop below names the key
        forms = None
    if forms is not None and all(issubclass(kind, str) for kind in set(map(type, device_map))):
        if all(type(c) is kind and c == value for (kind, value), c in forms.items()):
            return dict(device_map)
        return {key: forms[type(value), value] for key, value in device_map.items()}
    out = {}
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise InvalidDeviceMap(f"device_map keys are module names (str); got {key!r}.")
        try:
            out[key] = normalize_device(value)
        except InvalidBudget as err:
            raise InvalidDeviceMap(f"device_map[{key!r}]: {err}") from None
    return out


class ByDevice(dict):
    """A dict keyed by canonical devices (``0``, ``"cpu"``) that answers to the caller's spelling too: ``"cuda:0"``,
    ``"xpu:0"``, ``torch.device("cuda", 0)`` look up ``0``.

    >>> ByDevice({0: 5}).get("cuda:0"), "cuda:0" in ByDevice({0: 5})
    (5, True)
    """

    def __getitem__(self, key):
        return super().__getitem__(canonical(key))

    def __contains__(self, key) -> bool:
        return super().__contains__(canonical(key))

    def get(self, key, default=None):
        return super().get(canonical(key), default)


def is_accelerator(device: Device) -> bool:
    """True for accelerators (integer indices and ``"mps"``)."""
    return device not in ("cpu", "disk")


@dataclass(frozen=True, slots=True)
class Budgets:
    """Ordered devices and their budgets in bytes.

    ``order`` always ends with ``"disk"``; ``limits`` has no entry for ``"disk"`` unless the caller gave one
    (accelerate treats disk as unlimited).
    """

    order: tuple[Device, ...]
    limits: Mapping[Device, int]

    @property
    def accelerators(self) -> tuple[Device, ...]:
        return tuple(d for d in self.order if is_accelerator(d))

    def limit(self, device: Device) -> int | None:
        """The budget of ``device`` in bytes, or ``None`` when unlimited."""
        return self.limits.get(device)


def _machine_memory() -> dict:
    from accelerate.utils import get_max_memory

    return get_max_memory(None)


def small_bare_number(key, value) -> None:
    """Warn when a budget written without a unit (``--max-memory cpu=64``) is under 1 MiB: it is read as bytes, as
    accelerate reads a bare number, but more likely meant GiB."""
    if not isinstance(value, bool) and isinstance(value, int) and 0 < value < SMALL_BARE_BUDGET:
        guess = f"{value}{'GiB' if value < 2**10 else 'MiB'}"  # 64 -> GiB, 40000 -> MiB
        warn_caller(f"max_memory[{key!r}] = {value!r} is read as {value} bytes, as accelerate reads a bare number; "
                    f"write a string with a unit, e.g. '{guess}', if you meant more.")


def warn_misread(max_memory: Mapping | None) -> None:
    """The warnings :func:`parse_budgets` gives about likely mistakes (a lower-case ``b`` read as bits, a unit in an
    unusual case, a fractional float, a bare number under 1 MiB read as bytes), for a ``max_memory`` that another
    library then normalises (transformers' ``get_max_memory`` converts the strings without a word); what it rejects
    is left to it.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_misread({0: "8Gb", "cpu": "bad"})
    >>> [str(w.message)[:50] for w in caught]
    ["max_memory[0] '8Gb' is read as 8 Gbit = 1000000000"]
    """
    for key, value in (max_memory or {}).items():
        small_bare_number(key, value)
        if isinstance(value, (str, float)):
            try:
                parse_size(value, what=f"max_memory[{key!r}]")
            except InvalidBudget:
                pass   # rejected by the library that reads it, with its own message


def parse_budgets(max_memory: Mapping | None) -> Budgets:
    """Budgets from ``max_memory`` as accelerate accepts it; ``None`` means what this machine has.

    Parameters
    ----------
    max_memory : mapping or None
        Device key (``0``, ``"cuda:1"``, ``"mps"``, ``"xpu:0"``, ``"cpu"``, ``"disk"``) to bytes or a size string.
        Never modified.

    Raises
    ------
    InvalidBudget
        Wrong type, unknown device, malformed size, or the same device named twice (``0`` and ``"cuda:0"``).

    Warns
    -----
    UserWarning
        A size with a lower-case ``b`` (bits), a unit in an unusual case (``'3gib'``) or a fractional float, once
        per process for each (see :func:`parse_size`). An int is bytes, as in accelerate, without a
        warning (accelerate's own tests plan with budgets of a few hundred bytes); the command line warns about a
        small bare number (:func:`small_bare_number`), where ``cpu=64`` is more likely GiB without its unit.

    Examples
    --------
    >>> b = parse_budgets({"cpu": "1GiB", "cuda:1": "2GB", 0: "100MB"})
    >>> b.order, b.limit(1), b.limit("disk")
    ((0, 1, 'cpu', 'disk'), 2000000000, None)
    """
    if max_memory is None:
        max_memory = _machine_memory()
    if not isinstance(max_memory, Mapping):
        raise InvalidBudget(
            f"max_memory must be a dict such as {{0: '10GiB', 'cpu': '30GiB'}}, got {type(max_memory).__name__}."
        )
    limits: dict[Device, int] = {}
    for key, value in max_memory.items():
        device = normalize_device(key)
        if device in limits:
            raise InvalidBudget(f"device {device!r} appears twice in max_memory (as {key!r}); give it once.")
        limits[device] = parse_size(value, what=f"max_memory[{key!r}]")
    gpus = sorted(d for d in limits if isinstance(d, int))
    order = tuple(gpus) + tuple(d for d in _NAMED if d in limits)
    if "disk" not in order:
        order = order + ("disk",)
    return Budgets(order=order, limits={d: limits[d] for d in order if d in limits})
