"""The KV cache's keyword in a forward, under the installed transformers.

transformers 5.25 renamed a forward's ``past_key_values=`` to ``cache=`` (``@deprecate_kwarg("past_key_values",
"5.40.0", new_name="cache")`` on the models' and layers' forwards: passing the old name warns with a
``FutureWarning`` and is removed in 5.40) and a model output's ``past_key_values`` field to ``cache`` (reading the old
attribute logs a deprecation once). Earlier 5.x releases know only ``past_key_values``. Our code passes, reads and
receives the cache through these helpers, so it neither warns under 5.25 nor breaks on 5.40 or on an earlier 5.x.

Examples
--------
>>> forward_cache({"cache": "c"}), forward_cache({"past_key_values": "p"}), forward_cache({})
('c', 'p', None)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

__all__ = ["CACHE_NAMES", "cache_keyword", "forward_cache", "output_cache"]

CACHE_NAMES = ("cache", "past_key_values", "past_key_value")
"""The names a forward's KV cache has had, newest first: ``cache`` (transformers >= 5.25), ``past_key_values``
(earlier 5.x, the models' forwards), ``past_key_value`` (older attention layers)."""


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its KV cache under: ``"cache"`` where its signature names it
    (transformers >= 5.25), else ``"past_key_values"``.

    >>> import torch.nn as nn
    >>> cache_keyword(nn.Linear(2, 2))
    'past_key_values'
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):   # a forward without a signature: the older name, which 5.x still accepts
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def forward_cache(kwargs: Mapping):
    """The KV cache a forward's keyword arguments carry, under any of :data:`CACHE_NAMES` (the first set), or
    ``None``."""
    for name in CACHE_NAMES:
        found = kwargs.get(name)
        if found is not None:
            return found
    return None


def output_cache(output):
    """The KV cache a model output carries: its ``cache`` field where the output class declares one (transformers >=
    5.25, read without the deprecation its ``past_key_values`` property logs), else ``past_key_values``; ``None``
    where it has neither."""
    fields = getattr(output, "__dataclass_fields__", {})
    if "cache" in fields:
        return getattr(output, "cache", None)
    return getattr(output, "past_key_values", None)
