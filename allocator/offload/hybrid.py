"""Hybrid execution (issue #40): an offloaded unit runs, per call, where the plan says it computes in the phase the
call is in (:attr:`allocator.Plan.compute`, made by :mod:`allocator.evaluate.compute`).

:class:`HybridHook` replaces the :class:`allocator.offload.OffloadHook` of a unit that computes on the CPU in some
phase. A call with at most the plan's ``threshold`` tokens is a decode call, a longer one a prefill call. Where the
phase's device is the main device, the hook is the offload hook (weights streamed). Where it is ``"cpu"``, nothing is
copied: the unit's tensors are set to views of the mapped files (RAM), its inputs moved to the CPU (through a pinned
staging buffer on an accelerator) and its output moved back; the KV cache layer the unit fills is moved to the CPU
once and stays there. torch runs the call with its own intra-op threads (``torch.get_num_threads()``) on the calling
thread: the runtime starts no compute thread, so the CPU is not oversubscribed (the prefetch thread only copies).

A split decoder layer (issue #49) is in the map as its parts (``model.layers.3.self_attn: 0``, the norms on ``0``,
``model.layers.3.mlp: "cpu"``) and in the compute map as its offloaded part (``model.layers.3.mlp``); its attention
and KV cache stay on the main device and its MLP runs where the phase says, its activations crossing once per part
and direction (:class:`LayerHook` where the part's offload hooks are on its leaves, :class:`HybridHook` where the
part is one unit). What crosses is counted by the stream device (``StreamDevice.moves``).
"""

from __future__ import annotations

from ..model.cache_kwarg import forward_cache
from .devices import StreamDevice, to_host, to_main

__all__ = ["Aside", "HybridHook", "LayerHook", "call_tokens", "layer_hooks", "make_layer_hooks", "part_to_host",
           "part_to_main", "phase_of", "unit_phases", "wrap_units"]


def call_tokens(args, kwargs) -> int:
    """Tokens of a call: batch x sequence of its first floating-point input with at least two dimensions
    (``hidden_states`` ``(batch, sequence, hidden)``, per-head states ``(batch, sequence, heads, head_dim)``; a 2-D
    one is ``(tokens, hidden)``), else the elements of its first tensor (token ids ``(batch, sequence)`` of an
    embedding); 0 without tensors."""
    import torch

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    states = [t for t in tensors if t.is_floating_point() and t.dim() >= 2]
    for t in states:
        return int(t.shape[0] * t.shape[1]) if t.dim() >= 3 else int(t.shape[0])
    return int(tensors[0].numel()) if tensors else 0


def phase_of(tokens: int, threshold: int) -> str:
    """``"decode"`` for a call of at most ``threshold`` tokens, else ``"prefill"``."""
    return "decode" if tokens <= threshold else "prefill"


def _nbytes(value, skip) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v, skip) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v, skip) for k, v in value.items() if k not in skip)
    return 0


def _layer_index(module):
    for sub in module.modules():
        index = getattr(sub, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


def unit_phases(compute, name: str):
    """The phases of the unit ``name`` (a module with an offload hook) in ``compute`` (unit -> {phase: device}): its
    own entry or its closest ancestor's; ``None`` where it computes on the main device in every phase."""
    probe = name
    while True:
        if probe in compute:
            phases = compute[probe]
            return phases if "cpu" in phases.values() else None
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


class HybridHook:
    """Wraps the :class:`allocator.offload.OffloadHook` of a unit that computes on the CPU in the phases the plan
    says (module docstring); in the other phases the offload hook runs.

    Attributes
    ----------
    phases : dict
        phase -> device, from the plan's compute map.
    threshold : int
        The most tokens of a decode call.
    calls : dict
        phase -> calls run on the CPU.
    streamed : int
        Calls run on the main device, the weights streamed.
    """

    no_grad = False

    def __init__(self, inner, phases: dict, threshold: int):
        self.inner = inner
        runtime, unit = inner.runtime, inner.unit
        self.runtime, self.unit = runtime, unit
        h = unit.original
        self.execution_device, self.io_same_device, self.skip_keys = h.execution_device, h.io_same_device, h.skip_keys
        self.input_device = None
        self.phases, self.threshold = dict(phases), threshold
        self.calls: dict = {}
        self.streamed = 0
        self.local = self.from_host = False
        self.layer = _layer_index(unit.module)
        device = runtime.device
        #: the stream device that moves values (a GPU or its stand-in); ``None`` on the CPU (accelerate's moves)
        self.device = device if isinstance(device, StreamDevice) else None
        self.staging: dict = {}

    def init_hook(self, module):
        return module

    def detach_hook(self, module):
        return self.inner.detach_hook(module)

    def pre_forward(self, module, *args, **kwargs):
        from accelerate.utils import find_device

        phase = phase_of(call_tokens(args, kwargs), self.threshold)
        self.from_host = getattr(self.runtime, "local_layers", 0) > 0   # inside a layer computed on the CPU
        if self.from_host:   # the layer's phase decides, and its leaves' calls count in it
            phase = self.runtime.layer_phase
        self.local = self.phases.get(phase) == "cpu" or self.from_host
        if not self.local:
            self.streamed += 1
            self._cache_to(kwargs, host=False)
            return self.inner.pre_forward(module, *args, **kwargs)
        import torch

        self.calls[phase] = self.calls.get(phase, 0) + 1
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        for s in self.unit.slots:   # views of the mapped files: nothing copied
            host = s.source.host()
            host = host if host.dtype == s.meta.dtype else host.to(s.meta.dtype)
            if s.is_param:
                s.owner._parameters[s.attr] = torch.nn.Parameter(host, requires_grad=s.meta.requires_grad)
            else:
                s.owner._buffers[s.attr] = host
        skip = set(self.skip_keys or ()) if not isinstance(self.skip_keys, str) else {self.skip_keys}
        if not self.from_host:   # inside a layer computed on the CPU nothing crosses here
            self.runtime.traffic.activations += _nbytes(list(args), skip) + _nbytes(kwargs, skip)
        return self._to_host(args, kwargs)

    def post_forward(self, module, output):
        if not self.local:
            return self.inner.post_forward(module, output)
        from accelerate.utils import send_to_device

        for s in self.unit.slots:
            if s.is_param:
                s.owner._parameters[s.attr] = s.meta
            else:
                s.owner._buffers[s.attr] = s.meta
        if self.from_host:   # its inputs came from the CPU (a layer computed there): its output stays there
            return output
        skip = set(self.skip_keys or ()) if not isinstance(self.skip_keys, str) else {self.skip_keys}
        self.runtime.traffic.activations += _nbytes(output if isinstance(output, (tuple, list, dict)) else [output],
                                                    skip)
        target = self.input_device if self.io_same_device and self.input_device is not None else \
            self.execution_device
        if self.device is not None:
            return self.device.to_main(self._staged(output), target, self.skip_keys)
        return send_to_device(output, target, skip_keys=self.skip_keys)

    def _to_host(self, args, kwargs):
        """The call's KV cache layer, then its arguments, moved to the CPU (through the stream device where there is
        one, else accelerate's moves)."""
        from accelerate.utils import send_to_device

        self._cache_to(kwargs, host=True)
        if self.device is not None:   # one move: the call's arguments together
            return self.device.to_host((args, kwargs), self.skip_keys)
        return send_to_device(args, "cpu"), send_to_device(kwargs, "cpu", skip_keys=self.skip_keys)

    def _staged(self, output, at: tuple = ()):
        """Tensors of ``output`` copied into pinned buffers (an accelerator copies from them at the pinned rate), one
        per position in the output (``at``: the indices down to it), shape and dtype: two same-shaped tensors of one
        output never share a buffer. The copies out of them (``to_main``: accelerate's ``send_to_device``, blocking)
        are done before the hook returns, so the hook's next CPU call may reuse them."""
        import torch

        if isinstance(output, torch.Tensor):
            key = (at, tuple(output.shape), output.dtype)
            buffer = self.staging.get(key)
            if buffer is None:
                buffer = self.staging[key] = self.device.pinned(output.shape, output.dtype)
            return buffer.copy_(output)
        if isinstance(output, tuple) and not hasattr(output, "_fields"):
            return type(output)(self._staged(o, (*at, i)) for i, o in enumerate(output))
        return output

    def _cache_to(self, kwargs, *, host: bool) -> None:
        """Move the cache layer this unit fills (the forward's KV cache, ``cache=`` or ``past_key_values=``: layer
        ``layer_idx``) to the CPU (``host``) or the main device where it is elsewhere: after a prefill on the main
        device, once, before the first decode on the CPU, and back before a call streamed after one on the CPU."""
        cache = forward_cache(kwargs)
        layers = getattr(cache, "layers", None)
        if self.layer is None or layers is None or self.layer >= len(layers):
            return
        layer = layers[self.layer]
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is None or not hasattr(tensor, "device"):
                continue
            if self.device is None:
                target = "cpu" if host else self.execution_device
                if str(tensor.device) != str(target):
                    setattr(layer, name, tensor.to(target))
            elif self.device.on_main(tensor) == host:
                setattr(layer, name, self.device.to_host(tensor, what="cache") if host else
                        self.device.to_main(tensor, self.execution_device, what="cache"))


class LayerHook(HybridHook):
    """The boundary of a unit of the compute map whose offload hooks are on its leaves: ``from_pretrained`` puts
    accelerate's offload hooks on the leaf modules of an offloaded decoder layer, or of an offloaded part of a split
    one (its MLP, shared experts; issue #49), which never see the KV cache, and hooks that only move tensors to the
    main device on the layer (the part) and its blocks. In a phase the plan computes on the
    CPU, this hook (in place of the layer's own) moves the layer's inputs and its KV cache layer to the CPU once, the
    blocks' moving hooks stand aside (:class:`Aside`), the leaves compute there on views of the mapped files (their
    :class:`HybridHook` keeps their outputs where their inputs are), and the layer's output goes back to the main
    device once: activations cross the boundary once per layer (per part) and direction, not once per leaf. A part
    without a KV cache layer of its own (an MLP: no ``layer_idx`` inside) moves none. In the other phases the layer's
    own hook runs, after the cache layer is moved back to the main device."""

    def __init__(self, module, original, runtime, phases: dict, threshold: int):
        self.inner, self.runtime, self.unit = original, runtime, None
        self.execution_device = original.execution_device
        self.io_same_device, self.skip_keys = original.io_same_device, original.skip_keys
        self.input_device = None
        self.phases, self.threshold = dict(phases), threshold
        self.calls: dict = {}
        self.streamed = 0
        self.local = self.from_host = False
        self.layer = _layer_index(module)
        device = runtime.device
        self.device = device if isinstance(device, StreamDevice) else None
        self.staging: dict = {}

    def detach_hook(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        from accelerate.utils import find_device

        phase = phase_of(call_tokens(args, kwargs), self.threshold)
        self.local = self.phases.get(phase) == "cpu"
        if not self.local:
            self.streamed += 1
            self._cache_to(kwargs, host=False)
            return self.inner.pre_forward(module, *args, **kwargs)
        self.calls[phase] = self.calls.get(phase, 0) + 1
        self.runtime.local_layers = getattr(self.runtime, "local_layers", 0) + 1   # its leaves compute in RAM
        self.runtime.layer_phase = phase
        self.input_device = find_device([args, kwargs])
        self.runtime.traffic.activations += _nbytes(list(args), set()) + _nbytes(kwargs, set())
        return self._to_host(args, kwargs)

    def post_forward(self, module, output):
        if not self.local:
            return self.inner.post_forward(module, output)
        from accelerate.utils import send_to_device

        self.runtime.local_layers -= 1
        self.runtime.traffic.activations += _nbytes(output if isinstance(output, (tuple, list, dict)) else [output],
                                                    set())
        if self.device is not None:
            return self.device.to_main(self._staged(output), self.execution_device, self.skip_keys)
        return send_to_device(output, self.execution_device, skip_keys=self.skip_keys)


class Aside:
    """A hook that only moves tensors to the main device (accelerate's ``AlignDevicesHook`` without offload) on a
    block inside a :class:`LayerHook`'s layer: it stands aside while the layer computes on the CPU."""

    no_grad = False

    def __init__(self, original, layer: LayerHook):
        self.inner, self.layer = original, layer

    def init_hook(self, module):
        return module

    def detach_hook(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        return (args, kwargs) if self.layer.local else self.inner.pre_forward(module, *args, **kwargs)

    def post_forward(self, module, output):
        return output if self.layer.local else self.inner.post_forward(module, output)


def layer_hooks(model, compute, units) -> list:
    """The layers that make each module of the compute map (``compute``: unit -> {phase: device})
    computed on the CPU in some phase, whose offload hooks are on its leaves (``units``: the runtime's units, none of
    them that module), compute there as one (a decoder layer, or a part of a split one such as its MLP): a
    :class:`LayerHook` in place of the layer's own moving hook (the layer: the module, or each child of a module
    list), an :class:`Aside` in place of each moving hook of a block inside it.
    Returns ``(name, layer, its hook, phases)``; :func:`make_layer_hooks` makes the hooks
    (:func:`allocator.offload.attach`)."""
    import torch

    if compute is None:
        return []
    own = {u.name for u in units}
    out = []
    for name, phases in compute.to_dict().items():
        if "cpu" not in phases.values() or name in own:
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        layers = [(f"{name}.{k}", m) for k, m in module.named_children()] if isinstance(
            module, (torch.nn.ModuleList, torch.nn.ModuleDict)) else [(name, module)]
        for prefix, layer in layers:
            hook = layer.__dict__.get("_hf_hook")
            if not _moving(hook) or not any(u.name.startswith(prefix + ".") for u in units):
                continue
            out.append((prefix, layer, hook, phases))
    return out


def make_layer_hooks(found, runtime, threshold: int) -> list:
    """``(module, our hook, its original)`` for :func:`layer_hooks`' layers: the layer's :class:`LayerHook` and an
    :class:`Aside` for each block inside it whose own hook only moves tensors."""
    out = []
    for _, layer, hook, phases in found:
        boundary = LayerHook(layer, hook, runtime, phases, threshold)
        out.append((layer, boundary, hook))
        for sub in layer.modules():
            inner = sub.__dict__.get("_hf_hook")
            if sub is not layer and _moving(inner):
                out.append((sub, Aside(inner, boundary), inner))
    return out


def _moving(hook) -> bool:
    """Whether ``hook`` is accelerate's ``AlignDevicesHook`` that only moves tensors (no offload)."""
    return type(hook).__name__ == "AlignDevicesHook" and not getattr(hook, "offload", True)


def wrap_units(hooks: dict, compute) -> None:
    """Wrap the offload hook of each unit that the plan's compute map (``Plan.hybrid``, read from the plan as it is)
    runs on the CPU in some phase in a :class:`allocator.offload.hybrid.HybridHook`."""
    if compute is None:
        return
    devices = compute.to_dict()
    for key, hook in list(hooks.items()):
        phases = unit_phases(devices, hook.unit.name)
        if phases is not None:
            hooks[key] = HybridHook(hook, phases, compute.threshold)


def part_to_host(routed, *tensors) -> list:
    """The inputs of a part computed where its weights live, moved to RAM in one move (``routed``: an experts
    layer's :class:`allocator.offload.experts.RoutedExperts`, its ``device`` and ``traffic``), and a zeroed tensor
    like the first for the part's output sum there: ``[*moved, out]``. The bytes count in ``traffic.activations``."""
    import torch

    moved = to_host(routed.device, tensors)
    routed.traffic.activations += _nbytes(moved, set())
    return [*moved, torch.zeros_like(moved[0])]


def part_to_main(routed, out, target):
    """The part's output sum ``out`` moved back to the main device ``target`` in one move (:func:`part_to_host`)."""
    routed.traffic.activations += _nbytes(out, set())
    return to_main(routed.device, out, target)
