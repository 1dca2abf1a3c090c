"""The hook on an offloaded fused experts module run by :class:`allocator.offload.experts.RoutedExperts`: it replaces
accelerate's ``AlignDevicesHook`` there, moves the module's inputs to the layer's device and its output back, and loads
no weights (the routed experts are read or fetched by the runtime). On a CPU main device it hands CPU arguments over as
they are: accelerate's walk over them (``send_to_device``) would return the same tensors, at every call of every
layer.
"""

from __future__ import annotations

__all__ = ["ExpertsHook"]


class ExpertsHook:
    """Replaces the accelerate hook of an offloaded fused experts module: moves its inputs to the main device and
    its output back, loads no weights (:class:`allocator.offload.experts.RoutedExperts` runs the routed experts)."""

    no_grad = False

    def __init__(self, routed, original):   # routed: allocator.offload.experts.RoutedExperts
        self.routed, self.original = routed, original
        self.io_same_device = original.io_same_device
        # the layer's device (Runtime.runs_on): the main device, or another accelerator holding the layer
        self.execution_device = original.execution_device if routed.home in (None, "main") else routed.main
        self.skip_keys = original.skip_keys
        self.input_device = None
        # a CPU main device: the arguments, CPU tensors, are used as they come (no walk over them per call)
        self.on_host = not routed.accelerator and str(self.execution_device) == "cpu"

    def init_hook(self, module):
        return module

    def detach_hook(self, module):
        return self.original.detach_hook(module)

    def pre_forward(self, module, *args, **kwargs):
        from accelerate.utils import find_device, send_to_device

        if self.on_host and not kwargs and all([getattr(a, "is_cpu", True) for a in args]):
            self.input_device = None   # already where they run, and where the output stays
            return args, kwargs
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        return send_to_device(args, self.execution_device), send_to_device(
            kwargs, self.execution_device, skip_keys=self.skip_keys)

    def post_forward(self, module, output):
        from accelerate.utils import send_to_device

        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output
