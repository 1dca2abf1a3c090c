"""Model families: what a family of models adds to reading a model, behind one small interface.

After torchtitan's ``ModelSpec`` (``torchtitan/protocols/model_spec.py``): each family is a frozen
:class:`~allocator.model.families.family.Family` (a name, ``matches(model)``, and hooks for no-split discovery,
repeated blocks, routed experts, cache layers, declared ties and the loader), in a module of its own, and
:data:`FAMILIES` names them. The reader (:func:`allocator.model.build_graph`), the problem's builder and the
generation budget ask :func:`family_of` for the model's family and call its hooks; no caller tests a library's
classes itself.

- :mod:`~allocator.model.families.family`: the interface, :class:`Family`, its hooks' defaults;
- :mod:`~allocator.model.families.transformers`: ``PreTrainedModel`` (``loader="transformers"``);
- :mod:`~allocator.model.families.diffusers`: ``ModelMixin`` (no generation, ``loader="accelerate"``);
- :mod:`~allocator.model.families.plain`: any other ``torch.nn.Module`` (the defaults), asked last.

A new family is a :class:`Family` registered in :data:`FAMILIES` (here, or by the caller at run time)::

    FAMILIES["timm"] = Family("timm", matches=is_timm, no_split=timm_blocks)
"""

from __future__ import annotations

from .diffusers import DIFFUSERS
from .family import Family
from .plain import TORCH
from .transformers import TRANSFORMERS

__all__ = ["FAMILIES", "Family", "family_of"]

FAMILIES: dict[str, Family] = {
    "torch": TORCH,
    "transformers": TRANSFORMERS,
    "diffusers": DIFFUSERS,
}
"""Family name to :class:`Family`: the one place a family is registered (a stranger's too, by assigning a new key).
:func:`family_of` asks the families newest first, so a family registered later is asked before the built-in ones
(a family of some transformers models wins over ``"transformers"``), and ``"torch"``, which matches every model,
last."""


def family_of(model) -> Family:
    """The family of ``model``: the newest registered family in :data:`FAMILIES` whose ``matches(model)`` is true,
    else the one under ``"torch"`` (the defaults).

    Parameters
    ----------
    model : torch.nn.Module
        Only asked, never modified.

    Returns
    -------
    Family

    Notes
    -----
    O(families): each family's ``matches`` is called at most once.

    Examples
    --------
    >>> import torch.nn as nn
    >>> family_of(nn.Linear(2, 2)).name
    'torch'
    >>> FAMILIES["linear"] = Family("linear", matches=lambda m: isinstance(m, nn.Linear), no_split=lambda m, w: set())
    >>> family_of(nn.Linear(2, 2)).name, family_of(nn.ReLU()).name
    ('linear', 'torch')
    >>> del FAMILIES["linear"]
    """
    for name, family in reversed(FAMILIES.items()):
        if name != "torch" and family.matches(model):
            return family
    return FAMILIES.get("torch", TORCH)
