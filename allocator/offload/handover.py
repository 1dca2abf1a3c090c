"""How the runtime looks to code written for accelerate's hooks, and how it ends when such code takes them off.

Libraries read accelerate's ``AlignDevicesHook`` on a loaded model. PEFT 0.21 (``PeftModel.from_pretrained``,
``peft/peft_model.py``) rebuilds the disk-offload index of a dispatched base model from each hook's
``original_devices`` (a tensor on ``meta`` is on disk) and ``weights_map.dataset.index`` (where in which file), then
calls accelerate's ``remove_hook_from_submodules`` and dispatches the wrapped model again; transformers 5's
``save_pretrained`` reads disk-offloaded tensors through ``weights_map`` (``load_offloaded_parameter``). The runtime's
hooks (:class:`allocator.offload.OffloadHook`, its hybrid wrapper, :class:`allocator.offload.ExpertsHook`) therefore
carry the fields of the accelerate hook they replace (:data:`CARRIED`), the same objects, and the runtime ends when its
last hook is taken off that way (:func:`end`): its prefetch thread stops, ``model._allocator_runtime`` goes, and a
later ``dispatch_model`` under ``patch(runtime="allocator")`` attaches a new runtime.

What is not carried: ``isinstance(hook, AlignDevicesHook)`` is false for the runtime's hooks, so PEFT's
``onload_layer`` (``merge_and_unload`` on offloaded layers) skips them, and ``ModulesToSaveWrapper`` (``get_peft_model``
with ``modules_to_save`` on an offloaded module) copies the module with its hook and rebuilds the hook from
``accelerate.hooks`` by class name; neither is tested: :func:`allocator.offload.detach` first where those are used.
"""

from __future__ import annotations

import logging

__all__ = ["CARRIED", "carry", "end", "hooked", "removed", "set_experts_implementation"]

log = logging.getLogger("allocator.offload")

CARRIED = ("offload", "weights_map", "offload_buffers", "place_submodules", "tied_params_map", "original_devices")
"""The fields of accelerate's ``AlignDevicesHook`` (1.16 ``hooks.py``) that a runtime hook carries from the hook it
replaces, besides ``execution_device``, ``io_same_device``, ``skip_keys`` and ``input_device``, which it sets itself."""


def carry(hook, original) -> None:
    """Give ``hook`` the :data:`CARRIED` fields of accelerate's ``original`` (the same objects, not copies)."""
    for name in CARRIED:
        if hasattr(original, name):
            setattr(hook, name, getattr(original, name))


def _on(module, hook) -> bool:
    top = module.__dict__.get("_hf_hook")
    return top is hook or any(h is hook for h in getattr(top, "hooks", ()))


def hooked(installed, leaving=None) -> bool:
    """Whether any ``(module, hook)`` of ``installed`` is still on its module, not counting ``leaving`` (the module
    whose hook accelerate's ``remove_hook_from_module`` is taking off now)."""
    return any(module is not leaving and _on(module, hook) for module, hook in installed)


def end(runtime, *, put_back=None) -> None:
    """End ``runtime`` (an :class:`allocator.offload.Attached`): stop its prefetch thread, give the model its experts
    implementation back, forget the experts modules and take ``_allocator_runtime`` off the model. ``put_back``
    (``detach``: :func:`allocator.offload.passthrough.put_back`) restores the hooks the runtime took off; without it
    they stay off, as the caller is taking the model's hooks off."""
    runtime.close()
    if put_back is not None:
        put_back(runtime.passthrough)
    for _, module in runtime.model.named_modules():
        module.__dict__.pop("_allocator_experts", None)
    if getattr(runtime, "experts_implementation", None) is not None:
        set_experts_implementation(runtime.model, runtime.experts_implementation)
    runtime.model.__dict__.pop("_allocator_runtime", None)


def set_experts_implementation(model, name: str):
    """Select transformers' experts implementation ``name`` on ``model`` (``set_experts_implementation``), returning
    the one it had; ``None`` where the model has no such setting."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_experts_implementation"):
        return None
    before = getattr(config, "_experts_implementation", None)
    model.set_experts_implementation(name)
    return before


def removed(runtime, module) -> None:
    """accelerate's ``remove_hook_from_module`` is taking ``module``'s runtime hook off: the runtime ends with its
    last hook."""
    if runtime.model.__dict__.get("_allocator_runtime") is runtime and not hooked(runtime.installed, module):
        log.info("the model's offload hooks were taken off (accelerate's remove_hook_from_module): the allocator "
                 "runtime on %s ends", type(runtime.model).__name__)
        end(runtime)
