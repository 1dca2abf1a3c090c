"""What a plan says about its runtime, per phase: where the routed experts live, how each experts layer's offloaded
experts run at prefill and decode, and where each offloaded unit computes (sentences of ``Plan.explain()``'s "why",
:func:`allocator.report.explain.reasons`)."""

from __future__ import annotations

from ..evaluate.compute import phase_tokens
from ..evaluate.experts import expert_bytes, layer_mode, routed_layers
from ..evaluate.validate import format_bytes
from .decisions import sentence

__all__ = ["compute_sentences", "expert_mode_sentences", "experts_sentence"]


def experts_sentence(plan, used: set) -> str | None:
    """Where the routed experts live (a plan for the allocator runtime on a mixture of experts), with the
    ``"experts"`` decision that placed them (marked as said)."""
    placed = plan.placement.experts
    if not placed:
        return None
    count: dict = {}
    for layer in plan.problem.moe:
        size = expert_bytes(plan.problem, layer)
        for device in placed.get(layer.experts, ()):
            n, b = count.get(device, (0, 0))
            count[device] = (n + 1, b + size)
    order = {d: i for i, d in enumerate(plan.problem.budgets.order)}
    where = ", ".join(f"{n} on {d!r} ({format_bytes(b)})" for d, (n, b) in sorted(count.items(),
                                                                                  key=lambda x: order.get(x[0], 99)))
    text = f"routed experts: {where}"
    for decision in plan.placement.of_kind("experts"):
        used.add(id(decision))
        text += f"; {sentence(decision)}"
    return text


def _span(units: list[str]) -> str:
    """``"model.layers.20-79"`` for consecutive numbered units of one parent, else the first and last names."""
    heads = {u.rpartition(".")[0] for u in units}
    tails = [u.rpartition(".")[2] for u in units]
    if len(heads) == 1 and all(t.isdigit() for t in tails):
        numbers = [int(t) for t in tails]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            head = heads.pop()
            return f"{head}.{numbers[0]}" if len(numbers) == 1 else f"{head}.{numbers[0]}\u2013{numbers[-1]}"
    return units[0] if len(units) == 1 else f"{len(units)} units from {units[0]} to {units[-1]}"


def expert_mode_sentences(plan) -> list[str]:
    """One sentence per phase and mode: the experts layers whose offloaded routed experts run that way
    (``Plan.runtime.expert_mode``), with the estimates of both modes summed over them
    (:func:`allocator.evaluate.experts.layer_mode`)."""
    modes = plan.runtime.expert_mode
    if not modes or not plan.runtime.streams:
        return []
    problem, placed = plan.problem, plan.placement.experts
    layers = {m.experts: m for m in routed_layers(problem, plan.device_map, placed)}
    out = []
    for phase, tokens in phase_tokens(problem).items():
        groups: dict = {}
        for name, row in modes.items():
            mode = row if isinstance(row, str) else row.get(phase)
            if name in layers and mode is not None:
                seconds = layer_mode(problem, layers[name], plan.device_map, placed.get(name), tokens)[1]
                n, f, c = groups.get(mode, (0, 0.0, 0.0))
                groups[mode] = (n + 1, f + seconds["fetch"], c + seconds["compute"])
        for mode, (n, f, c) in sorted(groups.items()):
            how = (f"fetched to {plan.main_device!r}" if mode == "fetch" else "computed where they live")
            out.append(f"at {phase} ({tokens} tokens per step) the offloaded routed experts of {n} experts layers are "
                       f"{how}: estimated {(f if mode == 'fetch' else c) * 1e3:.1f} ms per step against "
                       f"{(c if mode == 'fetch' else f) * 1e3:.1f} ms "
                       f"{'computed where they live' if mode == 'fetch' else 'fetched'}")
    return out


def compute_sentences(plan) -> list[str]:
    """One sentence per phase and group of consecutive offloaded units with the same compute device
    (:attr:`allocator.Plan.hybrid`, :class:`allocator.evaluate.compute.PhaseChoice`), with the profile's rates."""
    hybrid = plan.hybrid
    if hybrid is None:
        return []
    p = plan.problem.profile
    out = []
    for phase in hybrid.tokens:
        rows = [c for c in hybrid.choices if c.phase == phase]
        groups: list[list] = []
        for c in rows:
            if groups and groups[-1][-1].device == c.device and groups[-1][-1].source == c.source:
                groups[-1].append(c)
            else:
                groups.append([c])
        for group in groups:
            first = group[0]
            units = _span([c.unit for c in group])
            nbytes = format_bytes(sum(c.nbytes for c in group))
            here = sum(c.local_seconds for c in group)
            there = sum(c.streamed_seconds for c in group)
            read = p.disk_read if first.source == "disk" else p.cpu_memory
            where = "the memory-mapped file" if first.source == "disk" else "RAM"
            if first.device == "cpu":
                out.append(f"{units} compute on the CPU at {phase} ({first.tokens} tokens per step): {nbytes} read "
                           f"from {where} at ~{read / 1e9:.0f} GB/s instead of copied to {plan.main_device!r} at "
                           f"~{p.pinned_host_to_device / 1e9:.0f} GB/s after staging; estimated {here * 1e3:.1f} ms "
                           f"per step against {there * 1e3:.1f} ms streamed")
            else:
                out.append(f"{units} compute on {first.device!r} at {phase} ({first.tokens} tokens per step), "
                           f"weights streamed: {nbytes} copied, estimated {there * 1e3:.1f} ms per step against "
                           f"{here * 1e3:.1f} ms on the CPU")
    if hybrid.cache_moved:
        out.append(f"the KV cache of the units that decode on the CPU ({format_bytes(hybrid.cache_moved)}) lives in "
                   "RAM, counted in its peak")
    return out
