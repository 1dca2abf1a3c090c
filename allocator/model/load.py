"""Build a model on the meta device from what a user points at: a model folder, a ``config.json``, or a built-in
example of :mod:`allocator.model.zoo`; nothing is downloaded and no weights are read.

:func:`load_model` returns a :class:`LoadedModel`: the model, where it came from, the dtype ``from_pretrained``
would load it in and why, and how its ``quantization_config`` stores the weights.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Mapping

from ..errors import InvalidModel, one_line
from . import zoo
from .checkpoint import load_dtype
from .quantization import quantized_sizes
from .zoo import move_strays_to_meta, quiet_transformers

__all__ = ["LoadedModel", "load_model", "did_you_mean"]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model built on the meta device, with where it came from."""

    model: object
    source: str
    """What was built, for the report: ``"t5-base (built-in example: ...)"`` or ``"LlamaForCausalLM from DIR"``."""
    dtype: object = None
    """The dtype ``from_pretrained`` would load the model in by default (:func:`allocator.model.checkpoint.load_dtype`;
    a built-in example's published dtype, :func:`allocator.model.zoo.dtype`), used when ``--dtype`` is not given."""
    dtype_reason: str = ""
    """Why that dtype: ``"the config's dtype, as from_pretrained loads it"``."""
    quantization: object = None
    """How the config's ``quantization_config`` stores the weights
    (:class:`allocator.model.quantization.QuantizedSizes`),
    or ``None`` for an unquantized model."""


def load_model(source: str, *, trust_remote_code: bool = False) -> LoadedModel:
    """Build ``source`` on the meta device: a folder with ``config.json``, a config file, or a built-in example.

    A path that exists wins over an example of the same name. The class is the first of ``config.architectures``
    that transformers defines, else ``transformers.AutoModel``. Nothing is downloaded. A config whose ``auto_map``
    names code of its own is built with that code only with ``trust_remote_code`` (passed to transformers, so it
    never asks on the terminal); without it, transformers' own classes are used where it has them.

    Raises
    ------
    InvalidModel
        No such folder, file or example; no ``config.json`` in the folder; transformers cannot read the config
        or build the model from it; or the config needs its own code and ``trust_remote_code`` is not set.
    """
    if os.path.exists(source):
        return _from_config(source, trust_remote_code)
    if source in zoo.ZOO:
        import torch

        entry = zoo.ZOO[source]
        return LoadedModel(zoo.build(source), f"{source} (built-in example: {entry.description})",
                           getattr(torch, zoo.dtype(source)),
                           "the published checkpoint's dtype, as from_pretrained loads it")
    hint = (" This command never downloads: fetch the config first, e.g. "
            f"'hf download {source} config.json --local-dir DIR', and pass DIR.") if _HUB_ID.match(source) else ""
    raise InvalidModel(f"{source!r} is neither a model folder, a config.json, nor a built-in example "
                       f"(see 'allocator plan --list').{did_you_mean(source)}{hint}")


def did_you_mean(name: str) -> str:
    """`` Did you mean 'llama-8b'?`` for a name close to built-in examples (difflib), else ``""``.

    >>> did_you_mean("llama8b")
    " Did you mean 'llama-8b'?"
    >>> did_you_mean("./my-model")
    ''
    """
    lowered = {n.lower(): n for n in zoo.ZOO}
    close = difflib.get_close_matches(name.lower(), lowered, n=1, cutoff=0.6)
    return f" Did you mean {lowered[close[0]]!r}?" if close else ""


def _config_json(path: str) -> dict:
    """The config at ``path`` (folder or file) as a dict; ``{}`` when unreadable (transformers then says why)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as fh:
            data = json.load(fh)
    except (OSError, ValueError):  # unreadable or not JSON: transformers says so below
        return {}
    return data if isinstance(data, dict) else {}


def _is_config(data: dict) -> bool:
    """Whether a JSON object reads as a transformers config (it names a ``model_type`` or ``architectures``)."""
    return "model_type" in data or "architectures" in data


def _auto_map(path: str) -> dict:
    """The ``auto_map`` of the config at ``path`` (folder or file): auto class -> custom code; ``{}`` when none."""
    found = _config_json(path).get("auto_map")
    return found if isinstance(found, dict) else {}


def _custom_class(auto_map: Mapping, declared: list[str]):
    """The transformers auto class (``AutoModelForCausalLM``, ...) whose custom code is the declared architecture,
    else the first model auto class the map names, else ``AutoModel``."""
    import transformers

    models = [k for k in auto_map if k.startswith("AutoModel") and isinstance(getattr(transformers, k, None), type)]
    named = [k for k in models if isinstance(auto_map[k], str) and auto_map[k].rpartition(".")[2] in declared]
    return getattr(transformers, (named or models or ["AutoModel"])[0])


def _from_config(path: str, trust_remote_code: bool = False) -> LoadedModel:
    import torch

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise InvalidModel(f"folder {path} has no config.json; pass a model folder saved by save_pretrained, "
                           f"a config.json, or a built-in example.")
    if os.path.isfile(path) and os.path.basename(path) != "config.json" and not _is_config(_config_json(path)):
        folder = os.path.dirname(os.path.abspath(path))
        where = (f"pass the folder instead: {folder}" if os.path.isfile(os.path.join(folder, "config.json")) else
                 "pass the model folder that holds its config.json")
        raise InvalidModel(f"{path} is not a model config (a file of a model folder, such as its weights?); {where}.")
    try:
        import transformers
    except ImportError:
        raise InvalidModel("building a model from a config needs transformers: pip install 'allocator[hf]'.") from None
    auto_map = _auto_map(path)
    custom = bool(auto_map) and trust_remote_code
    where = path
    if custom and os.path.isfile(path):  # transformers finds the code beside config.json only given the folder
        if os.path.basename(path) != "config.json":
            raise InvalidModel(f"--trust-remote-code needs the model folder (its config.json and code), not {path}.")
        where = os.path.dirname(os.path.abspath(path))
    with quiet_transformers():
        try:
            config = transformers.AutoConfig.from_pretrained(where, local_files_only=True,
                                                             trust_remote_code=trust_remote_code)
        except Exception as err:  # a config's own checks raise anything (ZeroDivisionError for 0 heads, ...)
            if auto_map and not trust_remote_code and "trust_remote_code" in str(err):
                raise InvalidModel(
                    f"the config {path} needs its own code (auto_map: {', '.join(auto_map)}), which transformers "
                    f"runs only when asked: add --trust-remote-code if you trust the code in that folder.") from None
            raise InvalidModel(f"transformers cannot read the config {path}: "
                               f"{type(err).__name__}: {one_line(err)}") from None
        declared = list(getattr(config, "architectures", None) or [])
        cls = next((c for c in (getattr(transformers, name, None) for name in declared)
                    if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)), None)
        auto = _custom_class(auto_map, declared) if custom else None
        name = (f"{auto.__name__} with the folder's code" if auto else cls.__name__ if cls
                else f"AutoModel for {type(config).__name__}")
        try:
            with torch.device("meta"):
                if auto is not None:
                    model = auto.from_config(config, trust_remote_code=True)
                else:
                    model = cls(config) if cls else transformers.AutoModel.from_config(config)
        except Exception as err:  # anything the model's constructor raises is a config it cannot build
            raise InvalidModel(f"transformers cannot build {name} from {path}: "
                               f"{type(err).__name__}: {one_line(err)}") from None
    move_strays_to_meta(model)
    model.eval()
    # config.dtype: transformers >= 5 (reading the old torch_dtype alias logs a warning)
    dtype, why = load_dtype(path, getattr(config, "dtype", None), _config_json(path))
    with quiet_transformers():  # transformers' quantization config classes log about their defaults
        quantization = _quantization(model, config)
    if auto is not None:
        note = " (the folder's own code, --trust-remote-code)"
    elif cls:
        note = ""
    else:
        note = f" (config.architectures {'names no class transformers defines' if declared else 'is empty'})"
    if auto_map and not custom:
        note += (" (config.auto_map names custom code; built with transformers' own classes: add "
                 "--trust-remote-code to use the folder's code)")
    return LoadedModel(model, f"{type(model).__name__} from {path}{note}", dtype, why, quantization)


def _quantization(model, config):
    """The sizes under the config's ``quantization_config`` (where transformers' ``get_hf_quantizer`` looks: the
    config, else its text config), or ``None``.

    Raises
    ------
    InvalidOption
        A method whose storage is not modelled, or unknown (never a silent full-size plan).
    """
    found = getattr(config, "quantization_config", None)
    if found is None and hasattr(config, "get_text_config"):
        found = getattr(config.get_text_config(decoder=True), "quantization_config", None)
    return quantized_sizes(model, found) if found is not None else None
