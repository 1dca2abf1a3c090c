"""The bytes an offloaded tensor is read from: checkpoint files memory-mapped once, and where in them each tensor is.

:class:`MappedFile` maps one safetensors file (or a headerless ``.dat`` file of accelerate's offload folder) and
makes tensors that are views into the mapping; :class:`MappedFiles` keeps every file a runtime reads, each mapped
once; :func:`source_of` finds where one tensor of accelerate's ``weights_map`` is (a :class:`TensorSource`).
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidRuntime
from ..model.safetensors import SAFETENSORS_DTYPES, safetensors_header

__all__ = ["PAGE", "MappedFile", "MappedFiles", "TensorSource", "source_of"]

#: The size of a memory page: read-ahead and page-in work in whole pages.
PAGE = mmap.PAGESIZE


class MappedFile:
    """One file memory-mapped once (copy on write: views are writable, the file is never changed).

    Parameters
    ----------
    path : str
        A safetensors file, or (``raw=True``) a headerless ``.dat`` file of accelerate's offload folder.
    """

    def __init__(self, path: str, *, raw: bool = False):
        self.path = path
        self.kept: list[tuple[int, int]] = []   # byte ranges held in memory (:meth:`keep`)
        self.closed = False
        self.base, self.entries = (0, {}) if raw else safetensors_header(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def span(self, name: str) -> tuple[int, int]:
        """The absolute byte range of tensor ``name``."""
        start, end = self.entries[name]["data_offsets"]
        return self.base + start, self.base + end

    def view(self, start: int, end: int, dtype, shape):
        """A tensor over bytes ``start:end`` of the mapping, without a copy where the offset is aligned."""
        import torch

        if self.closed:
            raise InvalidRuntime(f"{self.path} was unmapped when its runtime was detached; attach the model again.")

        count = (end - start) // dtype.itemsize
        if count == 0 or self.mm is None:
            return torch.empty(shape, dtype=dtype)
        if start % dtype.itemsize:
            return torch.frombuffer(bytearray(self.mm[start:end]), dtype=dtype).reshape(shape)
        return torch.frombuffer(self.mm, dtype=dtype, count=count, offset=start).reshape(shape)

    def tensor(self, name: str):
        """Tensor ``name`` of a safetensors file, a view into the mapping."""
        import torch

        entry = self.entries[name]
        return self.view(*self.span(name), getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]]), entry["shape"])

    def evict(self) -> None:
        """Drop this mapping's pages from the process (``MADV_DONTNEED``: they are read again from the file when
        touched), so that the kernel may drop them from the page cache too (cold-cache measurements); the ranges
        :attr:`kept` (experts kept resident in place, :mod:`allocator.offload.experts`) stay."""
        if self.mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = 0
        for lo, hi in sorted(self.kept) + [(len(self.mm), len(self.mm))]:
            end = lo - lo % PAGE          # whole pages before the kept range
            if end > start:
                self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            start = max(start, hi + (-hi) % PAGE)

    def keep(self, start: int, end: int) -> None:
        """Hold bytes ``start:end`` in this process's memory: written in place (copy on write makes them private
        pages, no longer read from the file) and left out of :meth:`evict`."""
        if self.mm is None or end <= start:
            return
        view = memoryview(self.mm)[start:end]
        view[:] = bytes(view)
        self.kept.append((start, end))

    def release(self, start: int, end: int) -> None:
        """Give back bytes ``start:end`` held by :meth:`keep`: the whole pages inside the range are dropped from the
        process (``MADV_DONTNEED``: read from the file again when touched); a page it shares with a neighbour stays
        private, with the same bytes."""
        if (start, end) in self.kept:
            self.kept.remove((start, end))
        lo, hi = start + (-start) % PAGE, end - end % PAGE
        if self.mm is not None and hi > lo and hasattr(mmap, "MADV_DONTNEED"):
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        """Unmap the file (its private pages, :meth:`keep`'s, go back to the system) where no tensor views it any
        more, else once the last view is gone; :meth:`view` refuses afterwards."""
        mm, self.mm, self.closed, self.kept = self.mm, None, True, []
        if mm is not None:
            try:
                mm.close()
            except BufferError:   # a view is still alive somewhere: the mapping goes with it
                pass

    def advise(self, start: int, end: int) -> None:
        """Ask the kernel to read ``start:end`` in (asynchronous read-ahead)."""
        if self.mm is None or end <= start or not hasattr(mmap, "MADV_WILLNEED"):
            return
        lo = start - start % PAGE
        self.mm.madvise(mmap.MADV_WILLNEED, lo, end - lo)

    def page_in(self, start: int, end: int) -> None:
        """Read ``start:end`` in now: the kernel's read-ahead, then one byte touched per page."""
        if self.mm is None or end <= start:
            return
        self.advise(start, end)
        lo = start - start % PAGE
        memoryview(self.mm)[lo:end:PAGE].tobytes()


class MappedFiles:
    """Every file a runtime reads, each mapped once and kept (safe to share between threads).

    Attributes
    ----------
    open : dict
        ``(real path, raw) -> MappedFile``, every file mapped so far.
    """

    def __init__(self):
        self.open: dict[tuple[str, bool], MappedFile] = {}
        self.lock = threading.Lock()

    def get(self, path: str, raw: bool = False) -> MappedFile:
        """The mapping of ``path`` (``raw``: a headerless ``.dat`` file), made at the first call."""
        with self.lock:
            key = (os.path.realpath(path), raw)
            if key not in self.open:
                self.open[key] = MappedFile(path, raw=raw)
            return self.open[key]

    def close(self) -> None:
        """Unmap every file (:meth:`MappedFile.close`) and forget them."""
        with self.lock:
            files, self.open = list(self.open.values()), {}
        for f in files:
            f.close()


@dataclass(frozen=True)
class TensorSource:
    """Where one offloaded tensor's bytes are: a mapped file range, or a tensor already in RAM.

    Two tensors with the same ``key`` are the same bytes (tied weights): the runtime fetches them once.
    """

    key: tuple                      # shared by tied tensors: one fetch, one copy
    file: MappedFile | None = None
    start: int = 0
    end: int = 0
    dtype: object = None            # stored dtype
    shape: tuple = ()
    ram: object = None              # a host tensor (accelerate's state_dict for cpu-offloaded weights)

    def host(self):
        """The tensor on the host: a view into the mapped file, or the tensor in RAM."""
        return self.ram if self.file is None else self.file.view(self.start, self.end, self.dtype, self.shape)

    def page_in(self) -> None:
        """Read the tensor's pages in now (:meth:`MappedFile.page_in`); nothing for a tensor in RAM."""
        if self.file is not None:
            self.file.page_in(self.start, self.end)

    def advise(self) -> None:
        """Start the kernel's read-ahead of the tensor's pages (:meth:`MappedFile.advise`); nothing for one in RAM."""
        if self.file is not None:
            self.file.advise(self.start, self.end)


def source_of(weights_map: Mapping, name: str, files: MappedFiles) -> TensorSource:
    """The source of tensor ``name`` of accelerate's (prefixed) ``weights_map``, read like ``weights_map[name]``.

    A tensor accelerate holds in RAM is kept as it is; one on disk is a range of a file of ``files`` (a safetensors
    checkpoint, or a ``.dat`` file of the offload folder).

    Raises
    ------
    InvalidRuntime
        accelerate's offload index has no entry for the tensor (a tied weight ``load_checkpoint_and_dispatch`` did
        not store).
    """
    import torch
    from accelerate.utils.offload import OffloadedWeightsLoader, PrefixedDataset

    loader, full = weights_map, name
    if isinstance(loader, PrefixedDataset):
        loader, full = loader.dataset, loader.prefix + name
    if not isinstance(loader, OffloadedWeightsLoader) or full in loader.state_dict:
        value = weights_map[name]
        return TensorSource(key=("ram", id(value)), ram=value)
    if full not in loader.index:
        raise InvalidRuntime(
            f"accelerate's offload index has no {full!r} (a tied weight load_checkpoint_and_dispatch did not store; "
            f"accelerate's own hooks fail on it at the first forward): load the model with from_pretrained.")
    info = loader.index[full]
    if info.get("safetensors_file") is not None:
        f = files.get(info["safetensors_file"])
        entry_name = info.get("weight_name", full)
        entry = f.entries[entry_name]
        start, end = f.span(entry_name)
        return TensorSource(key=(f.path, entry_name), file=f, start=start, end=end,
                            dtype=getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]]), shape=tuple(entry["shape"]))
    path = os.path.join(loader.save_folder, f"{full}.dat")
    f = files.get(path, raw=True)
    shape = tuple(info["shape"])
    dtype = getattr(torch, info["dtype"])
    return TensorSource(key=(f.path,), file=f, start=0, end=dtype.itemsize * max(1, math.prod(shape)),
                        dtype=dtype, shape=shape)
