"""accelerate's runtime rules (see :mod:`allocator.runtime`) as small functions of a map's devices and a tensor's
flags, one helper per rule: the main device, the offloaded devices, the device of a name, what moves with an offloaded
module, where a module executes.

They import nothing of the package but the ``Device`` type, so every layer that evaluates maps (:mod:`allocator.runs`,
:mod:`allocator.runtime`, :mod:`allocator.validate`, :mod:`allocator.cost`, the strategies) can use them;
:mod:`allocator.runtime` re-exports them.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping

from .budgets import Device, is_torch_device

__all__ = ["LOADERS", "ambiguous_main_device", "hooks_attach",
           "main_device", "offloaded_devices", "device_of", "moves_with_weights", "moves", "executes_on",
           "must_cover", "nested_keys", "loads_disk_only", "reads_disk_buffers", "tie_loads", "loads_from_disk",
           "read_copy", "device_objects", "loads_device_objects", "ACCELERATE", "release", "accelerate_at_least"]


def release(package: str) -> tuple[int, ...]:
    """The installed release of ``package`` as integers, ``()`` where it is not installed.

    >>> release("a package that is not installed")
    ()
    >>> len(release("accelerate")) >= 2
    True
    """
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ()
    found = []
    for piece in text.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        found.append(int(digits.group()))
    return tuple(found)


ACCELERATE = release("accelerate")
"""The installed accelerate's release. Some loader rules below changed with accelerate 1.16 (a one-device ``"disk"``
map and persistent buffers mapped to disk now load); each rule that changed takes the release as a keyword, this by
default."""


def accelerate_at_least(version: tuple[int, ...], accelerate: tuple[int, ...] | None = None) -> bool:
    """Whether the accelerate release ``accelerate`` (the installed one by default) is ``version`` or later.

    >>> accelerate_at_least((1, 16), (1, 15, 0)), accelerate_at_least((1, 16), (1, 16, 0))
    (False, True)
    """
    return (ACCELERATE if accelerate is None else accelerate) >= version

LOADERS = ("transformers", "accelerate")
"""The loading paths a map can be for (:attr:`allocator.PlanOptions.loader`): transformers 5's ``from_pretrained``,
which loads the weights itself and then calls ``dispatch_model``, and accelerate's ``load_checkpoint_and_dispatch``,
which loads them through ``load_checkpoint_in_model``. The loader rules below say where they differ."""


def main_device(devices) -> Device:
    """The device offloaded modules execute on, exactly as ``dispatch_model`` picks it.

    ``devices`` are the values of a device map. Integer indices give the lowest index for small indices; the
    expression is kept literal so that it matches accelerate in the same process.

    >>> main_device([1, "cpu", 0]), main_device(["cpu", "disk"])
    (0, 'cpu')
    """
    non_offloaded = set(devices) - {"cpu", "disk"}
    return list(non_offloaded)[0] if non_offloaded else "cpu"


def ambiguous_main_device(values) -> tuple | None:
    """The accelerator spellings of a caller's map values (as written, before any normalisation) when the main device
    ``dispatch_model`` picks from them depends on the process's string hashing; else ``None``.

    accelerate 1.15's ``dispatch_model`` (accelerate/big_modeling.py) takes ``list(devices - {"cpu", "disk"})[0]``
    for the main device where hooks attach (two devices or more, or disk): a set of small integers iterates in order,
    a set of strings (``"cuda:1"``, ``"cuda:0"``) or devices in an order that changes with ``PYTHONHASHSEED``. It
    matters where something is offloaded (``cpu`` or ``disk`` values): offloaded modules execute, and stream their
    weights, on the main device. transformers 5's ``from_pretrained`` dispatches the map it is given the same way.

    >>> ambiguous_main_device(["cuda:1", "cuda:0", "cpu"]), ambiguous_main_device([1, 0, "cpu"])
    (('cuda:0', 'cuda:1'), None)
    """
    try:
        values = set(values)
    except TypeError:   # an unhashable value is no device: normalising the map names it
        return None
    accelerators = values - {"cpu", "disk"}
    offloads = bool(values & {"cpu", "disk"})
    if not offloads or len(accelerators) < 2 or all(type(v) is int for v in accelerators):
        return None
    return tuple(sorted(accelerators, key=str))


def hooks_attach(devices) -> bool:
    """Whether ``dispatch_model`` attaches hooks (and so offloads anything) for a map with these device values:
    two devices or more, or disk (accelerate 1.15, accelerate/big_modeling.py ``dispatch_model``; bitsandbytes'
    ``force_hooks`` aside).

    >>> hooks_attach([0, 0]), hooks_attach(["disk"]), hooks_attach([0, "cpu"])
    (False, True, True)
    """
    used = set(devices)
    return len(used) > 1 or "disk" in used


def offloaded_devices(main: Device) -> frozenset:
    """The map values whose weights are streamed to ``main`` at each forward."""
    return frozenset({"disk"}) if main in ("cpu", "mps") else frozenset({"cpu", "disk"})


def device_of(name: str, device_map: Mapping[str, Device]) -> Device | None:
    """The device of a module or tensor name by longest-prefix match (``None`` where the map does not cover it).

    >>> device_of("layers.1.mlp.weight", {"layers.1": 0, "": "cpu"})
    0
    """
    while True:
        if name in device_map:
            return device_map[name]
        if not name:
            return None
        name = name.rpartition(".")[0]


def moves_with_weights(tensor, offload_buffers: bool) -> bool:
    """A tensor leaves the main device with its offloaded module: parameters, and persistent buffers when
    ``offload_buffers`` (non-persistent buffers always stay)."""
    return moves(tensor.is_param, tensor.persistent, offload_buffers)


def moves(is_param, persistent, offload_buffers: bool):
    """:func:`moves_with_weights` from a tensor's flags, or from whole columns of them (numpy bool arrays of
    :class:`allocator.graph.Tensors` columns, elementwise)."""
    return is_param | (offload_buffers & persistent)


def read_copy(stored: int, nbytes: int) -> int:
    """Bytes an offloading hook holds for a moment beyond a streamed tensor's ``nbytes`` (its size at the plan's
    ``dtype``) when it reads the tensor from disk as ``stored`` bytes: the copy as stored, while it is cast; 0 where
    nothing is cast. The same on both paths, measured here (RSS with malloc's mmap threshold at 64 KiB, so freed
    memory is given back): float16 from a float32 checkpoint adds the float32 copy of the tensor being read.

    - transformers 5 (disk tensors are indexed into the checkpoint): accelerate 1.15 ``utils/offload.py``,
      ``OffloadedWeightsLoader.__getitem__``: ``safe_open(...).get_tensor(...)`` reads the stored tensor, then
      ``tensor.to(dtype)`` casts it.
    - accelerate (``load_checkpoint_in_model`` writes disk tensors to ``.dat`` files at the checkpoint's dtype):
      ``utils/offload.py``, ``load_offloaded_weight`` copies the memory-mapped file into a tensor, then
      ``utils/modeling.py``, ``set_module_tensor_to_device`` casts it (``value.to(old_value.dtype)``). The mapped
      file's pages are page cache (reclaimable), which the budget does not count, as for every disk weight.

    >>> read_copy(4096, 2048), read_copy(2048, 2048)
    (4096, 0)
    """
    return stored if stored > nbytes else 0


def executes_on(device: Device, main: Device, offloaded, hooks: bool) -> Device:
    """Where a module mapped to ``device`` runs: the main device when offloaded; ``mps`` for ``cpu`` modules when
    ``mps`` is main (they move there at dispatch); else its own device.

    >>> executes_on("cpu", 0, {"cpu", "disk"}, True), executes_on(1, 0, {"cpu", "disk"}, True)
    (0, 1)
    """
    if device in offloaded:
        return main
    if device == "cpu" and main == "mps" and hooks:
        return "mps"
    return device


# -- the loader rules: what each loading path does with a map before the hooks run ---------------------------------

def must_cover(is_param, persistent):
    """Whether a tensor needs a device in the map: parameters and persistent buffers, the names of ``state_dict``
    (accelerate 1.15 ``utils/modeling.py``, ``check_device_map``, called by ``dispatch_model`` on both paths).
    Non-persistent buffers (llama's ``rotary_emb.inv_freq``) may be left out: they stay as the model built them."""
    return is_param | persistent


def nested_keys(keys) -> list[tuple[str, str]]:
    """``(outer, inner)`` for every key under another key (``{"": "cpu", "lm_head": "disk"}``): both paths fail
    on them. accelerate 1.15 ``hooks.py``, ``attach_align_device_hook_on_blocks``: the outer key's hook
    (``AlignDevicesHook.init_hook``) moves every tensor below it, the inner key's offloaded ones included, and
    ``set_module_tensor_to_device`` raises for a tensor on meta without a value.

    >>> nested_keys(["", "lm_head", "model.layers", "model.layers.1", "model.layers10"])
    [('', 'lm_head'), ('', 'model.layers'), ('model.layers', 'model.layers.1'), ('', 'model.layers.1'), \
('', 'model.layers10')]
    """
    present = set(keys)
    found = []
    for key in keys:
        if not key:
            continue
        outer = key
        while outer:
            outer = outer.rpartition(".")[0]
            if outer in present:
                found.append((outer, key))
    return found


def loads_disk_only(loader: str, *, accelerate: tuple[int, ...] | None = None) -> bool:
    """Whether a map whose only device is ``"disk"`` loads. transformers: yes (5.24 ``modeling_utils.py``,
    ``_load_pretrained_model``: disk tensors are indexed into the checkpoint, ``accelerate_disk_offload``);
    accelerate 1.15: no (``utils/modeling.py``, ``load_state_dict`` opens the checkpoint with the map's one device,
    ``safe_open(..., device="disk")``: ``SafetensorError: device disk is invalid``); accelerate 1.16: yes (the same
    function reads a one-device ``"disk"`` map on the CPU first).

    >>> loads_disk_only("accelerate", accelerate=(1, 15)), loads_disk_only("accelerate", accelerate=(1, 16))
    (False, True)
    """
    return loader == "transformers" or accelerate_at_least((1, 16), accelerate)


def reads_disk_buffers(loader: str, offload_buffers: bool, *, accelerate: tuple[int, ...] | None = None) -> bool:
    """Whether persistent buffers mapped to disk get their checkpoint values. transformers: yes (5.24
    ``integrations/accelerate.py``, ``get_device(valid_torch_device=True)`` loads ``"disk"`` buffers to ``"cpu"``);
    accelerate 1.15: only with ``offload_buffers=True`` (``utils/modeling.py``, ``load_checkpoint_in_model`` skips a
    disk tensor ``if not offload_buffers and param_name in buffer_names``: it keeps its ``__init__`` values);
    accelerate 1.16: yes (the same function loads such a buffer to ``"cpu"``: "Buffers stay in memory unless
    ``offload_buffers=True``, so they still need their value").

    >>> reads_disk_buffers("accelerate", False, accelerate=(1, 15)), reads_disk_buffers("accelerate", False,
    ...                                                                                  accelerate=(1, 16))
    (False, True)
    """
    return loader == "transformers" or offload_buffers or accelerate_at_least((1, 16), accelerate)


def tie_loads(loader: str, devices, other_disk_weights: bool) -> bool:
    """Whether a tie group whose names (the name the checkpoint stores first) are mapped to ``devices`` loads
    right; ``other_disk_weights``: the map sends other checkpoint tensors to disk.

    transformers (5.24 ``integrations/accelerate.py``, ``accelerate_disk_offload``): the disk index gets a tied name
    only when its source is on disk too, so the group must share one device, disk included (a split gives a
    ``KeyError`` or a tensor left on meta at the first forward). accelerate (1.15 ``utils/modeling.py``,
    ``load_checkpoint_in_model``, and ``big_modeling.py``, ``dispatch_model``): the checkpoint stores the tie once,
    so a group on disk misses its other names (``KeyError``); ``dispatch_model`` writes the disk modules itself,
    a copy of a tie included, only when the loader wrote no disk index: the stored name in RAM and the rest on disk
    loads when nothing else goes to disk.

    >>> tie_loads("transformers", ["disk", "disk"], False), tie_loads("accelerate", ["disk", "disk"], False)
    (True, False)
    >>> tie_loads("accelerate", ["cpu", "disk"], False), tie_loads("accelerate", ["cpu", "disk"], True)
    (True, False)
    """
    used = set(devices)
    if loader == "transformers":
        return len(used) == 1
    if used == {"disk"}:
        return False
    if len(used) == 1:
        return True
    return used == {"cpu", "disk"} and devices[0] == "cpu" and not other_disk_weights


def loads_from_disk(loader: str, is_param: bool, persistent: bool, tied: bool, offload_buffers: bool, *,
                    accelerate: tuple[int, ...] | None = None) -> bool:
    """Whether a tensor loads right when its whole tie group and module go to disk: the rules above for one tensor
    (:func:`reads_disk_buffers` for a persistent buffer, :func:`tie_loads` for a tied tensor), what a strategy may
    send to disk.

    >>> loads_from_disk("accelerate", False, True, False, False, accelerate=(1, 15))   # a persistent buffer
    False
    >>> loads_from_disk("accelerate", True, True, True, False), loads_from_disk("transformers", True, True, True, False)
    (False, True)
    """
    if loader == "transformers":
        return True
    if tied:
        return False
    return is_param or not persistent or reads_disk_buffers(loader, offload_buffers, accelerate=accelerate)


def device_objects(values) -> list:
    """The ``torch.device`` objects among a caller's map values, as written (before any normalisation), each once.

    >>> import torch
    >>> device_objects(["cpu", torch.device("cpu"), "disk", torch.device("cpu")])
    [device(type='cpu')]
    """
    found = []
    for value in values:
        if is_torch_device(value) and value not in found:
            found.append(value)
    return found


def loads_device_objects(loader: str, values) -> bool:
    """Whether a map whose values include ``torch.device`` objects loads, measured here with ``torch.device("cpu")``.

    accelerate: no (1.15 ``utils/modeling.py``, ``load_state_dict`` opens the checkpoint with ``safe_open(...,
    device=value)``, which takes strings and integers: ``SafetensorError: device device(type='cpu') is invalid``).
    transformers 5: yes, unless something is on disk and a ``torch.device`` is the main device that
    ``dispatch_model`` picks (``list(set(values) - {"cpu", "disk"})[0]``: ``"cpu"`` is the string only, so
    ``torch.device("cpu")`` beside ``"cpu"`` becomes the main device and hooks attach on the ``"cpu"`` modules, which
    works): the disk weights are then read with ``safe_open(..., device=main)`` (accelerate ``utils/offload.py``,
    ``OffloadedWeightsLoader``), the same error.

    >>> import torch
    >>> loads_device_objects("transformers", ["cpu", torch.device("cpu")])
    True
    >>> loads_device_objects("transformers", [torch.device("cpu"), "disk"]), loads_device_objects("accelerate", [0])
    (False, True)
    """
    found = device_objects(values)
    if not found:
        return True
    if loader == "accelerate":
        return False
    used = set(values)
    return "disk" not in used or not isinstance(main_device(used), type(found[0]))
