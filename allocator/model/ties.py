"""Tied tensors: the groups that must share one device, and the memory a declared tie shares.

Two kinds of tie (:attr:`~allocator.model.graph.ModelGraph.all_tie_groups` unites them):

- *shared*: one tensor object under several names, grouped as accelerate's ``find_tied_parameters`` groups them
  (:func:`find_tied`, :func:`shared_tied_groups`), or the caller's ``tied_parameters`` instead (:func:`given_ties`);
- *declared*: transformers' ``all_tied_weights_keys`` (target -> source), two objects until the weights are loaded
  and tied, one memory afterwards (:func:`declared_tied_groups`, :func:`declared_storage`).

Every function here takes names, indices and mappings: the module walk that finds them is
:mod:`allocator.model.read`'s.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Mapping, Sequence

from ..errors import InvalidOption

__all__ = ["given_ties", "find_tied", "shared_tied_groups", "declared_tied_keys", "declared_tied_groups",
           "declared_storage"]


def given_ties(tied_parameters: Sequence[Sequence[str]], index: Container[str]) -> list[tuple[str, ...]]:
    """The caller's ``tied_parameters`` as groups (groups of one name dropped); raises
    :class:`~allocator.errors.InvalidOption` for a name not in ``index``."""
    tied = []
    for group in tied_parameters:
        missing = [n for n in group if n not in index]
        if missing:
            raise InvalidOption(f"tied_parameters names unknown tensors {missing[:5]}.")
        if len(group) > 1:
            tied.append(tuple(group))
    return tied


def find_tied(all_params: list[tuple[str, Hashable]], unique: dict[str, Hashable]) -> list[tuple[str, ...]]:
    """accelerate's ``find_tied_parameters``, same grouping and the same group order (the tied names are visited in
    the iteration order of the same set, built the same way). Parameters are given by name and identity: a key
    equal for two names exactly when they are the same object (its ``id``, or its first tensor index).
    ``all_params`` is ``named_parameters(remove_duplicate=False)``, ``unique`` ``named_parameters()`` (each object
    under its first name)."""
    tied_names = {n for n, _ in all_params} - set(unique)
    if not tied_names:
        return []
    by_name = dict(all_params)
    first_name = {}
    for name, identity in unique.items():  # unique holds each object once: its first name
        first_name.setdefault(identity, name)
    groups: dict[str, list[str]] = {}
    for tied in tied_names:
        name = first_name.get(by_name[tied])
        if name is not None:
            groups.setdefault(name, []).append(tied)
    return [tuple(sorted([w] + list(set(t)))) for w, t in groups.items()]


def shared_tied_groups(names: Sequence[str], is_param: Sequence[bool],
                       canonical: Sequence[int]) -> list[tuple[str, ...]]:
    """:func:`find_tied` over the tensor columns of an exact walk (torch's generators would yield the same).

    ``named_parameters(remove_duplicate=False)`` is the walk's parameters in order; ``named_parameters()`` keeps the
    first name of each object (a module under a second path is skipped whole, and its parameters were all seen
    under the first). Two parameters are one object exactly when they have the same ``canonical``."""
    params = [k for k, param in enumerate(is_param) if param]
    unique = {names[k]: canonical[k] for k in params if canonical[k] == k}
    return find_tied([(names[k], canonical[k]) for k in params], unique)


def declared_tied_keys(model) -> Mapping | None:
    """A model's declared tied keys, target -> source: transformers' ``all_tied_weights_keys`` where the model carries
    it (read through wrappers that forward attributes, as PEFT's do), else ``None``.

    >>> import torch.nn as nn
    >>> declared_tied_keys(nn.Linear(2, 2)) is None
    True
    """
    return getattr(model, "all_tied_weights_keys", None)


def declared_tied_groups(declared, names: Container[str]) -> list[tuple[str, ...]]:
    """Groups from a model's declared tied keys (``declared``: transformers' ``all_tied_weights_keys``, target ->
    source; anything but a mapping declares nothing), over the pairs whose two names are in ``names``."""
    if not isinstance(declared, Mapping):
        return []
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for target, source in declared.items():
        if isinstance(target, str) and isinstance(source, str) and target in names and source in names:
            parent[find(target)] = find(source)
    groups: dict[str, list[str]] = {}
    for key in parent:
        groups.setdefault(find(key), []).append(key)
    return [tuple(sorted(g)) for g in groups.values() if len(g) > 1]


def declared_storage(declared, storage: Sequence[int], index: Mapping[str, int]) -> dict[int, int]:
    """Point each declared tie target (``declared``: transformers' ``all_tied_weights_keys``, target -> source) at
    its source's memory: tensor index -> index of the tensor whose memory it uses, for the targets whose ``storage``
    changes. transformers plans a device map before it ties weights, so the two are separate objects then, but they
    share memory once loaded."""
    if not isinstance(declared, Mapping):
        return {}
    moved: dict[int, int] = {}
    for target, source in declared.items():
        if target in index and source in index:
            root = moved.get(index[source], storage[index[source]])
            i = index[target]
            if moved.get(i, storage[i]) == i and root != i:
                moved[i] = root
    return moved
