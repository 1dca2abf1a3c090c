"""The mixture-of-experts layers of a model, found from its structure: for each layer its router, its routed experts
(fused into 3D parameters, or a ``ModuleList`` of identical expert MLPs), its shared experts, the number of experts
``E``, the top-k and the bytes of one expert.

transformers 5 fuses a layer's experts into parameters whose leading dimension is the expert (``gate_up_proj
[E, 2I, H]``, ``down_proj [E, H, I]``, biases ``[E, X]``), in a module its ``use_experts_implementation`` decorator
dispatches through ``ExpertsInterface``; older code and other libraries keep a ``ModuleList`` of ``E`` identical
MLPs. Either way the layer's router is a sibling of the experts with a 2D weight ``[E, H]`` (a linear map from the
hidden size to one logit per expert). Names are never read: ``gate``, ``router``, ``experts``, ``shared_expert`` and
their spellings differ between families.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoELayer", "TOP_K_FIELDS", "find_experts", "top_k_of"]

TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk", "top_k",
                "n_activated_experts", "moe_top_k", "num_selected_experts")
"""Config fields that hold the number of experts each token is routed to, by family (the first one present wins)."""


@dataclass(frozen=True, slots=True)
class MoELayer:
    """One mixture-of-experts layer of a model.

    Attributes
    ----------
    block : str
        The module that holds the router and the experts (``model.layers.0.mlp``).
    experts : str
        The routed experts: the fused module (``kind="fused"``) or the ``ModuleList`` (``kind="list"``).
    router : str
        The module whose weight ``[E, H]`` scores the experts (the block itself where that weight is its own).
    shared : tuple of str
        The block's other children with parameters: shared experts and their gates, run for every token.
    kind : str
        ``"fused"`` or ``"list"``.
    num_experts : int
        ``E``.
    top_k : int or None
        Experts per token (the router's ``top_k``, else the config's); ``None`` where neither says.
    params : tuple of str
        ``"fused"``: the names of the experts module's parameters whose leading dimension is the expert;
        ``"list"``: the parameter names of one expert, relative to it.
    expert_bytes : int
        Bytes of one expert's parameters, in the dtypes the model holds them.
    common : tuple of str
        ``"fused"``: parameters of the experts module's children (a norm shared by the experts), not per expert.
    hidden : int
        The width of what an expert reads and writes (the router's input width where it is a dimension of the
        experts' weights, else their largest dimension).
    """

    block: str
    experts: str
    router: str
    shared: tuple[str, ...]
    kind: str
    num_experts: int
    top_k: int | None
    params: tuple[str, ...]
    expert_bytes: int
    common: tuple[str, ...] = ()
    hidden: int = 0

    def tensor_names(self, expert: int) -> tuple[str, ...]:
        """The full names of the parameters that hold ``expert`` (fused: the shared 3D tensors, sliced)."""
        if self.kind == "fused":
            return tuple(f"{self.experts}.{p}" for p in self.params)
        return tuple(f"{self.experts}.{expert}.{p}" for p in self.params)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _direct(module) -> list:
    return [(n, p) for n, p in module.named_parameters(recurse=False)]


def _fused_count(module) -> int | None:
    """``E`` where every direct parameter of ``module`` has the leading dimension ``E`` (at least 2) and two of them
    are 3D (an expert is at least two matrices: up and down); else ``None``. Its children may hold parameters (a
    norm after each expert)."""
    params = _direct(module)
    if not params or sum(p.dim() == 3 for _, p in params) < 2 or any(p.dim() < 2 for _, p in params):
        return None
    if any(p.dim() == 3 and min(p.shape[1:]) < 2 for _, p in params):   # a convolution's [C, 1, K], not matrices
        return None
    leading = {p.shape[0] for _, p in params}
    if len(leading) != 1 or next(iter(leading)) < 2:
        return None
    return int(next(iter(leading)))


def _list_count(module) -> int | None:
    """``E`` where ``module`` is a ``ModuleList`` of at least two modules of one class with equal parameter shapes."""
    import torch

    if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
        return None
    first = list(module)[0]
    shapes = [(n, tuple(p.shape)) for n, p in first.named_parameters()]
    if not shapes:
        return None
    for other in module:
        if type(other) is not type(first) or [(n, tuple(p.shape)) for n, p in other.named_parameters()] != shapes:
            return None
    return len(module)


def _hidden_sizes(module, kind: str) -> set[int]:
    """The dimensions of the experts' parameters other than the expert's own (one of them is the hidden size)."""
    if kind == "fused":
        return {int(d) for _, p in _direct(module) for d in p.shape[1:]}
    return {int(d) for p in list(module)[0].parameters() for d in p.shape}


def _router(block, experts_name: str, count: int, hidden: set[int], exact: bool = False) -> str | None:
    """The router of the block: the block itself where it holds a 2D parameter ``[E, H]`` (``H`` a dimension of the
    experts), else the child other than the experts whose parameters include the 2D one closest to ``[E, *]`` with
    ``E <= rows <= 2E`` (a router may score extra "zero" experts, or one more slot), ``[E, H]`` first; only
    ``[E, H]`` where ``exact`` (for a ``ModuleList``, which may be anything else)."""
    if any(p.dim() == 2 and p.shape[0] == count and int(p.shape[1]) in hidden for _, p in _direct(block)):
        return ""
    best, best_key = None, None
    for name, child in block.named_children():
        if name == experts_name:
            continue
        for _, p in child.named_parameters():
            if p.dim() != 2 or not count <= p.shape[0] <= 2 * count:
                continue
            if exact and (p.shape[0] != count or int(p.shape[1]) not in hidden):
                continue
            key = (int(p.shape[0]) - count, int(p.shape[1]) not in hidden)
            if best_key is None or key < best_key:
                best, best_key = name, key
    return best


def top_k_of(router_module, config) -> int | None:
    """The experts per token: the router's ``top_k`` attribute, else the config's (:data:`TOP_K_FIELDS`, on the
    text config of a multimodal model too)."""
    value = getattr(router_module, "top_k", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        configs.append(text())
    for c in configs:
        for field in TOP_K_FIELDS:
            value = getattr(c, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def find_experts(model) -> tuple[MoELayer, ...]:
    """Every mixture-of-experts layer of ``model``, in module order, found from its structure.

    A layer's routed experts are a module whose direct parameters share a leading dimension ``E`` (two of them 3D:
    transformers 5's fused experts) or a ``ModuleList`` of ``E`` identical modules; its router is a sibling (or
    the block itself) with a 2D parameter ``[E, H]``. Experts without such a router are not a mixture (a stack of
    layers is a ``ModuleList`` too). Works on the meta device; the model is not modified.

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    tuple of MoELayer

    Notes
    -----
    One walk over the modules, O(modules + parameters).

    Examples
    --------
    >>> import torch, torch.nn as nn
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gate = nn.Linear(8, 4, bias=False)
    ...         self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(4))
    >>> [(m.block, m.experts, m.router, m.kind, m.num_experts) for m in find_experts(nn.Sequential(Block()))]
    [('0', '0.experts', '0.gate', 'list', 4)]
    """
    found: list[MoELayer] = []
    inside: list[str] = []
    config = getattr(model, "config", None)
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        kind, count = "fused", _fused_count(module)
        if count is None:
            kind, count = "list", _list_count(module)
        if count is None or not name:
            continue
        parent_name, _, child = name.rpartition(".")
        block = model.get_submodule(parent_name)
        router = _router(block, child, count, _hidden_sizes(module, kind), exact=kind == "list")
        if router is None:
            continue
        router_module = block.get_submodule(router) if router else block
        shared = tuple(_join(parent_name, n) for n, c in block.named_children()
                       if n != child and n != router and any(True for _ in c.parameters()))
        if kind == "fused":
            params = tuple(n for n, _ in _direct(module))
            common = tuple(n for n, _ in module.named_parameters() if "." in n)
            nbytes = sum(p.numel() * p.element_size() for _, p in _direct(module)) // count
        else:
            params, common = tuple(n for n, _ in list(module)[0].named_parameters()), ()
            nbytes = sum(p.numel() * p.element_size() for p in list(module)[0].parameters())
        sizes = _hidden_sizes(module, kind)
        widths = [int(p.shape[1]) for p in router_module.parameters() if p.dim() == 2
                  and count <= p.shape[0] <= 2 * count and int(p.shape[1]) in sizes]
        found.append(MoELayer(block=parent_name, experts=name, router=_join(parent_name, router), shared=shared,
                              kind=kind, num_experts=count, top_k=top_k_of(router_module, config),
                              params=params, expert_bytes=int(nbytes), common=common,
                              hidden=widths[0] if widths else max(sizes)))
        inside.append(name)
    return tuple(found)

