"""Where the two loading paths differ: transformers 5's ``from_pretrained`` and accelerate's
``load_checkpoint_and_dispatch``, each rule naming the code it follows."""

from __future__ import annotations

from .dispatch import device_objects, main_device
from .versions import accelerate_at_least

__all__ = ["LOADERS", "loads_disk_only", "reads_disk_buffers", "tie_loads", "loads_from_disk",
           "loads_device_objects"]

LOADERS = ("transformers", "accelerate")
"""The loading paths a map can be for (:attr:`allocator.PlanOptions.loader`): transformers 5's ``from_pretrained``,
which loads the weights itself and then calls ``dispatch_model``, and accelerate's ``load_checkpoint_and_dispatch``,
which loads them through ``load_checkpoint_in_model``. The loader rules below say where they differ."""


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
