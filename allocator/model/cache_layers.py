"""The cache-layer classes of transformers' ``cache_utils``, each modelled or refused by name.

``generate`` fills a ``DynamicCache`` whose layers ``DynamicCache(config=...)`` builds from the config's layer types
(``transformers.cache_utils.get_layer_types_and_kwargs``, checked against transformers 5.25). Each class that can
appear there is either modelled (:data:`MODELLED`: what :mod:`allocator.model.generation` sizes it as) or refused
by name (:data:`REFUSED`: why, and what to do instead); a class in neither table, such as a model's own layer class
or one a newer transformers adds, is refused with a typed error naming it. ``tests/model/test_cache_layers.py``
enumerates the classes of the installed ``cache_utils`` and fails on one this module does not name.

Modelled kinds:

``"full"``
    ``DynamicLayer``: every token of the sequence.
``"sliding"``
    ``DynamicSlidingWindowLayer`` (sliding and chunked attention): the window, or the whole prompt right after the
    prefill.
``"shared"``
    ``DummyLayer``: a layer that stores nothing, exactly 0 bytes. transformers builds it for layers that reuse the
    keys and values of an earlier layer (Gemma-4 E-series, ``num_kv_shared_layers``: ``kv_sharing_modes`` is
    ``"reuse"``) and for layers without attention (layer types ``"moe"``, ``"mlp"``). The reused tensors are the
    earlier layer's, already counted there (Gemma-4 passes them along in ``shared_kv_states`` within one forward).
"""

from __future__ import annotations

import logging

from ..errors import InvalidOption, cause_line

__all__ = ["MODELLED", "REFUSED", "cache_layer_kinds"]

log = logging.getLogger(__name__)

#: The classes modelled, by name: their kind (see the module notes). Matched on the exact class, never a subclass:
#: the hybrid linear-attention layers subclass ``DynamicLayer`` but hold a recurrent state as well.
MODELLED: dict[str, str] = {
    "DynamicLayer": "full",
    "DynamicSlidingWindowLayer": "sliding",
    "DummyLayer": "shared",
}

_NO_GENERATION = "plan without generation= and keep that headroom on the devices yourself"
_STATIC = ("a static cache (generate(cache_implementation='static'), StaticCache) preallocates max_cache_len tokens "
           "per layer, which allocator does not model; generate with the default DynamicCache, or " + _NO_GENERATION)
_QUANTIZED = ("a quantized cache (generate(cache_implementation='quantized'), QuantizedCache) keeps most tokens in "
              "the quantizer's own format, whose size allocator does not model; plan for the unquantized "
              "DynamicCache (an upper bound), or " + _NO_GENERATION)
_LINEAR = ("a linear-attention or convolution layer keeps a recurrent state whose size allocator does not model; "
           + _NO_GENERATION)
_HYBRID = ("a hybrid layer keeps a recurrent state beside its keys and values, and allocator models only the keys "
           "and values; " + _NO_GENERATION)
_INDEXED = ("an indexed (dynamic sparse attention) layer keeps an indexer's keys beside its keys and values, which "
            "allocator does not model; " + _NO_GENERATION)
_ABSTRACT = "an abstract base class, never a cache layer itself; " + _NO_GENERATION

#: The classes refused, by name: why, and what to do instead (the text of the :class:`InvalidOption` raised).
REFUSED: dict[str, str] = {
    "CacheLayerMixin": _ABSTRACT,
    "LinearAttentionCacheLayerMixin": _ABSTRACT,
    "StaticLayer": _STATIC,
    "StaticSlidingWindowLayer": _STATIC,
    "StaticIndexedLayer": _STATIC,
    "BaseQuantizedLayer": _QUANTIZED,
    "QuantizedLayer": _QUANTIZED,
    "QuantoQuantizedLayer": _QUANTIZED,
    "HQQQuantizedLayer": _QUANTIZED,
    "Fp8QuantizedLayer": _QUANTIZED,
    "DynamicIndexedLayer": _INDEXED,
    "LinearAttentionLayer": _LINEAR,
    "LinearAttentionAndFullAttentionLayer": _HYBRID,
    "LinearAttentionAndSlidingWindowAttentionLayer": _HYBRID,
    "LinearAttentionAndStaticFullAttentionLayer": _HYBRID,
    "LinearAttentionAndStaticSlidingWindowAttentionLayer": _HYBRID,
}


def cache_layer_kinds(config, count: int) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per self-attention layer, as ``DynamicCache(config=...)`` builds them.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (its text config is read, as ``DynamicCache`` reads it).
    count : int
        Layers to return at least: layers past the cache's own are counted as full attention.

    Returns
    -------
    list of (str, int or None)
        ``("full", None)``, ``("sliding", window)`` or ``("shared", None)`` per layer index.

    Raises
    ------
    InvalidOption
        When a layer's class is not in :data:`MODELLED`: the reason from :data:`REFUSED`, or for a class neither
        table names, that it is unknown.

    Examples
    --------
    >>> from transformers import Gemma4TextConfig
    >>> config = Gemma4TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
    ...                           num_key_value_heads=1, head_dim=16, vocab_size=100, sliding_window=8,
    ...                           layer_types=["sliding_attention", "full_attention", "full_attention"],
    ...                           num_kv_shared_layers=1, vocab_size_per_layer_input=100)
    >>> cache_layer_kinds(config, 3)
    [('sliding', 8), ('full', None), ('shared', None)]
    """
    from transformers.cache_utils import DynamicCache

    try:
        layers = DynamicCache(config=config).layers
    except Exception as err:  # a config DynamicCache cannot read: count every layer as full (an upper bound)
        log.warning("DynamicCache(config=...) failed for %s (%s); counting every cache layer as full attention, "
                    "which over-counts sliding-window layers", type(config).__name__, cause_line(err))
        return [("full", None)] * count
    kinds: list[tuple[str, int | None]] = []
    for i, layer in enumerate(layers):
        name = type(layer).__name__
        kind = MODELLED.get(name) if type(layer).__module__ == "transformers.cache_utils" else None
        if kind is None:
            why = REFUSED.get(name) if type(layer).__module__ == "transformers.cache_utils" else None
            why = why or (f"a class allocator does not know (it models {', '.join(MODELLED)}); "
                                        + _NO_GENERATION)
            raise InvalidOption(f"cache layer {i} of {type(config).__name__} is a {name}: {why}.")
        kinds.append((kind, int(layer.sliding_window) if kind == "sliding" else None))
    return kinds + [("full", None)] * (count - len(kinds))
