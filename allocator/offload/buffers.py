"""The buffers the runtime copies fetched expert slices into, on the device an experts module runs for.

Each call of an offloaded experts module (:class:`allocator.offload.experts.RoutedExperts`) copies the routed
experts it fetches into one reused buffer per parameter; the buffers are shared by the layers that fetch to the
same device and released when the layer's forward returns, so the runtime holds at once what the plan reserves.
"""

from __future__ import annotations

__all__ = ["FetchBuffers"]


class FetchBuffers:
    """The buffers fetched expert slices are copied into: one tensor per device, parameter name, slice shape and
    dtype, shared by the layers that fetch to that device, reused by the turns of one call, grown to the most experts
    one turn fetches, and released when the layer's forward returns (:meth:`release`), as accelerate's hooks drop a
    module's weights after its forward. So the runtime holds them only while an experts module runs, at most one
    layer's routed experts at once: what the plan reserves, the streaming reserve on the main device
    (:func:`allocator.evaluate.memory.peaks`: the streamed chain holds a whole experts module), the largest
    :func:`allocator.evaluate.memory.fetch_chunk` on another accelerator (:func:`allocator.evaluate.memory.
    fetch_reserves`). ``account(nbytes)`` is told of every change (the runtime's ``held``)."""

    def __init__(self, account=None):
        self.tensors: dict = {}
        self.account = account if account is not None else (lambda nbytes: None)

    def take(self, device: str, name: str, like, count: int):
        """A ``[count, ...]`` view of the buffer for slices shaped and typed like ``like[0]`` on ``device``."""
        import torch

        key = (device, name, tuple(like.shape[1:]), like.dtype)
        buffer = self.tensors.get(key)
        if buffer is None or buffer.shape[0] < count:
            if buffer is not None:
                self.account(-buffer.numel() * buffer.element_size())
            buffer = self.tensors[key] = torch.empty((max(count, 1),) + key[2], dtype=like.dtype, device=device)
            self.account(buffer.numel() * buffer.element_size())
        return buffer[:count]

    def release(self, device: str) -> None:
        """Drop the buffers on ``device`` (the experts module that used them has returned)."""
        for key in [k for k in self.tensors if k[0] == device]:
            buffer = self.tensors.pop(key)
            self.account(-buffer.numel() * buffer.element_size())

    def clear(self) -> None:
        """Drop the buffers on every device (the runtime is detached)."""
        for device in {k[0] for k in self.tensors}:
            self.release(device)

    def nbytes(self, device: str | None = None) -> int:
        """Bytes the buffers hold now (on ``device`` only, where given)."""
        return sum(t.numel() * t.element_size() for (d, *_), t in self.tensors.items() if device in (None, d))
