"""Where a decoder layer can be split under our runtime (issue #49): its attention side and its MLP side, found from
the model's structure.

accelerate's hooks run a layer on one device (the residual add meets tensors from two devices otherwise), so a
no-split module stays whole for them. Our runtime moves a part's activations itself, so under ``runtime="allocator"``
a no-split layer may be split in two parts, each on one device:

- the *near* side: the attention (the direct child whose ``forward`` takes the KV cache or the position
  embeddings), the norms and every other small child, and in a mixture of experts the router and the shared experts;
- the *far* side: the MLP (the direct child, other than the attention, that holds the most parameters, and at least
  as many as all the other children but the attention together), or in a mixture of experts the routed experts module
  (:func:`allocator.model.experts.find_experts`), which the plan already places per expert.

Names are never read: ``self_attn``, ``attention``, ``mlp``, ``feed_forward`` and their spellings differ between
families. A layer with tensors of its own (outside its children), more than one attention child, or no such MLP child
is not split.

Examples
--------
>>> from allocator.model import zoo
>>> found = find_splits(zoo.build("llama-8b"), {"LlamaDecoderLayer"})
>>> len(found), found[0].layer, found[0].far, found[0].near
(32, 'model.layers.0', 'model.layers.0.mlp', ('model.layers.0.self_attn', 'model.layers.0.input_layernorm', \
'model.layers.0.post_attention_layernorm'))
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass

from .cache_kwarg import CACHE_NAMES
from .experts import find_experts

__all__ = ["LayerSplit", "find_splits", "takes_attention_inputs"]

ATTENTION_INPUTS = (*CACHE_NAMES, "position_embeddings", "position_bias", "rotary_pos_emb")
"""Keywords of a ``forward`` that only an attention takes: the KV cache under each of its names, and the positions
a rotary or relative attention reads."""


@dataclass(frozen=True, slots=True)
class LayerSplit:
    """One decoder layer that can be split under our runtime.

    Attributes
    ----------
    layer : str
        The layer (a no-split module).
    attention : str
        Its attention child.
    near : tuple of str
        The children that compute with the attention, the attention first (norms, and in a mixture of experts the
        router and shared experts, named below the experts' block).
    far : str
        What can compute apart: the MLP child, or the routed experts module of a mixture-of-experts block.
    moe : bool
        Whether :attr:`far` is a routed experts module.
    """

    layer: str
    attention: str
    near: tuple[str, ...]
    far: str
    moe: bool = False

    @property
    def parts(self) -> tuple[str, ...]:
        """Every key a map writes for the split layer: :attr:`near`, then :attr:`far`."""
        return (*self.near, self.far)


def takes_attention_inputs(module) -> bool:
    """Whether ``module``'s ``forward`` takes the KV cache or position embeddings (:data:`ATTENTION_INPUTS`).

    >>> import torch.nn as nn
    >>> takes_attention_inputs(nn.Linear(2, 2))
    False
    """
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in ATTENTION_INPUTS)


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _split_of(name: str, layer, experts: dict) -> LayerSplit | None:
    """The split of the layer ``name``, or ``None``."""
    if any(True for _ in layer.parameters(recurse=False)) or any(True for _ in layer.buffers(recurse=False)):
        return None   # tensors of its own: a map cannot place them apart from its children
    children = [(n, c) for n, c in layer.named_children() if _params(c)]
    attention = [n for n, c in children if takes_attention_inputs(c)]
    if len(attention) != 1:
        return None
    rest = [(n, _params(c)) for n, c in children if n != attention[0]]
    if not rest:
        return None
    mlp, size = max(rest, key=lambda item: item[1])
    if size * 2 < sum(s for _, s in rest):   # not the bulk of what is left: no MLP to set apart
        return None
    prefix = f"{name}." if name else ""
    others = [f"{prefix}{n}" for n, _ in children if n not in (attention[0], mlp)]
    block = experts.get(f"{prefix}{mlp}")
    if block is None:
        return LayerSplit(name, f"{prefix}{attention[0]}", (f"{prefix}{attention[0]}", *others), f"{prefix}{mlp}")
    inside = [f"{block.block}.{n}" for n, c in layer.get_submodule(mlp).named_children()
              if _params(c) and f"{block.block}.{n}" != block.experts]
    if any(True for _ in layer.get_submodule(mlp).parameters(recurse=False)) or block.experts.count(".") != \
            block.block.count(".") + 1:
        return None   # the router's weight is the block's own, or the experts sit deeper: no key splits it
    return LayerSplit(name, f"{prefix}{attention[0]}", (f"{prefix}{attention[0]}", *others, *inside),
                      block.experts, moe=True)


def find_splits(model, no_split: Iterable[str]) -> tuple[LayerSplit, ...]:
    """The layers of ``model`` (instances of the ``no_split`` classes, outermost first) that can be split, in model
    order (module docstring).

    Notes
    -----
    O(modules x depth): one pass over the modules, the parameters of each layer's children counted once.
    """
    classes = set(no_split)
    experts = {layer.block: layer for layer in find_experts(model)}
    found, inside = [], []
    for name, module in model.named_modules():
        if inside and (name == inside[-1] or name.startswith(inside[-1] + ".")):
            continue
        if type(module).__name__ not in classes:
            continue
        inside.append(name)
        split = _split_of(name, module, experts)
        if split is not None:
            found.append(split)
    return tuple(found)
