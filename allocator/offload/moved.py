"""Model offload carried out by the runtime: a component that lives in RAM is moved whole onto the device it computes
on when it runs, and sent back when another moved component needs that device.

This is what diffusers' ``enable_model_cpu_offload`` does with accelerate's ``cpu_offload_with_hook`` (a hook per
component; the previous component is offloaded when the next one runs), for the components a pipeline plan marks
``"moved"`` (:attr:`allocator.PipelinePlan.execution`, onto ``runs_on[name]``), on any device of the plan, which
diffusers' pipeline loading cannot say (it gives a component one device, ``{"": device}``; ``enable_model_cpu_offload``
moves every component, onto one device, and refuses a pipeline loaded with a device map). Two differences:

- at most one moved component is on a device at a time (:class:`ModelMoves` knows which): a component moved onto
  a device sends the one there back first, so a device holds what the plan counted, the weights kept there and the
  largest component moved onto it;
- the component's tensors in RAM are kept while it runs on the device: sending it back drops the device copies,
  nothing is copied device to host (inference does not change weights).

On :class:`allocator.offload.StandInDevice` the copies are tagged tensors (``on_stand_in``), so tests see which
weights a component computed with; :attr:`ModelMoves.moved` counts the bytes copied host to device on either.

A component the plan computes where it lives, in RAM (``execution[name] == "cpu"``), gets :func:`compute_on_cpu`
instead: its inputs brought to the CPU, its outputs sent back where they came from. diffusers loads a component dealt
``{"": "cpu"}`` with accelerate's hooks that copy it whole onto GPU 0 at every call, which is not where the plan
computes it.
"""

from __future__ import annotations

import logging
from collections import Counter

from ..errors import InvalidRuntime
from .devices import StandInDevice, on_stand_in

__all__ = ["CpuHook", "ModelMoves", "MoveHook", "compute_on_cpu", "moves_of"]

log = logging.getLogger("allocator.offload.moved")


class ModelMoves:
    """The moved components of one pipeline, and which one is on each device now.

    Parameters
    ----------
    device : StandInDevice, optional
        The stand-in accelerator every move goes to (its memory is RAM); ``None``: the devices the plan names
        (``0``, ``"cuda:1"``), copied to with ``Tensor.to``.

    Attributes
    ----------
    hooks : dict
        Component name -> its :class:`MoveHook`.
    on : dict
        Device -> the name of the component on it now.
    moved : int
        Bytes copied host to device by every move so far.
    moves : Counter
        Component name -> times it was moved onto its device.
    """

    def __init__(self, device: StandInDevice | None = None):
        self.device = device
        self.hooks: dict[str, MoveHook] = {}
        self.on: dict = {}
        self.moved = 0
        self.moves: Counter = Counter()

    def add(self, name: str, module, runs_on) -> MoveHook:
        """Put a :class:`MoveHook` on ``module`` (component ``name``, in RAM), moving it onto ``runs_on`` when it
        runs; returns the hook.

        Raises
        ------
        InvalidRuntime
            ``module`` has hooks already (accelerate's or ours), tensors off the CPU, or parameters of another type
            than ``torch.nn.Parameter`` (quantized): load it whole on the CPU (``device_map={"": "cpu"}``).
        """
        from accelerate.hooks import add_hook_to_module

        if getattr(module, "_hf_hook", None) is not None:
            raise InvalidRuntime(f"component {name!r} has hooks already ({type(module._hf_hook).__name__}); a moved "
                                 "component is loaded whole on the CPU (device_map={'': 'cpu'}).")
        hook = MoveHook(self, name, runs_on)
        hook.tensors = _tensors(module, name)
        add_hook_to_module(module, hook)
        self.hooks[name] = hook
        module._allocator_moves = self
        log.info("%s lives in RAM and is moved whole onto %s when it runs (%s bytes)", name,
                 "the stand-in" if self.device is not None else runs_on, sum(t.nbytes for *_, t in hook.tensors))
        return hook

    def bring(self, hook: MoveHook) -> None:
        """``hook``'s component onto its device, the one there sent back first."""
        there = self.on.get(hook.runs_on)
        if there == hook.name:
            return
        if there is not None:
            self.hooks[there].send_back()
        copy = ((lambda t: self.device.put(t)) if self.device is not None
                else (lambda t: t.to(hook.runs_on, non_blocking=False)))
        copies: dict[int, object] = {}
        for owner, attr, is_param, host in hook.tensors:
            value = copies.get(id(host))
            if value is None:   # a tensor two modules share (tied) is copied once, and stays one parameter
                value = copies[id(host)] = _wrap(copy(host), host, is_param)
                self.moved += host.nbytes
            _set(owner, attr, is_param, value)
        self.on[hook.runs_on] = hook.name
        self.moves[hook.name] += 1

    def send_back(self, name: str) -> None:
        """Component ``name`` back to its tensors in RAM (nothing copied back)."""
        self.hooks[name].send_back()

    def offload_all(self) -> None:
        """Every moved component back in RAM."""
        for name in list(self.on.values()):
            self.hooks[name].send_back()


class MoveHook:
    """accelerate ``ModelHook`` of one moved component: onto ``runs_on`` before it runs (``forward``, and diffusers'
    ``apply_forward_hook`` methods such as ``AutoencoderKL.decode``), its inputs sent there; it stays there after,
    until another moved component needs the device.

    ``execution_device`` is where the pipeline sends its inputs (diffusers' ``_execution_device`` reads it): the
    device moved onto, or the CPU for the stand-in (whose memory is RAM).
    """

    no_grad = False

    def __init__(self, moves: ModelMoves, name: str, runs_on):
        self.moves, self.name, self.runs_on = moves, name, runs_on
        self.execution_device = "cpu" if moves.device is not None else _torch_device(runs_on)
        self.tensors: list[tuple] = []

    def init_hook(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        from accelerate.utils import send_to_device

        self.moves.bring(self)
        if self.moves.device is not None:
            return args, kwargs
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    def post_forward(self, module, output):
        return output

    def detach_hook(self, module):
        self.send_back()
        self.moves.hooks.pop(self.name, None)
        return module

    @property
    def on_device(self) -> bool:
        """Whether the component is on its device now."""
        return self.moves.on.get(self.runs_on) == self.name

    def send_back(self) -> None:
        if not self.on_device:
            return
        for owner, attr, is_param, host in self.tensors:
            _set(owner, attr, is_param, host)
        del self.moves.on[self.runs_on]


class CpuHook:
    """accelerate ``ModelHook`` of a component computed on the CPU, where it lives: the tensors it is given are brought
    to the CPU (plain copies of the stand-in's tagged ones) and, with ``back=True``, its outputs are sent back to the
    device of its inputs. It has no ``execution_device``, so diffusers' ``_execution_device`` looks past it to the
    components that run on the accelerator."""

    no_grad = False

    def __init__(self, device: StandInDevice | None = None, *, back: bool = True):
        self.device, self.back = device, back
        self.came_from = None
        self.calls = 0

    def init_hook(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        from accelerate.utils import find_device, send_to_device

        self.calls += 1
        if self.device is not None:
            self.came_from = "stand-in" if any(map(on_stand_in, _leaves([args, kwargs]))) else None
            return self.device.to_host(args), self.device.to_host(kwargs)
        self.came_from = find_device([args, kwargs])
        return send_to_device(args, "cpu"), send_to_device(kwargs, "cpu")

    def post_forward(self, module, output):
        from accelerate.utils import send_to_device

        if not self.back or self.came_from is None:
            return output
        if self.device is not None:
            return self.device.put(output)
        return send_to_device(output, self.came_from)

    def detach_hook(self, module):
        return module


def compute_on_cpu(name: str, module, device: StandInDevice | None = None) -> CpuHook:
    """Hooks on ``module`` (component ``name``, loaded in RAM) that compute it on the CPU whatever device its inputs
    are on: one on the module (outputs sent back where the inputs came from) and one on each direct child (inputs
    only), for the methods that call its children without ``forward`` (``AutoencoderKL.decode``). Returns the
    module's hook.

    Raises
    ------
    InvalidRuntime
        ``module`` has hooks already.
    """
    from accelerate.hooks import add_hook_to_module

    if getattr(module, "_hf_hook", None) is not None:
        raise InvalidRuntime(f"component {name!r} has hooks already ({type(module._hf_hook).__name__}); a component "
                             "computed on the CPU is loaded whole in RAM (device_map=None).")
    top = CpuHook(device)
    add_hook_to_module(module, top)
    for child in module.children():
        if getattr(child, "_hf_hook", None) is None:
            add_hook_to_module(child, CpuHook(device, back=False))
    log.info("%s computes on the CPU, where it lives", name)
    return top


def _leaves(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)


def moves_of(component) -> ModelMoves | None:
    """The :class:`ModelMoves` a component (or a pipeline, through its components) was given under
    :func:`allocator.patch`; ``None`` where nothing is moved."""
    found = getattr(component, "_allocator_moves", None)
    if found is None and isinstance(getattr(component, "components", None), dict):
        found = next((m for m in map(moves_of, component.components.values()) if m is not None), None)
    return found


def _torch_device(device):
    import torch

    return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)


def _tensors(module, name: str) -> list[tuple]:
    """``(owner module, attribute, is a parameter, the tensor in RAM)`` for every parameter and buffer."""
    import torch

    found = []
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for attr, param in owner._parameters.items():
            if param is None:
                continue
            if type(param) is not torch.nn.Parameter or param.device.type != "cpu" or on_stand_in(param):
                raise InvalidRuntime(f"{name}.{owner_name}.{attr} is a {type(param).__name__} on {param.device}: a "
                                     "moved component is moved as plain parameters in RAM; load it whole on the CPU "
                                     "(device_map={'': 'cpu'}), unquantized.")
            found.append((owner, attr, True, param))
        for attr, buffer in owner._buffers.items():
            if buffer is not None:
                found.append((owner, attr, False, buffer))
    return found


def _wrap(value, host, is_param: bool):
    import torch

    return torch.nn.Parameter(value, requires_grad=host.requires_grad) if is_param else value


def _set(owner, attr, is_param: bool, value) -> None:
    (owner._parameters if is_param else owner._buffers)[attr] = value
