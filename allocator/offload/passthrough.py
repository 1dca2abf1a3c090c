"""The hooks that do nothing on a CPU main device, taken off while the runtime runs and put back exactly by
:func:`allocator.offload.detach`.

With the CPU as the main device, ``dispatch_model`` (what ``from_pretrained(device_map=...)`` calls) gives every module
that is not offloaded an ``AlignDevicesHook`` with ``execution_device="cpu"`` and ``offload=False``
(``accelerate.big_modeling.dispatch_model`` → ``attach_align_device_hook_on_blocks``). Its only work is
``send_to_device`` of the module's arguments to the CPU, where every tensor of such a model already is: the same
tensors come back, after a recursive walk over the arguments of each of the model's modules at each forward. The
runtime takes those hooks off for as long as it runs the model; the top module's hook, which returns outputs to the
inputs' device (``io_same_device``), stays.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Passthrough", "take_passthrough_hooks", "put_back"]


@dataclass(frozen=True)
class Passthrough:
    """One hook taken off: its module and what accelerate's ``add_hook_to_module`` had set on it."""

    module: object
    hook: object
    forward: object        # accelerate's wrapper, the module's ``forward`` while hooked
    old_forward: object    # the module's own ``forward``


def _does_nothing_on_cpu(hook) -> bool:
    """An ``AlignDevicesHook`` (exactly that class, not a subclass that may do more) that offloads nothing, keeps no
    outputs on another device and executes on the CPU."""
    from accelerate.hooks import AlignDevicesHook

    return (type(hook) is AlignDevicesHook and not hook.offload and not hook.io_same_device
            and hook.execution_device is not None and str(hook.execution_device) == "cpu")


def take_passthrough_hooks(model) -> tuple[Passthrough, ...]:
    """Take the hooks that do nothing on a CPU main device off ``model``'s modules (:func:`put_back` restores them):
    the module's own ``forward`` runs again, without accelerate's wrapper. Call only where every module of the
    model executes on the CPU."""
    taken = []
    for _, module in model.named_modules():
        hook = module.__dict__.get("_hf_hook")
        if hook is None or not _does_nothing_on_cpu(hook) or "forward" not in module.__dict__:
            continue
        taken.append(Passthrough(module, hook, module.__dict__["forward"], module.__dict__["_old_forward"]))
        module.forward = module._old_forward
        del module._hf_hook, module._old_forward
    return tuple(taken)


def put_back(taken) -> None:
    """Restore what :func:`take_passthrough_hooks` took off, exactly as it was."""
    for t in taken:
        t.module._hf_hook = t.hook
        t.module._old_forward = t.old_forward
        t.module.forward = t.forward
