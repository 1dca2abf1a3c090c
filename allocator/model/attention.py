"""The attention modules of a transformers model that fill a KV-cache layer, and how wide their keys and values are.

An attention module fills a cache layer when it has an integer ``layer_idx`` and key/value projections (separate,
such as llama's ``k_proj`` / ``v_proj``, fused, such as GPT-2's ``c_attn``, or one key projection whose output is
the values too, Gemma-4's ``attention_k_eq_v`` with ``v_proj = None``), sits under the model's
``get_decoder()`` and not in its encoder (:func:`cache_attentions`). :mod:`allocator.model.generation` sizes the
cache and the activations of ``generate`` from what this module finds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CROSS_NAMES", "FUSED_NAMES", "KEY_NAMES", "VALUE_NAMES", "CacheAttention", "cache_attentions",
           "first_positive_int", "in_features", "out_features", "projection"]

#: Attribute names of an attention module's key projection, its value projection, a fused query/key/value projection,
#: and the last name of a cross-attention module, across the transformers architectures read.
KEY_NAMES = ("k_proj", "k", "key", "k_lin", "to_k")
VALUE_NAMES = ("v_proj", "v", "value", "v_lin", "to_v")
FUSED_NAMES = ("qkv_proj", "c_attn", "query_key_value", "Wqkv", "qkv")
CROSS_NAMES = ("EncDecAttention", "encoder_attn", "crossattention", "cross_attn", "cross_attention")


def first_positive_int(*values):
    """The first of ``values`` that is a positive ``int`` (not a ``bool``), as an ``int``; ``None`` when none is.

    >>> first_positive_int(None, 0, True, 8, 4)
    8
    """
    return next((int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)


def projection(module, names):
    """``(name, child)`` for the first of ``names`` that is a child of ``module`` with a 2-D ``weight`` (a linear
    projection, ``nn.Linear`` or GPT-2's ``Conv1D``); ``(None, None)`` when none is."""
    for name in names:
        child = getattr(module, name, None)
        if child is not None and hasattr(child, "weight") and getattr(child.weight, "ndim", 0) == 2:
            return name, child
    return None, None


def out_features(linear) -> int:
    """Output width of a linear projection: its ``out_features``, else its weight's first dimension."""
    out = getattr(linear, "out_features", None)
    return int(out) if isinstance(out, int) else int(linear.weight.shape[0])


def in_features(linear) -> int:
    """Input width of a linear projection: its ``in_features``, else its weight's second dimension."""
    inp = getattr(linear, "in_features", None)
    return int(inp) if isinstance(inp, int) else int(linear.weight.shape[1])


@dataclass(frozen=True, slots=True)
class CacheAttention:
    """One attention module that fills a cache layer (found by :func:`cache_attentions`)."""

    name: str          # the module's qualified name
    index: int         # its ``layer_idx``
    cross: bool        # cross-attention of an encoder-decoder model (its cache holds the encoder's length)
    key_path: str      # the qualified names of its key and value projections (the same module when fused)
    value_path: str
    key_width: int     # elements per token of its cached keys and of its values (key/value heads × head dim)
    value_width: int
    key_module: object  # the key projection itself


def cache_attentions(model, config, encoder_decoder: bool, names: Mapping[int, str]) -> list[CacheAttention]:
    """Attention modules that fill a cache layer: an integer ``layer_idx`` and key/value projections, under
    ``get_decoder()`` (not a vision tower), not in the encoder, in model order.

    ``names`` maps ``id(module)`` to the module's first qualified name (a module reached under two names counts
    once); ``config`` gives the key/value heads of fused projections that do not say them.
    """
    prefixes = {}
    for role, getter in (("encoder", "get_encoder"), ("decoder", "get_decoder")):
        if (role == "decoder" or encoder_decoder) and callable(getattr(model, getter, None)):
            prefixes[role] = names.get(id(getattr(model, getter)()))
    found = []
    for name, module in model.named_modules():
        if names[id(module)] != name or not isinstance(getattr(module, "layer_idx", None), int):
            continue
        if prefixes.get("encoder") is not None and _under(name, prefixes["encoder"]):
            continue  # the encoder runs once and caches nothing
        if prefixes.get("decoder") is not None and not _under(name, prefixes["decoder"]):
            continue  # e.g. a vision tower beside the language model
        k_name, k = projection(module, KEY_NAMES)
        v_name, v = projection(module, VALUE_NAMES)
        if k is not None and v is None and any(getattr(module, n, 0) is None for n in VALUE_NAMES):
            v_name, v = k_name, k  # values from the key projection (Gemma-4's attention_k_eq_v), cached apart
        if k is not None and v is not None:
            widths = (out_features(k), out_features(v))
        else:
            k_name, k = projection(module, FUSED_NAMES)
            v_name = k_name
            width = _fused_kv_width(module, config) if k is not None else None
            if width is None:
                continue  # a block that carries layer_idx (its attention is found on its own), or no attention
            widths = (width, width)
        found.append(CacheAttention(name, module.layer_idx, encoder_decoder and _is_cross(name, module),
                                    f"{name}.{k_name}", f"{name}.{v_name}", *widths, k))
    return found


def _is_cross(name: str, module) -> bool:
    if getattr(module, "is_cross_attention", None) is True:
        return True
    if name.rpartition(".")[2] in CROSS_NAMES:
        return True
    return getattr(module, "is_causal", True) is False


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _fused_kv_width(module, config) -> int | None:
    """Key (= value) width of an attention module whose projections are fused: key/value heads × head dim, from the
    module's own attributes first (Falcon's ``num_kv_heads``), then its config; ``None`` when neither says."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = first_positive_int(getattr(module, "num_heads", None), getattr(text, "num_attention_heads", None))
    kv = first_positive_int(getattr(module, "num_key_value_heads", None), getattr(module, "num_kv_heads", None),
                            getattr(text, "num_key_value_heads", None), getattr(text, "num_kv_heads", None),
                            1 if getattr(text, "multi_query", False) is True else None, heads)
    hidden = getattr(text, "hidden_size", None)
    head_dim = first_positive_int(getattr(module, "head_dim", None), getattr(text, "head_dim", None),
                                  hidden // heads if isinstance(hidden, int) and heads else None)
    return kv * head_dim if kv and head_dim else None
