"""Catalogue of real ``transformers`` architectures built on the meta device.

The zoo is used by benchmarks and differential tests of the placement planner.
Every entry is one row of data: a real model class, its config class, and the
published sizes of a well-known checkpoint written out explicitly as config
keyword arguments (no download from the Hub ever happens).  One function
builds any row under ``torch.device("meta")``.  The resulting models carry no
storage, so even the 46.7 B parameter Mixtral builds in a fraction of a
second, yet their module trees, parameter shapes, tied weights and
``_no_split_modules`` are exactly those of the real checkpoints, which is what
the planner's behaviour depends on (the share of embeddings versus decoder
layers, tied heads, expert blocks, vision towers and so on).

Parameters are left in the config's default dtype (float32); no dtype is
passed anywhere, so :func:`build` and every size derived from it are float32.
Each entry also records, as data, the dtype its published checkpoint is
stored in (:attr:`ZooEntry.dtype`, :func:`dtype`): what transformers 5's
``from_pretrained`` loads it in by default (``dtype="auto"``: the config's
``dtype``/``torch_dtype``, else the weights'). ``allocator plan NAME`` plans
in it unless ``--dtype`` says otherwise.

Importing this module is cheap: ``torch`` and ``transformers`` are only
imported when a model is built.

Families
--------
``dense-llm``, ``moe-llm``, ``encoder-decoder``, ``encoder``, ``vision``,
``vlm``, ``speech`` and ``ssm``.  Multimodal *encoders* are filed by what
they mostly are: ``clip-vit-base`` (CLIPModel) under ``encoder`` and
``sam-vit-base`` (SamModel) under ``vision``; ``whisper-*`` are
encoder-decoders filed under ``speech``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .zoo_specs import CONFIG_KEY, FAMILIES, SPECS, ZooSpec

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = ["FAMILIES", "ZOO", "ZooEntry", "build", "dtype", "names", "move_strays_to_meta", "quiet_transformers"]


@dataclass(frozen=True, slots=True)
class ZooEntry:
    """One catalogue entry.

    Attributes
    ----------
    name : str
        Short key, e.g. ``"llama-8b"``.
    family : str
        One of :data:`FAMILIES`.
    build : Callable[[], torch.nn.Module]
        Builds the model on the meta device and returns it in eval mode.
    description : str
        Which checkpoint the sizes come from, and which class is built.
    dtype : str
        The dtype the published checkpoint is stored in (its config's
        ``torch_dtype``, else its weights'), which ``from_pretrained`` loads
        by default. :attr:`build` ignores it: the model it returns is float32.
    """

    name: str
    family: str
    build: Callable[[], "torch.nn.Module"]
    description: str
    dtype: str = "float32"


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers logging and Python warnings, restoring both after."""
    import warnings

    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(previous)


def move_strays_to_meta(model: "torch.nn.Module") -> None:
    """Put parameters and buffers that ignored the default device on meta.

    A few models create tensors with the legacy ``torch.Tensor(n)``
    constructor, which does not honour ``torch.device("meta")`` (e.g.
    ``Wav2Vec2Model.masked_spec_embed``).  They are replaced by meta tensors
    of the same shape, dtype and ``requires_grad``; a parameter shared by
    several modules is replaced by one shared meta parameter, so ties stay
    ties.
    """
    import torch

    replaced: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or param.device.type == "meta":
                continue
            new = replaced.get(id(param))
            if new is None:
                new = torch.nn.Parameter(
                    torch.empty_like(param, device="meta"),
                    requires_grad=param.requires_grad,
                )
                replaced[id(param)] = new
            module._parameters[key] = new
        for key, buf in list(module._buffers.items()):
            if buf is None or buf.device.type == "meta":
                continue
            new = replaced.get(id(buf))
            if new is None:
                new = torch.empty_like(buf, device="meta")
                replaced[id(buf)] = new
            module._buffers[key] = new


@contextlib.contextmanager
def _no_scipy_check(module_name: str) -> Iterator[None]:
    """Let ``module_name`` build its (training-only) loss without scipy.

    Mask2Former's loss calls ``requires_backends(self, ["scipy"])`` in its
    constructor although scipy is only used by the Hungarian matcher during a
    training forward.  When scipy is missing, the module's
    ``requires_backends`` is swapped, for the duration of the build only, for
    one that ignores the scipy requirement.  Inference and placement are
    unaffected; a training forward with labels would fail without scipy.
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("scipy") is not None:
        yield
        return
    module = importlib.import_module(module_name)
    original = getattr(module, "requires_backends", None)
    if original is None:  # pragma: no cover - transformers changed
        yield
        return

    def requires_backends(obj: Any, backends: Any) -> None:
        backends = [backends] if isinstance(backends, str) else list(backends)
        rest = [b for b in backends if b != "scipy"]
        if rest:
            original(obj, rest)

    module.requires_backends = requires_backends
    try:
        yield
    finally:
        module.requires_backends = original


def _resolve(value: Any, transformers: Any) -> Any:
    """``value`` with every :func:`~allocator.model.zoo_specs.nested` dict built into its config; dicts and lists
    are fresh copies."""
    if isinstance(value, dict):
        kwargs = {key: _resolve(item, transformers) for key, item in value.items() if key != CONFIG_KEY}
        return getattr(transformers, value[CONFIG_KEY])(**kwargs) if CONFIG_KEY in value else kwargs
    if isinstance(value, list):
        return [_resolve(item, transformers) for item in value]
    return value


def _build(spec: ZooSpec) -> "torch.nn.Module":
    """Build ``transformers.<spec.model>(<spec.config>(**spec.kwargs))`` on meta, in eval mode."""
    import torch
    import transformers

    with quiet_transformers():
        config = getattr(transformers, spec.config)(**_resolve(spec.kwargs, transformers))
        cls = getattr(transformers, spec.model)
        patch = _no_scipy_check(spec.no_scipy_check) if spec.no_scipy_check else contextlib.nullcontext()
        with torch.device("meta"), patch:
            model = cls(config)
    move_strays_to_meta(model)
    model.eval()
    return model


def _entry(spec: ZooSpec) -> ZooEntry:
    """The public entry of one row."""
    if spec.family not in FAMILIES:  # pragma: no cover - guards the table
        raise ValueError(f"unknown family {spec.family!r}")

    def _build_entry() -> "torch.nn.Module":
        return _build(spec)

    _build_entry.__name__ = _build_entry.__qualname__ = f"build_{spec.name}"
    _build_entry.__doc__ = f"Build {spec.name} ({spec.model}) on the meta device."
    return ZooEntry(name=spec.name, family=spec.family, build=_build_entry,
                    description=f"{spec.description} [{spec.model}]", dtype=spec.dtype)


# --------------------------------------------------------------------------- #
# public API
# --------------------------------------------------------------------------- #

_ENTRIES = [_entry(spec) for spec in SPECS]

#: All entries, keyed by name, in catalogue order (grouped by family).
ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for family in FAMILIES
    for entry in _ENTRIES
    if entry.family == family
}


def names(*, family: str | None = None) -> list[str]:
    """List the zoo's entry names in catalogue order.

    Parameters
    ----------
    family : str, optional
        Keep only entries of this family (one of :data:`FAMILIES`).  ``None``
        (the default) lists every entry.

    Returns
    -------
    list of str
        The names, in catalogue order.

    Raises
    ------
    ValueError
        If ``family`` is not one of :data:`FAMILIES`.

    Examples
    --------
    >>> "llama-8b" in names()
    True
    >>> names(family="ssm")[:1]
    ['mamba-130m']
    """
    if family is None:
        return list(ZOO)
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid families: {', '.join(FAMILIES)}")
    return [name for name, entry in ZOO.items() if entry.family == family]


def build(name: str) -> "torch.nn.Module":
    """Build a zoo model on the meta device.

    Parameters
    ----------
    name : str
        An entry name, see :func:`names`.

    Returns
    -------
    torch.nn.Module
        A fresh model whose parameters and buffers live on the meta device,
        in eval mode.

    Raises
    ------
    KeyError
        If ``name`` is not in the zoo; the message lists the valid names.

    Examples
    --------
    >>> model = build("gpt2")
    >>> {p.device.type for p in model.parameters()}
    {'meta'}
    >>> model.training
    False
    """
    try:
        entry = ZOO[name]
    except KeyError:
        raise KeyError(
            f"unknown zoo model {name!r}; valid names: {', '.join(ZOO)}"
        ) from None
    return entry.build()


def dtype(name: str) -> str:
    """The dtype ``name``'s published checkpoint is stored in, which ``from_pretrained`` loads by default.

    :func:`build` does not apply it (its models are float32); pass it as ``dtype=`` to plan the model as it would
    be loaded.

    Raises
    ------
    KeyError
        If ``name`` is not in the zoo.

    Examples
    --------
    >>> dtype("llama-8b"), dtype("opt-1.3b"), dtype("t5-base")
    ('bfloat16', 'float16', 'float32')
    """
    try:
        return ZOO[name].dtype
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; valid names: {', '.join(ZOO)}") from None
