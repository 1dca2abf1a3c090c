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

from ..errors import InvalidModel, cause_line, warn_caller
from . import zoo
from .checkpoint import load_dtype
from .quantization import quantized_sizes
from .zoo import move_strays_to_meta, quiet_transformers

__all__ = ["LoadedModel", "load_model", "did_you_mean", "SIZE_FIELDS", "missing_size_fields", "shape_of"]

SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_experts",
               "num_local_experts", "n_routed_experts", "moe_intermediate_size")
"""Config fields that set a model's size (transformers' common names; each model type's own name for them is read
from its config class's ``attribute_map``): a config.json without one is built at the class's default."""


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
    shape: str = ""
    """What the config builds, for a folder or a config (:func:`shape_of`): ``"16 layers, hidden 2048, 32/8 heads,
    vocab 128256, 1,235,814,400 parameters"``; ``""`` for a built-in example, whose ``source`` says it."""
    missing: tuple = ()
    """``(field, default)`` for each size field the config.json does not set (:func:`missing_size_fields`)."""


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
            raise InvalidModel(f"transformers cannot read the config {path}: {cause_line(err)}; fix its config.json "
                               "where that names a field, or give the folder of a model transformers knows.") from err
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
            raise InvalidModel(f"transformers cannot build {name} from {path}: {cause_line(err)}; fix the config's "
                               "fields it names.") from err
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
    missing = missing_size_fields(config, _config_json(path))
    if missing:
        warn_caller(f"{path}: config.json does not set "
                    + ", ".join(f"{name} (built with {type(config).__name__}'s default {value!r})"
                                for name, value in missing)
                    + "; the model is planned at that size: add the field(s) to config.json if the checkpoint differs.")
    return LoadedModel(model, f"{type(model).__name__} from {path}{note}", dtype, why, quantization,
                       shape_of(model), tuple(missing))


def _aliases(config_class, name: str) -> set[str]:
    """``name`` and every name ``config_class.attribute_map`` makes the same attribute."""
    mapping = getattr(config_class, "attribute_map", {}) or {}
    found = {name}
    while True:
        more = {mapping[n] for n in found if n in mapping} | {k for k, v in mapping.items() if v in found}
        if more <= found:
            return found
        found |= more


def _own_fields(config_class) -> set[str]:
    """The fields a config class takes (its dataclass fields, else its ``__init__`` parameters)."""
    import inspect

    fields = getattr(config_class, "__dataclass_fields__", None)
    if fields:
        return set(fields)
    try:
        return set(inspect.signature(config_class.__init__).parameters)
    except (TypeError, ValueError):
        return set()


def missing_size_fields(config, data: Mapping) -> list[tuple[str, object]]:
    """``(field, default)`` for each field of :data:`SIZE_FIELDS` that ``config``'s class takes (under the model
    type's own name) and ``data`` (its config.json) does not set, in the config and each sub-config (``text_config``,
    ...: read from its own object in the JSON, else from the top level, as composite configs accept both); the
    sub-config's fields are named ``text_config.num_hidden_layers``. Values are what transformers built instead.

    >>> from transformers import LlamaConfig
    >>> missing_size_fields(LlamaConfig(), {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    ...                                      "vocab_size": 100})
    [('num_hidden_layers', 32)]
    """
    out = []
    pairs = [("", config, data)]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            inner = data.get(key)
            pairs.append((f"{key}.", sub, inner if isinstance(inner, Mapping) else data))
    for prefix, cfg, given in pairs:
        own = _own_fields(type(cfg))
        seen = set()
        for name in SIZE_FIELDS:
            names = _aliases(type(cfg), name)
            field_names = sorted(names & own)
            if not field_names or field_names[0] in seen:
                continue
            seen.add(field_names[0])
            if not names & set(given):
                out.append((prefix + field_names[0], getattr(cfg, field_names[0], None)))
    return out


def shape_of(model) -> str:
    """What a model's (text) config builds, in words: layers, hidden size, heads (query/key-value), vocabulary,
    routed experts where it has them, and the parameters counted on the model
    (``"2 layers, hidden 64, 4/2 heads, vocab 1000, 202,048 parameters"``)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config

    def first(*names):
        for name in names:
            value = getattr(text, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    layers, hidden = first("num_hidden_layers", "num_layers", "n_layer"), first("hidden_size", "d_model", "n_embd")
    heads, kv = first("num_attention_heads", "num_heads", "n_head"), first("num_key_value_heads")
    vocab, experts = first("vocab_size"), first("num_experts", "num_local_experts", "n_routed_experts")
    words = [f"{layers} layers" if layers is not None else "",
             f"hidden {hidden}" if hidden is not None else "",
             (f"{heads}/{kv} heads" if kv not in (None, heads) else f"{heads} heads") if heads is not None else "",
             f"vocab {vocab}" if vocab is not None else "",
             f"{experts} experts" if experts else "",
             f"{sum(p.numel() for p in model.parameters()):,} parameters"]
    return ", ".join(w for w in words if w)


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
