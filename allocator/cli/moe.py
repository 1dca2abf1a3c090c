"""What ``allocator plan --runtime allocator`` prints about the runtime the plan decided: its settings
(:attr:`allocator.Plan.runtime`), where the routed experts of each mixture-of-experts layer live
(:attr:`allocator.Plan.experts`, identical layers grouped), and where each part that runs for every token went
(attention, norms, routers, shared experts, embeddings, head). Rendered from the plan's data and the model's module
tree; nothing is planned again."""

from __future__ import annotations

from collections import Counter

from .render import align, format_size

__all__ = ["runtime_report", "expert_rows", "every_token_bytes", "group_label", "EVERY_TOKEN"]

EVERY_TOKEN = ("embeddings", "attention", "norms", "routers", "shared experts", "head", "other")
"""The every-token parts, in the order the report lists them; ``"other"`` is whatever else runs for every token
(dense MLPs of layers without experts, rotary tables, ...)."""


def runtime_report(plan, model) -> str:
    """The runtime section of ``allocator plan --runtime allocator``: one line of the runtime's settings, the table
    of routed experts per layer (where the model has mixture-of-experts layers), and the table of every-token
    parts per device."""
    runtime = plan.runtime
    buffers = runtime.buffers
    cache = (f"expert cache {runtime.expert_cache} slots ({format_size(buffers.get('expert_cache', 0))})"
             if runtime.expert_cache else "no expert cache")
    lines = [f"runtime allocator (allocator.offload, as patch(runtime='allocator') attaches it): main device "
             f"{runtime.main_device!r}, prefetch {runtime.prefetch}, {cache}",
             f"held on the main device beyond resident weights: streamed {format_size(buffers.get('streamed', 0))}, "
             f"prefetch {format_size(buffers.get('prefetch', 0))}, resident experts "
             f"{format_size(buffers.get('experts', 0))}, expert cache {format_size(buffers.get('expert_cache', 0))}"]
    if plan.problem.moe:
        lines += ["", *_experts_table(plan)]
    lines += ["", *_every_token_table(plan, model)]
    return "\n".join(lines)


def expert_rows(plan) -> list[tuple[str, tuple, bool]]:
    """Per mixture-of-experts layer of the plan's problem, in model order: the experts module's name, the device of
    each expert, and whether the plan places them one by one (:attr:`allocator.Plan.experts`) or the layer's experts
    stay whole with their module (then every expert is where the device map puts that module)."""
    devices = _node_devices(plan)
    index = plan.problem.graph.node_index
    rows = []
    for layer in plan.problem.moe:
        row = plan.experts.get(layer.experts)
        if row is not None:
            rows.append((layer.experts, tuple(row), True))
        else:
            rows.append((layer.experts, (devices[index[layer.experts]],) * layer.num_experts, False))
    return rows


def group_label(names: list[str]) -> str:
    """One label for the names of consecutive layers that differ in one number: ``model.layers.1-3,5.mlp.experts``;
    the first and last names joined otherwise.

    >>> group_label(["model.layers.1.mlp.experts", "model.layers.2.mlp.experts", "model.layers.3.mlp.experts"])
    'model.layers.1-3.mlp.experts'
    >>> group_label(["m.layers.1.e", "m.layers.3.e", "m.layers.4.e"]), group_label(["a.e"])
    ('m.layers.1,3-4.e', 'a.e')
    """
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    differ = {i for p in parts for i, x in enumerate(p) if len(p) != len(parts[0]) or x != parts[0][i]}
    if len({len(p) for p in parts}) != 1 or len(differ) != 1 or not all(p[min(differ)].isdigit() for p in parts):
        return f"{names[0]} .. {names[-1]}"
    at = min(differ)
    numbers = sorted(int(p[at]) for p in parts)
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return ".".join(parts[0][:at] + [text] + parts[0][at + 1:])


def _experts_table(plan) -> list[str]:
    """The routed experts per layer: one row per group of consecutive layers placed alike, one column per device
    (experts on the main device are the resident ones), and the totals."""
    problem, main = plan.problem, plan.runtime.main_device
    layers = {layer.experts: layer for layer in problem.moe}
    rows = expert_rows(plan)
    order = [d for d in problem.budgets.order if any(d in r for _, r, _ in rows)]
    groups: list[tuple[list[str], tuple]] = []
    for name, row, by_expert in rows:
        layer = layers[name]
        key = (layer.num_experts, layer.top_k, tuple(row.count(d) for d in order), by_expert)
        if groups and groups[-1][1] == key:
            groups[-1][0].append(name)
        else:
            groups.append(([name], key))
    head = ("MoE layers", "experts", "top-k", *(f"{d} (main: resident)" if d == main else str(d) for d in order),
            "placed")
    table = [head] + [(group_label(names), str(e), str(k or "?"), *map(str, counts),
                       "per expert" if by_expert else "whole module")
                      for names, (e, k, counts, by_expert) in groups]
    totals = Counter(d for _, r, _ in rows for d in r)
    table.append(("total", str(sum(len(r) for _, r, _ in rows)), "", *(str(totals[d]) for d in order), ""))
    sizes = sorted({layer.expert_bytes for layer in problem.moe})
    profile = problem.expert_profile
    source = ("uniform use: no expert profile" if profile is None else
              f"the expert profile, {profile.tokens:,} tokens")
    title = (f"routed experts: {len(rows)} mixture-of-experts layers, {format_size(sizes[0])}"
             f"{'' if len(sizes) == 1 else ' to ' + format_size(sizes[-1])} per expert; kept resident by expected "
             f"use per byte ({source})")
    return [title, *align(table)]


def _every_token_table(plan, model) -> list[str]:
    """Bytes of each every-token part per device, with the number of modules of that part."""
    found = every_token_bytes(plan, model)
    order = [d for d in plan.problem.budgets.order if any(d in per for per, _ in found.values())]
    rows = [("every-token part", "modules", *map(str, order))]
    for part in EVERY_TOKEN:
        if part in found:
            per, count = found[part]
            rows.append((part, str(count) if part != "other" else "-",
                         *(format_size(per[d]) if per.get(d) else "-" for d in order)))
    return ["every-token parts (they run for every token): bytes per device", *align(rows)]


def every_token_bytes(plan, model) -> dict[str, tuple[dict, int]]:
    """Each every-token part (:data:`EVERY_TOKEN`) that holds bytes -> (bytes per device, modules of that part).

    A module's part is its own where it is one (an embedding, a norm, an attention, a router or shared expert of a
    layer, the output embeddings), else its parent's; routed experts are left out. Tensors that share another's
    memory (tied weights) count once, where the first of them lives."""
    graph = plan.problem.graph
    nodes, tensors = graph.nodes, graph.tensors
    own = _own_parts(plan, model)
    devices = _node_devices(plan)
    part: list = [None] * len(nodes.name)
    per_part: dict[str, dict] = {}
    modules: Counter = Counter()
    for i, name in enumerate(nodes.name):
        parent = nodes.parent[i]
        mine = own.get(name) or _part_of_class(nodes.cls[i])
        part[i] = mine or (part[parent] if parent >= 0 else "other")
        if part[i] == "routed" or nodes.alias_of[i] >= 0:
            continue
        if mine is not None and graph.size[i]:
            modules[mine] += 1
        nbytes = sum(tensors.nbytes[k] for k in nodes.tensors_of(i) if tensors.storage[k] == k)
        if nbytes:
            per = per_part.setdefault(part[i], {})
            per[devices[i]] = per.get(devices[i], 0) + nbytes
    return {p: (per, modules[p]) for p, per in per_part.items()}


def _own_parts(plan, model) -> dict[str, str]:
    """Modules whose part the model says: the layers' routed experts, routers and shared experts, the input and
    output embeddings."""
    own: dict[str, str] = {}
    for layer in plan.problem.moe:
        own[layer.experts] = "routed"
        own.setdefault(layer.router, "routers")
        own.update((name, "shared experts") for name in layer.shared)
    names = {id(m): n for n, m in model.named_modules()}
    for getter, what in (("get_input_embeddings", "embeddings"), ("get_output_embeddings", "head")):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):   # not a transformers model, or one without that method
            module = None
        if module is not None and id(module) in names:
            own.setdefault(names[id(module)], what)
    return own


def _part_of_class(cls: str) -> str | None:
    if cls == "Embedding" or cls.endswith("Embedding") and "Rotary" not in cls:
        return "embeddings"
    if "Norm" in cls:
        return "norms"
    if "Attention" in cls or cls.endswith("Attn"):
        return "attention"
    return None


def _node_devices(plan) -> list:
    """The device of every node of the plan's graph: its own entry in the device map, else its parent's."""
    nodes, device_map = plan.problem.graph.nodes, plan.device_map
    out: list = [None] * len(nodes.name)
    for i, name in enumerate(nodes.name):
        parent = nodes.parent[i]
        out[i] = device_map.get(name, out[parent] if parent >= 0 else None)
    return out
