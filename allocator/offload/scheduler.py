"""What the offload runtime moves and in which order: the tensors each offloaded module streams
(:class:`Slot`), the modules themselves (:class:`OffloadedModule`), and the :class:`Scheduler` that learns
which offloaded module runs after which, so that the next ones are made ready ahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .files import TensorSource

__all__ = ["OffloadedModule", "Scheduler", "Slot"]


@dataclass
class Slot:
    """One tensor a hook streams: where it is set on the module, its meta placeholder, where its bytes are.

    Attributes
    ----------
    owner, attr : torch.nn.Module, str
        The tensor is ``owner.<attr>``, a parameter (``is_param``) or a buffer.
    meta : torch.Tensor
        The meta placeholder put back when the module is done; its dtype is the one the module runs in.
    source : TensorSource
        Where the bytes are.
    """

    owner: object
    attr: str
    is_param: bool
    meta: object
    source: TensorSource

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor as the module runs it."""
        return self.meta.numel() * self.meta.element_size()


@dataclass
class OffloadedModule:
    """One offloaded module (a unit of :attr:`Attached.units`): accelerate's hook it replaces and the tensors it
    streams.

    Attributes
    ----------
    index : int
        Its place in module order, the number :class:`Scheduler` knows it by.
    name, module : str, torch.nn.Module
        The module and its qualified name.
    original : accelerate.hooks.AlignDevicesHook
        The hook it replaces (put back by :func:`allocator.offload.detach`).
    slots : list of Slot
        The tensors it streams.
    """

    index: int
    name: str
    module: object
    original: object                 # accelerate's AlignDevicesHook
    slots: list[Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors (a tied tensor counted at each use)."""
        return sum(s.nbytes for s in self.slots)


class Scheduler:
    """Which offloaded unit runs after which: module order at first, then what really ran (learnt at every step,
    so ``generate``'s repeated decoder passes and an encoder that runs once are both followed).

    Examples
    --------
    >>> s = Scheduler(4)          # before anything ran: module order, wrapping round
    >>> s.ahead(2, 2)
    [3, 0]
    >>> for unit in (0, 2, 1, 0):   # what really ran: 0, then 2, then 1, then 0 again
    ...     s.arrive(unit)
    >>> s.ahead(0, 2)
    [2, 1]
    """

    def __init__(self, n: int):
        self.after = {i: i + 1 for i in range(n - 1)}
        if n:
            self.after[n - 1] = 0
        self.last: int | None = None

    def arrive(self, unit: int) -> None:
        if self.last is not None and self.last != unit:
            self.after[self.last] = unit
        self.last = unit

    def ahead(self, unit: int, k: int) -> list[int]:
        """The next ``k`` distinct units expected after ``unit``."""
        out, u = [], unit
        for _ in range(k):
            u = self.after.get(u)
            if u is None or u == unit or u in out:
                break
            out.append(u)
        return out
