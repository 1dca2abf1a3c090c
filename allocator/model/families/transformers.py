"""transformers' ``PreTrainedModel``: ``_no_split_modules`` per sub-model, ``all_tied_weights_keys`` tied after the
map is planned, the generation cache ``DynamicCache(config=...)`` builds, and ``from_pretrained``'s own loading rules
(``loader="transformers"``, :mod:`allocator.rules.loaders`).

The no-split, experts, cache and tie rules are the defaults of
:class:`~allocator.model.families.family.Family`: transformers made them the conventions other code follows.
"""

from __future__ import annotations

import sys

from .family import Family

__all__ = ["TRANSFORMERS", "is_pretrained"]


def is_pretrained(model) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``. Imports nothing: one exists only once
    ``transformers.modeling_utils`` is imported.

    >>> import torch.nn as nn
    >>> is_pretrained(nn.Linear(2, 2))
    False
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return base is not None and isinstance(model, base)


TRANSFORMERS = Family("transformers", matches=is_pretrained, loader="transformers")
"""transformers' models (``PreTrainedModel``)."""
