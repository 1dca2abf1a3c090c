"""How often the router of each mixture-of-experts layer picks each expert on the user's own data:
:func:`profile_experts` records it, :class:`ExpertProfile` holds it (saved and loaded as JSON), and
``plan(..., expert_profile=...)`` keeps the most used experts resident.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import InvalidModel, InvalidOption
from .families import family_of

__all__ = ["ExpertProfile", "profile_experts", "routed_indices"]

FORMAT = "allocator.expert_profile/1"


@dataclass(frozen=True)
class ExpertProfile:
    """Per-(layer, expert) routing counts: ``counts[experts module name][e]`` is how many token-slots the router sent
    to expert ``e`` (a token routed to ``k`` experts counts once for each); ``tokens`` the tokens seen.

    Examples
    --------
    >>> p = ExpertProfile({"model.layers.0.mlp.experts": (3, 1, 0, 0)}, tokens=2)
    >>> p.shares("model.layers.0.mlp.experts")
    (0.75, 0.25, 0.0, 0.0)
    >>> ExpertProfile.from_json(p.to_json()) == p
    True
    """

    counts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    tokens: int = 0

    def __post_init__(self):
        counts = {}
        for name, row in dict(self.counts).items():
            row = tuple(int(c) for c in row)
            if any(c < 0 for c in row):
                raise InvalidOption(f"expert profile counts must be non-negative; {name!r} has {row}.")
            counts[str(name)] = row
        object.__setattr__(self, "counts", counts)

    def shares(self, layer: str, experts: int | None = None) -> tuple[float, ...]:
        """Each expert's share of ``layer``'s routings; uniform where the layer was never routed or is unknown
        (``experts`` gives their number then)."""
        row = self.counts.get(layer)
        if row is None or not sum(row):
            n = len(row) if row else experts
            if not n:
                raise InvalidOption(f"the expert profile has no layer {layer!r}; pass experts= for a uniform share.")
            return tuple(1.0 / n for _ in range(n))
        total = sum(row)
        return tuple(c / total for c in row)

    def to_json(self) -> str:
        """The profile as JSON (:meth:`from_json` reads it back)."""
        return json.dumps({"format": FORMAT, "tokens": self.tokens, "counts": {k: list(v) for k, v in
                                                                               self.counts.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ExpertProfile:
        """The profile :meth:`to_json` wrote.

        Raises
        ------
        InvalidOption
            Not a profile this version wrote.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InvalidOption(f"not an expert profile (expected format {FORMAT!r}); make one with "
                                "allocator.profile_experts(model, batches).save(path).")
        return cls({k: tuple(v) for k, v in data["counts"].items()}, tokens=int(data.get("tokens", 0)))

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile to ``path`` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExpertProfile:
        """Read a profile :meth:`save` wrote."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


def routed_indices(args: tuple, kwargs: Mapping):
    """The router's choice as a fused experts module receives it: its integer tensor argument of shape
    ``[tokens, k]`` (``top_k_index``, ``router_indices``, ...), or ``None``."""
    for value in list(args) + list(kwargs.values()):
        if getattr(value, "dim", None) is not None and value.dim() == 2 and not value.is_floating_point():
            return value
    return None


def profile_experts(model, batches: Iterable) -> ExpertProfile:
    """Run ``model`` on ``batches`` and count, per mixture-of-experts layer, the tokens its router sends to each
    expert.

    Parameters
    ----------
    model : torch.nn.Module
        A model with mixture-of-experts layers (:func:`allocator.model.experts.find_experts`), loaded in any way.
        Its forward hooks are removed afterwards; nothing else changes.
    batches : iterable
        Inputs: a mapping is passed as keywords (``model(**batch)``), a tuple as positional arguments, anything
        else as the one argument.

    Returns
    -------
    ExpertProfile

    Raises
    ------
    InvalidModel
        The model has no mixture-of-experts layer.

    Examples
    --------
    >>> import torch, torch.nn as nn
    >>> class Experts(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = nn.Parameter(torch.ones(4, 8, 2)), nn.Parameter(torch.ones(4, 2, 8))
    ...     def forward(self, x, top_k_index, top_k_weights):
    ...         return x
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gate, self.experts = nn.Linear(2, 4, bias=False), Experts()
    ...     def forward(self, x):
    ...         w, i = self.gate(x).topk(2)
    ...         return self.experts(x, i, w)
    >>> torch.manual_seed(0) and None
    >>> profile = profile_experts(Block(), [torch.randn(5, 2)])
    >>> profile.tokens, sum(profile.counts["experts"])
    (5, 10)
    """
    import torch

    layers = family_of(model).experts(model)
    if not layers:
        raise InvalidModel(f"{type(model).__name__} has no mixture-of-experts layer (no experts module with a router); "
                           "there is nothing to profile.")
    counts = {layer.experts: [0] * layer.num_experts for layer in layers}
    seen: dict[str, int] = {}   # tokens each fused layer saw
    handles = []

    def fused(name):
        def hook(module, args, kwargs):
            chosen = routed_indices(args, kwargs)
            if chosen is not None:
                valid = chosen[(chosen >= 0) & (chosen < len(counts[name]))]
                for e, c in enumerate(torch.bincount(valid.flatten().cpu(), minlength=len(counts[name])).tolist()):
                    counts[name][e] += c
                seen[name] = seen.get(name, 0) + chosen.shape[0]
        return hook

    def listed(name, e):
        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            counts[name][e] += int(x.reshape(-1, x.shape[-1]).shape[0])
        return hook

    try:
        for layer in layers:
            module = model.get_submodule(layer.experts)
            if layer.kind == "fused":
                handles.append(module.register_forward_pre_hook(fused(layer.experts), with_kwargs=True))
            else:
                for e, expert in enumerate(module):
                    handles.append(expert.register_forward_pre_hook(listed(layer.experts, e), with_kwargs=True))
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, Mapping):
                    model(**batch)
                elif isinstance(batch, tuple):
                    model(*batch)
                else:
                    model(batch)
    finally:
        for h in handles:
            h.remove()
    first = layers[0]
    tokens = seen.get(first.experts, 0) if first.kind == "fused" else (
        sum(counts[first.experts]) // (first.top_k or 1))
    return ExpertProfile({k: tuple(v) for k, v in counts.items()}, tokens=tokens)
