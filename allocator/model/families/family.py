"""The one small interface a model family implements: :class:`Family`.

After torchtitan's ``protocols/model_spec.ModelSpec``: a frozen bundle of a name and the functions that say what is
particular to one family of models. Each hook defaults to the rule that holds for any ``torch.nn.Module`` (the
conventions transformers made common, read where a module carries them), so a family names only what it changes.
The reader and the problem's builder call the hooks of the model's family
(:func:`allocator.model.families.family_of`) and never test a library's classes themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...errors import InvalidOption
from ...rules.loaders import LOADERS
from ..blocks import infer_blocks
from ..cache_layers import cache_layer_kinds
from ..experts import MoELayer, find_experts
from ..no_split import Walked, discovered
from ..ties import declared_tied_keys

__all__ = ["Family"]


@dataclass(frozen=True, slots=True)
class Family:
    """What one family of models adds to reading a model: the hooks the package calls, each with a default.

    Attributes
    ----------
    name : str
        The family's name (its key in :data:`allocator.model.families.FAMILIES`).
    matches : callable
        ``matches(model) -> bool``: whether ``model`` belongs to the family. Cheap, and never imports a library
        (a model of a library's class exists only once the library is imported).
    no_split : callable
        ``no_split(model, walked) -> set of str``: the class names the model declares unsplittable, from the model
        or from what the reader's walk met (:class:`allocator.model.no_split.Walked`). Default: every sub-model's
        ``_no_split_modules``, united (:func:`allocator.model.no_split.discovered`).
    infer_no_split : callable
        ``infer_no_split(model) -> set of str``: the classes kept whole where nothing is declared (and
        ``infer_no_split=True``). Default: the repeated blocks (:func:`allocator.model.blocks.infer_blocks`).
    experts : callable
        ``experts(model) -> tuple of MoELayer``: the mixture-of-experts layers, read under ``runtime="allocator"``.
        Default: found from structure (:func:`allocator.model.experts.find_experts`).
    cache_layers : callable or None
        ``cache_layers(config, count) -> list of (kind, window)``: the generation cache's layers
        (:func:`allocator.model.cache_layers.cache_layer_kinds`, the default). ``None``: the family's models do not
        generate tokens, and a generation budget is refused with a typed error.
    tied_keys : callable
        ``tied_keys(model) -> mapping or None``: ties declared but not yet made (target -> source), counted as one
        memory. Default: ``all_tied_weights_keys`` where the model carries it
        (:func:`allocator.model.ties.declared_tied_keys`).
    loader : str or None
        The loading rules the family's own ``from_pretrained`` follows, one of
        :data:`allocator.rules.loaders.LOADERS`; ``None`` where it has no loader of its own (the caller's
        ``plan(loader=...)`` says).

    Raises
    ------
    InvalidOption
        A name that is not a non-empty string, a hook that is not callable, or an unknown loader.

    Examples
    --------
    A family that keeps every module whose class name ends in ``Stage`` whole, for models of a module ``mylib``:

    >>> family = Family("mylib", matches=lambda m: type(m).__module__.startswith("mylib."),
    ...                 no_split=lambda model, walked: {type(m).__name__ for m in model.modules()
    ...                                                 if type(m).__name__.endswith("Stage")})
    >>> family.loader is None, family.experts is Family("x", matches=bool).experts
    (True, True)
    """

    name: str
    matches: Callable[[object], bool]
    no_split: Callable[[object, Walked], set[str]] = discovered
    infer_no_split: Callable[[object], set[str]] = infer_blocks
    experts: Callable[[object], tuple[MoELayer, ...]] = find_experts
    cache_layers: Callable[[object, int], list[tuple[str, int | None]]] | None = cache_layer_kinds
    tied_keys: Callable[[object], Mapping | None] = declared_tied_keys
    loader: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidOption(f"a Family's name must be a non-empty str, got {self.name!r}.")
        hooks = {"matches": self.matches, "no_split": self.no_split, "infer_no_split": self.infer_no_split,
                 "experts": self.experts, "tied_keys": self.tied_keys}
        if self.cache_layers is not None:
            hooks["cache_layers"] = self.cache_layers
        for field_name, hook in hooks.items():
            if not callable(hook):
                raise InvalidOption(f"Family {self.name!r}: {field_name} must be callable, got "
                                    f"{type(hook).__name__}; pass a function (or leave it out for the default).")
        if self.loader is not None and self.loader not in LOADERS:
            raise InvalidOption(f"Family {self.name!r}: loader must be one of {list(LOADERS)} or None, got "
                                f"{self.loader!r}.")

    @property
    def generates(self) -> bool:
        """Whether the family's models generate tokens (it says how their cache layers are built)."""
        return self.cache_layers is not None
