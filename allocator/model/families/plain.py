"""The family of every ``torch.nn.Module`` that no other family claims: the default rules, nothing changed.

Its hooks are :class:`~allocator.model.families.family.Family`'s defaults: no-split classes declared by any
sub-model's ``_no_split_modules`` else the repeated blocks, routed experts found from structure, the generation cache
of a transformers config where the module carries one (a PEFT or other wrapper that forwards ``config``), and no
loader of its own (``plan(loader=...)`` says which loading path a map is for).
"""

from __future__ import annotations

from .family import Family

__all__ = ["TORCH"]


def is_module(model) -> bool:
    """Every model: the family every other one falls back to (:func:`~allocator.model.families.family_of` asks it
    last)."""
    return True


TORCH = Family("torch", matches=is_module)
"""Any ``torch.nn.Module``."""
