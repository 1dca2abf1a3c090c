"""What accelerate's ``dispatch_model`` does with a map, rule by rule, as small functions of a map's devices and a
tensor's flags: the main device, the offloaded devices, the device of a name, what moves with an offloaded module,
where a module executes.

They import nothing of the package but the ``Device`` type, so every layer that evaluates maps
(:mod:`allocator.evaluate.runs`, :mod:`allocator.evaluate.memory`, :mod:`allocator.evaluate.validate`,
:mod:`allocator.evaluate.cost`, the strategies) can use them.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..budgets import Device, is_torch_device

__all__ = ["ambiguous_main_device", "hooks_attach", "main_device", "offloaded_devices", "device_of",
           "moves_with_weights", "moves", "executes_on", "must_cover", "nested_keys", "read_copy", "device_objects"]


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
    :class:`allocator.model.Tensors` columns, elementwise)."""
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


def executes_on(device: Device, main: Device, offloaded=None, hooks: bool = True, *,
                computes: Device | None = None) -> Device:
    """Where a module mapped to ``device`` runs: the main device when offloaded; ``mps`` for ``cpu`` modules when
    ``mps`` is main (they move there at dispatch); else its own device. The one statement of this rule: the memory
    model, the validator and the cost model all ask it.

    ``offloaded``: the map values streamed to ``main`` (:func:`offloaded_devices` of ``main`` where ``None``; empty
    where no hooks attach); ``hooks``: whether ``dispatch_model`` attaches hooks (:func:`hooks_attach`). ``computes``:
    under our runtime (``runtime="allocator"``), the device the plan's compute map runs an offloaded unit on in a
    phase (``Plan.compute``: the CPU, with the activations moved there), which wins over the main device.

    >>> executes_on("cpu", 0, {"cpu", "disk"}, True), executes_on(1, 0, {"cpu", "disk"}, True)
    (0, 1)
    >>> executes_on("disk", "cpu"), executes_on("cpu", "mps"), executes_on("cpu", 0, computes="cpu")
    ('cpu', 'mps', 'cpu')
    """
    if offloaded is None:
        offloaded = offloaded_devices(main)
    if device in offloaded:
        return main if computes is None else computes
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
