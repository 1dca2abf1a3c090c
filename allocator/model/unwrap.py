"""The model under its wrappers: :func:`unwrap` peels DDP, ``torch.compile``, FSDP, PEFT, activation
checkpointing and accelerate hooks at every depth, without copying a weight or touching the input.

Glossary
--------
wrapper
    A module whose only job is to hold another one: ``DistributedDataParallel.module``,
    ``OptimizedModule._orig_mod``, ``FullyShardedDataParallel._fsdp_wrapped_module``, ...
residue
    What accelerate's hooks or an in-place ``module.compile()`` leave on the module itself (``_hf_hook``,
    ``_old_forward``, a patched ``forward``, ``_compiled_call_impl``).

Nothing is imported from torch.distributed, peft or accelerate: wrappers are recognised by name.
"""

from __future__ import annotations

import copy
import logging
import types
from collections import OrderedDict
from typing import TYPE_CHECKING

from ..errors import InvalidModel
from .blocks import require_module

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["unwrap"]

logger = logging.getLogger(__name__)

#: Registered child that a wrapper holds its module under, keyed by a class name in the wrapper's MRO.
_WRAPPER_CLASSES = {
    "DataParallel": "module",  # torch.nn.DataParallel
    "DistributedDataParallel": "module",  # torch DDP (and apex's, same attribute)
    "PeftModel": "base_model",  # peft: PeftModel -> LoraModel (a BaseTuner) -> the model
    "BaseTuner": "model",
}
#: Registered children whose name alone marks their parent a wrapper.
_WRAPPED_ATTRIBUTES = (
    "_orig_mod",  # torch.compile's OptimizedModule
    "_fsdp_wrapped_module",  # FSDP1 FullyShardedDataParallel
    "_fpw_module",  # FlattenParamsWrapper (torch < 1.13 FSDP, fairscale)
    "_orig_module",  # torch_xla's SPMD FSDP
    "_checkpoint_wrapped_module",  # torch's CheckpointWrapper / OffloadWrapper
)
#: Instance attributes left by accelerate: add_hook_to_module, and dispatch_model's warning wrappers.
_ACCELERATE_HOOK = ("_hf_hook", "_old_forward")
_ACCELERATE_METHODS = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa", "neuron")


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The module ``module`` wraps, or ``None`` when it is not a wrapper."""
    import torch.nn as nn

    for cls in type(module).__mro__:
        attribute = _WRAPPER_CLASSES.get(cls.__name__)
        if attribute is not None and isinstance(module._modules.get(attribute), nn.Module):
            return module._modules[attribute]
    for attribute in _WRAPPED_ATTRIBUTES:
        if isinstance(module._modules.get(attribute), nn.Module):
            return module._modules[attribute]
    return None


def _peel(module: nn.Module) -> nn.Module:
    """Strip the wrappers stacked at one position (``compile(DDP(m))`` gives ``m``)."""
    seen = {id(module)}
    while (inner := _wrapped(module)) is not None:
        if id(inner) in seen:
            raise InvalidModel(f"wrapper {type(module).__name__} wraps itself; remove the back-reference.")
        _warn_dropped(module, inner)
        logger.debug("unwrap: dropped %s around %s", type(module).__name__, type(inner).__name__)
        seen.add(id(inner))
        module = inner
    if "_flat_param" in module._parameters:
        logger.warning(
            "unwrap: %s holds FSDP's flattened '_flat_param' instead of its own parameters; wrap with "
            "FullyShardedDataParallel(..., use_orig_params=True) to keep the original parameter names.",
            type(module).__name__,
        )
    return module


def _warn_dropped(wrapper: nn.Module, inner: nn.Module) -> None:
    """Log the parameters a wrapper owns outside its module (PEFT prompt encoders): unwrap leaves them."""
    kept = {id(p) for p in inner.parameters()}
    dropped = [name for name, p in wrapper.named_parameters() if id(p) not in kept]
    if dropped:
        logger.warning(
            "unwrap: %s owns %d parameter(s) outside the module it wraps (%s); they are not part of the result.",
            type(wrapper).__name__, len(dropped), ", ".join(dropped[:3]) + (", ..." if len(dropped) > 3 else ""),
        )


def _has_residue(module: nn.Module) -> bool:
    """Whether accelerate hooks or an in-place ``module.compile()`` sit on the module itself."""
    state = vars(module)
    return (
        any(key in state for key in _ACCELERATE_HOOK)
        or any(hasattr(state.get(key), "__wrapped__") for key in _ACCELERATE_METHODS)
        or state.get("_compiled_call_impl") is not None
    )


def _strip_residue(clone: nn.Module, original: nn.Module) -> None:
    """Remove hooks and compilation from ``clone`` (a fresh shallow copy) and rebind its methods to it."""
    state = vars(clone)
    if any(key in state for key in _ACCELERATE_HOOK):
        state.pop("_hf_hook", None)
        state.pop("forward", None)  # accelerate's partial(new_forward, original)
        old_forward = state.pop("_old_forward", None)
        if old_forward is not None:
            state["forward"] = old_forward
    for key in _ACCELERATE_METHODS:
        if hasattr(state.get(key), "__wrapped__"):
            del state[key]
    if state.get("_compiled_call_impl") is not None:
        state["_compiled_call_impl"] = None
    for key, value in list(state.items()):
        if isinstance(value, types.MethodType) and value.__self__ is original:
            if getattr(type(clone), key, None) is value.__func__:
                del state[key]  # the class's own method: nothing to keep on the instance
            else:
                state[key] = types.MethodType(value.__func__, clone)


def _shallow_copy(module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
    """A copy of ``module`` with new ``children``, sharing parameters and buffers (not their registries)."""
    clone = copy.copy(module)
    state = vars(clone)
    for key, value in state.items():
        if type(value) in (dict, OrderedDict, set):
            state[key] = value.copy()  # _parameters, _buffers, hook dicts: the input's must never change
    state["_modules"] = children
    _strip_residue(clone, module)
    return clone


def _unwrap_tree(module: nn.Module, memo: dict[int, nn.Module], on_path: set[int]) -> nn.Module:
    """``module`` (not itself a wrapper) with every wrapper below removed; copies only what changes."""
    key = id(module)
    if key in memo:
        return memo[key]
    if key in on_path:
        raise InvalidModel(
            f"module {type(module).__name__} contains itself: a cycle in the module graph cannot be unwrapped; "
            "remove the back-reference."
        )
    on_path.add(key)
    children = {
        name: None if child is None else _unwrap_tree(_peel(child), memo, on_path)
        for name, child in module._modules.items()
    }
    on_path.discard(key)
    changed = _has_residue(module) or any(children[name] is not child for name, child in module._modules.items())
    memo[key] = _shallow_copy(module, children) if changed else module
    return memo[key]


def unwrap(model: nn.Module) -> nn.Module:
    """The model under its wrappers, at every depth, without copying a weight or touching the input.

    Removed: ``DistributedDataParallel`` / ``DataParallel`` (``.module``), ``torch.compile``'s
    ``OptimizedModule`` (``_orig_mod``) and in-place ``module.compile()``, FSDP1
    (``_fsdp_wrapped_module``; ``_fpw_module`` of older flatten wrappers), torch_xla SPMD FSDP
    (``_orig_module``), PEFT (``PeftModel.base_model.model``), ``CheckpointWrapper``
    (``_checkpoint_wrapped_module``) and accelerate's hooks (``_hf_hook``, ``_old_forward``, the patched
    ``forward`` and ``dispatch_model``'s ``to``/``cuda`` guards).

    Parameters
    ----------
    model : torch.nn.Module
        A model, wrapped or not, anywhere in its tree. It is never modified.

    Returns
    -------
    torch.nn.Module
        A tree whose ``state_dict()`` keys are those of the unwrapped model (no ``module.``, ``_orig_mod.``,
        ``_fsdp_wrapped_module.`` segments). Modules with no wrapper or hook below them are the input's own
        objects; those above one are shallow copies with a new ``_modules`` dict (and their own copies of the
        parameter, buffer and hook registries), so every parameter and buffer is the input's tensor. A module
        shared by several parents stays shared. Nothing is copied when nothing needs removing: ``unwrap(m) is
        m`` for a plain model, ``unwrap(DDP(m)) is m`` when ``m`` holds no wrapper.

    Raises
    ------
    InvalidModel
        ``model`` is not an ``nn.Module``, or its module graph has a cycle.

    Notes
    -----
    Wrappers are recognised by a class name in their MRO (``DataParallel``, ``DistributedDataParallel``,
    ``PeftModel``, ``BaseTuner``) or by the name of the registered child that holds the module (the
    ``_orig_mod``-like names above); nothing is imported from torch.distributed, peft or accelerate.
    Parameters a wrapper owns outside its module (PEFT prompt encoders) are not in the result; a warning is
    logged. PEFT's adapter layers inside the model (``lora.Linear`` with ``base_layer``) are part of the model
    and stay. FSDP with ``use_orig_params=False`` leaves the flattened ``_flat_param`` (a warning is logged);
    accelerate's offloaded weights stay where its hook put them (often ``meta``).

    Complexity: O(modules) plus one pass over a wrapper's parameters per wrapper.

    Examples
    --------
    >>> import torch, torch.nn as nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.DataParallel(nn.Linear(2, 2)))
    >>> list(net.state_dict())
    ['0.weight', '0.bias', '1.module.weight', '1.module.bias']
    >>> plain = unwrap(net)
    >>> list(plain.state_dict())
    ['0.weight', '0.bias', '1.weight', '1.bias']
    >>> plain[1] is net[1].module, plain[0] is net[0], type(net[1]).__name__
    (True, True, 'DataParallel')
    """
    require_module(model, "unwrap")
    return _unwrap_tree(_peel(model), {}, set())
