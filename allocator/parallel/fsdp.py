"""FSDP over the discovered blocks: the block classes of a model, FSDP1's wrap policy over them, and FSDP2's
``fully_shard`` on every block then the root.

:func:`block_classes`
    The block classes of a model, as classes found in it (declared no-split classes, else inferred blocks).
:func:`fsdp_wrap_policy`
    FSDP1's ``ModuleWrapPolicy`` over those classes.
:func:`apply_fully_shard`
    FSDP2: ``fully_shard`` on every block, then on the root.

A *block* is a module of a block class (see :mod:`allocator.model.blocks`).
"""

from __future__ import annotations

import logging

import torch.nn as nn

from ..errors import InvalidModel
from ..model.blocks import require_module
from ..model.families import family_of
from ..model.no_split import Walked

__all__ = ["apply_fully_shard", "block_classes", "fsdp_wrap_policy"]

logger = logging.getLogger(__name__)


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of the model's blocks, resolved to the class objects found in the model.

    Parameters
    ----------
    model : torch.nn.Module
        Only read; meta-device models work. Pass it unwrapped (:func:`allocator.model.unwrap.unwrap`).

    Returns
    -------
    tuple of type
        Every class whose name the model declares unsplittable, or, when it declares none, every inferred block
        class, as the model's family says (:func:`allocator.model.families.family_of`; by default
        :func:`allocator.model.blocks.no_split_classes` and :func:`allocator.model.blocks.infer_blocks`), that has an
        instance in the model; in order of first instance (``model.modules()`` order).

    Raises
    ------
    InvalidModel
        ``model`` is not an ``nn.Module``, or none of these classes has an instance in it.

    Notes
    -----
    A declared name with no instance is dropped (llava declares ``CLIPTextEmbeddings`` for a vision tower that
    has none); it is logged at DEBUG. Classes are matched by ``__name__``, so two classes of one name from two
    modules both come back. Complexity: O(modules + parameters).

    Examples
    --------
    >>> import torch.nn as nn
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)
    >>> model = nn.Sequential(nn.Embedding(10, 8), Block(), Block(), nn.Linear(8, 10))
    >>> block_classes(model) == (Block,)
    True
    """
    require_module(model, "block_classes")
    family = family_of(model)   # its no-split rule, else its repeated blocks
    names = set(family.no_split(model, Walked())) or set(family.infer_no_split(model))
    found = dict.fromkeys(type(m) for m in model.modules() if type(m).__name__ in names)
    if not found:
        raise InvalidModel(
            f"{type(model).__name__} declares no no-split class found in it and has no repeated blocks; "
            "wrap or split it by hand, or give its block class a `_no_split_modules` declaration."
        )
    absent = names - {cls.__name__ for cls in found}
    if absent:
        logger.debug("block_classes: %s declares %s but has no instance of them", type(model).__name__, sorted(absent))
    return tuple(found)


def fsdp_wrap_policy(model: nn.Module):
    """FSDP1's ``auto_wrap_policy`` wrapping each block of ``model`` (and the root) in its own FSDP unit.

    Parameters
    ----------
    model : torch.nn.Module
        Only read; typically on the meta device or CPU, before ``FullyShardedDataParallel(model, ...)``.

    Returns
    -------
    torch.distributed.fsdp.wrap.ModuleWrapPolicy
        Over :func:`block_classes` ``(model)``.

    Raises
    ------
    InvalidModel
        As :func:`block_classes`.

    Examples
    --------
    >>> import torch.nn as nn
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)
    >>> model = nn.Sequential(nn.Embedding(10, 8), Block(), Block(), nn.Linear(8, 10))
    >>> policy = fsdp_wrap_policy(model)
    >>> [name for name, m in model.named_modules() if policy(m, recurse=False, nonwrapped_numel=0)]
    ['1', '2']

    In a process group: ``FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=...)``.
    """
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy(block_classes(model))


def _fully_shard():
    """``fully_shard`` where this torch has it: public since torch 2.6, ``_composable.fsdp`` from 2.4."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError as error:
            import torch

            raise ImportError(
                f"FSDP2's fully_shard is not in torch {torch.__version__}; it needs torch >= 2.4 "
                "(torch.distributed.fsdp.fully_shard from 2.6). Use fsdp_wrap_policy with FSDP1 instead."
            ) from error
    return fully_shard


def apply_fully_shard(model: nn.Module, **fully_shard_kwargs) -> nn.Module:
    """FSDP2: ``fully_shard`` every block of ``model``, innermost first, then the root; in place.

    Parameters
    ----------
    model : torch.nn.Module
        Changed in place, as ``fully_shard`` does (each sharded module's class becomes ``FSDP<class>``, its
        parameters ``DTensor`` shards). Needs an initialised default process group, or pass ``mesh``.
    **fully_shard_kwargs
        Passed to every ``fully_shard`` call: ``mesh``, ``reshard_after_forward``, ``mp_policy``,
        ``offload_policy``, ...

    Returns
    -------
    torch.nn.Module
        ``model`` itself, now an ``FSDPModule``.

    Raises
    ------
    InvalidModel
        As :func:`block_classes`.

    Notes
    -----
    The blocks are the instances of :func:`block_classes` (``isinstance``, as ``ModuleWrapPolicy`` matches),
    so this shards the same units as FSDP1 with :func:`fsdp_wrap_policy`. They are sharded in reversed
    definition order, which puts nested blocks before the blocks holding them, as FSDP2 requires; the root
    last. ``fully_shard`` is ``torch.distributed.fsdp.fully_shard`` (torch >= 2.6) or
    ``torch.distributed._composable.fsdp.fully_shard`` (torch 2.4, 2.5).

    Examples
    --------
    The blocks it shards before the root (the call itself needs a process group, so it is not run here):

    >>> import torch.nn as nn
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)
    >>> model = nn.Sequential(nn.Embedding(10, 8), Block(), Block(), nn.Linear(8, 10))
    >>> [name for name, m in model.named_modules() if isinstance(m, block_classes(model))]
    ['1', '2']
    >>> apply_fully_shard(model, reshard_after_forward=True)  # doctest: +SKIP
    """
    fully_shard = _fully_shard()
    modules = dict(model.named_modules())
    for name in _shard_order(model):
        fully_shard(modules[name], **fully_shard_kwargs)
    return model


def _shard_order(model: nn.Module) -> list[str]:
    """Names of the modules :func:`apply_fully_shard` shards, in order: blocks, innermost last-defined first,
    then the root (``""``)."""
    classes = block_classes(model)
    blocks = [name for name, m in model.named_modules() if name and isinstance(m, classes)]
    return blocks[::-1] + [""]  # reversed preorder puts every module before the modules holding it
