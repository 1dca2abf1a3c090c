"""The dtype transformers' ``from_pretrained`` loads a model folder in, read from its files without loading weights.

transformers 5 defaults ``from_pretrained(dtype=...)`` to ``"auto"``, which ``modeling_utils._get_dtype`` resolves as:

1. the config's ``dtype`` (``torch_dtype`` in older files), when it names one;
2. else, for a sharded checkpoint, the ``"dtype"`` of its index's ``metadata``;
3. else the dtype of the first floating tensor (float8 and float4 skipped) of the first weights file, in key order
   (``safe_open(...).keys()`` is sorted; the shards of an index are sorted by file name).

:func:`load_dtype` follows these steps; safetensors headers are read, never the tensors. A folder without weights (a
bare ``config.json``) has no answer to step 3: transformers would have nothing to load, and ``from_config`` builds in
torch's default dtype, float32.

Some tensors do not take that dtype: a model's ``_keep_in_fp32_modules`` stay float32 when it loads in float16, its
``_keep_in_fp32_modules_strict`` in float16 and bfloat16 (``PreTrainedModel._get_dtype_plan``, matched against the
checkpoint's keys as ``core_model_loading`` does); :func:`kept_in_float32` names them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from ..errors import InvalidModel
from .safetensors import SAFETENSORS_DTYPES, safetensors_header

__all__ = ["kept_in_float32", "load_dtype", "safetensors_dtypes", "weights_files"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""File names ``from_pretrained`` looks for in a local folder, in its order (``modeling_utils``' constants)."""

def safetensors_dtypes(path: str) -> dict[str, str]:
    """Tensor name -> torch dtype name (``"bfloat16"``) of the safetensors file at ``path``, from its header alone.

    Only the header is read (:func:`allocator.model.safetensors.safetensors_header`). Codes torch has no name for keep
    their
    safetensors spelling (``"F4"``).

    Raises
    ------
    InvalidModel
        The file cannot be read or its header is not a safetensors header.
    """
    try:
        _, header = safetensors_header(path)
        return {name: SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"]) for name, info in header.items()}
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise InvalidModel(f"cannot read the safetensors header of {path}: {reason}; pass --dtype to say which dtype "
                           f"the model loads in.") from None


def weights_files(folder: str, config: Mapping | None = None) -> tuple[list[str], dict]:
    """(the weights files ``from_pretrained`` would read from ``folder``, in its order; the index's ``metadata``).

    ``config`` (the config.json as a dict) may name the file itself (``transformers_weights``). An empty list when
    the folder holds no weights file transformers looks for.
    """
    named = (config or {}).get("transformers_weights")
    candidates = [named] if isinstance(named, str) else [SAFE_WEIGHTS, SAFE_INDEX, *TORCH_WEIGHTS]
    for name in candidates:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".index.json"):
            return [path], {}
        try:
            with open(path) as fh:
                index = json.load(fh)
            shards = sorted(set(index["weight_map"].values()))
            metadata = index.get("metadata") or {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise InvalidModel(f"cannot read the checkpoint index {path}: {err}; pass --dtype to say which dtype the "
                               f"model loads in.") from None
        return [os.path.join(folder, s) for s in shards], metadata if isinstance(metadata, dict) else {}
    return [], {}


def load_dtype(source: str, config_dtype=None, config: Mapping | None = None) -> tuple[object, str]:
    """(the torch dtype ``from_pretrained(source)`` loads in by default, why) for a model folder or its config.json.

    ``config_dtype`` is the config's ``dtype`` as transformers read it (``PreTrainedConfig.dtype``); ``config`` the
    config.json as a dict, for ``transformers_weights``. A config.json path looks for weights beside it.

    Raises
    ------
    InvalidModel
        A weights file or index that cannot be read.

    Examples
    --------
    >>> import torch
    >>> load_dtype("no/such/folder", torch.bfloat16)
    (torch.bfloat16, "the config's dtype, as from_pretrained loads it")
    """
    import torch

    if config_dtype is not None:
        return _torch_dtype(config_dtype), "the config's dtype, as from_pretrained loads it"
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    files, metadata = weights_files(folder, config)
    if isinstance(metadata.get("dtype"), str) and isinstance(getattr(torch, metadata["dtype"], None), torch.dtype):
        return getattr(torch, metadata["dtype"]), ("the dtype in the checkpoint index's metadata (the config names "
                                                   "none), as from_pretrained loads it")
    if not files:
        return torch.float32, ("the config names no dtype and no weights are beside it: float32, torch's default, as "
                               "from_config builds it")
    first = files[0]
    name = os.path.basename(first)
    if not first.endswith(".safetensors"):
        return torch.float32, (f"the config names no dtype and {name} is not read (only safetensors headers are): "
                               f"float32, torch's default; from_pretrained would take its first floating tensor's")
    if not os.path.isfile(first):
        raise InvalidModel(f"the checkpoint index in {folder} names {name}, which is missing; pass --dtype to say "
                           f"which dtype the model loads in.")
    dtypes = safetensors_dtypes(first)
    floating = [d for _, d in sorted(dtypes.items())
                if d in ("float64", "float32", "float16", "bfloat16")]  # float8/float4 skipped, as transformers does
    if floating:
        return getattr(torch, floating[0]), (f"the dtype of the weights in {name} (the config names none), as "
                                             f"from_pretrained loads it")
    found = [d for _, d in sorted(dtypes.items())]
    if not found:
        return torch.float32, f"the config names no dtype and {name} holds no tensors: float32, torch's default"
    dtype = getattr(torch, found[0], None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidModel(f"the first tensor of {name} has dtype {found[0]}, which torch cannot load; pass --dtype.")
    return dtype, f"the dtype of the first tensor in {name} (none is floating; the config names no dtype)"


def _torch_dtype(value):
    import torch

    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise InvalidModel(f"the config's dtype {value!r} is not a torch dtype; pass --dtype.")
    return found


def kept_in_float32(model, dtype) -> tuple[dict, list[str]]:
    """(tensor name -> float32 for every checkpoint tensor ``from_pretrained(dtype=dtype)`` keeps in float32, the
    patterns that matched), as ``special_dtypes`` for :func:`allocator.plan`.

    transformers' own ``model._get_dtype_plan(dtype)`` and ``build_glob_alternation`` decide, over the model's
    state-dict keys (what a checkpoint holds); nothing for a model without them.

    Examples
    --------
    >>> import torch, torch.nn as nn
    >>> kept_in_float32(nn.Linear(2, 2), torch.float16)
    ({}, [])
    """
    import torch

    get_plan = getattr(model, "_get_dtype_plan", None)
    if get_plan is None or dtype is None:
        return {}, []
    try:
        from transformers.core_model_loading import build_glob_alternation

        plan = get_plan(_torch_dtype(dtype))
    except (ImportError, AttributeError, TypeError, InvalidModel):  # an older transformers, or a dtype it rejects
        return {}, []
    if not plan:
        return {}, []
    pattern, group_to_glob, _ = build_glob_alternation(list(plan))
    kept, used = {}, set()
    for name in model.state_dict(keep_vars=True):
        found = pattern.search(name)
        if found is not None and plan[group_to_glob[found.lastgroup]] == torch.float32:
            kept[name] = torch.float32
            used.add(group_to_glob[found.lastgroup])
    return kept, sorted(used)
