"""The words of a strategy's decisions: each :class:`allocator.placement.Decision` said from its kind and fields.

Strategies and the judge record decisions as data (a kind, devices, units, bytes, what bound it, and the fields of
its kind in ``facts``, ``facts["reason"]`` naming the case); this module is where they become sentences, for
:meth:`allocator.Plan.explain`, :meth:`allocator.Plan.to_dict` and the command line. A decision that carries a
``text`` of its own (a caller's strategy, a plan saved before its kind had fields) is said as given.

Examples
--------
>>> from allocator.placement import Decision
>>> sentence(Decision("full", devices=(0,), units=("layers.3",), bytes=1024, bound="reserve"))
'0 full at layers.3 (1.00 KiB kept free for the largest layer, as accelerate does); next device'
>>> lines(Decision("assign", devices=("cpu",), units=("a", "b")))
['a -> cpu', 'b -> cpu']
"""

from __future__ import annotations

from collections.abc import Mapping

from ..budgets import format_bytes, format_ms
from ..placement import Decision, Placement

__all__ = ["balances", "follows_accelerate", "lines", "notes", "outcome", "ranking", "sentence"]

RANKINGS = {
    "measured": "the estimate decides (measured rates)",
    "latency": "the estimate decides",
    "bytes": "bytes on the fastest tier, then bytes streamed per forward, decide (no measured profile: the estimate "
             "only breaks ties)",
}
"""What ranked the candidates (:func:`allocator.judge.ranking.ranked_by`), in words."""

_LEAD = ("the accelerators together cannot hold the model in a contiguous split: reserve's plan keeps the most "
         "resident")


def ranking(name: str) -> str:
    """What ranked the candidates, in words (:data:`RANKINGS`; a name it does not know as it is)."""
    return RANKINGS.get(name, name)


def outcome(tried) -> str:
    """What became of one candidate of :func:`allocator.judge.ranking.best_valid` (a
    :class:`allocator.judge.ranking.Tried` or its :meth:`~allocator.judge.ranking.Tried.record`), as a predicate:
    ``""`` where it keeps every rule.

    >>> outcome({"name": "reserve", "outcome": "error", "detail": "InfeasiblePlacement"})
    'finds no plan (InfeasiblePlacement)'
    """
    record = tried if isinstance(tried, Mapping) else tried.record()
    kind, detail = record.get("outcome", ""), record.get("detail", "")
    if kind == "error":
        return f"finds no plan ({detail})"
    if kind == "invalid":
        return f"is invalid: it breaks a runtime rule ({detail})"
    if kind == "contract":
        if detail == "main":
            return (f"breaks the contract: it runs on {record.get('main')!r}, not on the first accelerator that "
                    f"admits a plan ({record.get('wanted')!r})")
        return "breaks the contract: it goes back to a lower accelerator index along the model"
    if kind == "short":
        return "keeps fewer bytes on the fastest tier than accelerate's map"
    return ""


def _against(seconds: float, other: float) -> str:
    """``"12.3 % faster than"``: how ``seconds`` compares with ``other``."""
    if other <= 0 or abs(seconds - other) <= 1e-12 + 1e-9 * other:
        return "as fast as"
    change = (other - seconds) / other
    percent = abs(change) * 100
    number = f"{percent:.1f}" if percent >= 0.1 else f"{percent:.2g}"
    return f"{number} % {'faster' if change > 0 else 'slower'} than"


def _choice(facts: Mapping) -> str:
    """The candidate ``auto`` kept, its estimate, the margin over accelerate's map (``sequential``) and over the
    runner-up, what became of the others, and what ranked them."""
    tried = list(facts.get("tried", ()))
    winner = facts.get("winner")
    chosen = next(t for t in tried if t["name"] == winner)
    why = {t["name"]: outcome(t) for t in tried}
    text = f"auto chose {winner}: estimated {format_ms(chosen['seconds'])} per forward"
    if why[winner]:
        text += f" (it {why[winner]}, and no candidate keeps as many)"
    base = facts.get("baseline", "sequential")   # accelerate's map among the candidates
    theirs = next((t for t in tried if t["name"] == base), None)
    if winner == base:
        text += ", accelerate's own map"
    elif theirs is not None and theirs["seconds"] is not None:
        text += (f", {_against(chosen['seconds'], theirs['seconds'])} accelerate's map ({base}, "
                 f"{format_ms(theirs['seconds'])})" + (f", which {why[base]}" if why[base] else ""))
    elif theirs is not None:
        text += f"; accelerate's map ({base}) {why[base]}"
    others = [t for t in tried if t["name"] not in (winner, base)]
    runner = next((t for t in others if t["name"] == facts.get("runner")), None)
    if runner is not None:
        name = runner["name"]
        if facts.get("same_rank"):
            text += f"; {name} ranks the same, and {winner} comes first on the ties (the order of the candidates)"
        elif _against(chosen["seconds"], runner["seconds"]) == "as fast as":
            text += (f"; {name} is estimated the same, and {winner} comes first on the ties (more bytes on the "
                     "fastest tier, fewer device changes, then the order of the candidates)")
        else:
            text += (f"; the runner-up, {name}, is estimated {format_ms(runner['seconds'])} ({winner} "
                     f"{_against(chosen['seconds'], runner['seconds'])} it)")
    rest = [f"{t['name']} {format_ms(t['seconds'])}" + (f" ({why[t['name']]})" if why[t["name"]] else "")
            if t.get("outcome", "") in ("", "short") else f"{t['name']} {why[t['name']]}"
            for t in others if runner is None or t is not runner]
    if rest:
        text += "; the others: " + ", ".join(rest)
    said = ranking(facts.get("ranking", ""))
    return text + (f"; {said}" if said else "")


def _kept(d: Decision) -> str:
    f = d.facts
    count, estimate = f["candidates"], d.bound == "estimate"
    kept = "its only candidate plan" if count == 1 else \
        f"{'the fastest' if estimate else 'the best'} of {count} candidate plans"
    if f.get("contract"):
        kept += " that keeps the contract" if count == 1 else " that keep the contract"
    if count > 1 and not estimate:
        kept += " by bytes on the fastest tier, then bytes streamed"
    return (f"{f['strategy']} kept {kept} (main device {f['main']!r}): "
            f"estimated {f['seconds'] * 1e3:.3f} ms per forward, {format_bytes(d.bytes)} on the fastest tier, "
            f"{f['changes']} device changes")


def _split(d: Decision) -> str:
    f, reason = d.facts, d.reason
    if reason == "contiguous":
        return (f"all {f['groups']} tie groups resident on the accelerators: contiguous split in model order"
                + (", the first accelerator as light as possible, the others balanced" if f.get("low_0") else
                   ", the largest peak / budget minimised"))
    if reason == "no-accelerator":
        return "no accelerator in the budgets: reserve's plan over cpu and disk"
    if reason == "one-accelerator":
        return f"{_LEAD}; main device {f['main']!r}, no other accelerator to balance with"
    if reason == "no-split-fits":
        return f"{_LEAD}; no contiguous split of its {f['groups']} resident groups fits: kept as is"
    if reason == "not-more-balanced":
        return f"{_LEAD}; re-splitting its resident groups is not more balanced: kept as is"
    if reason == "re-split":
        return (f"{_LEAD}; its {f['groups']} resident groups re-split contiguously over {list(d.devices)}, main "
                f"device {f['main']!r} charged {format_bytes(d.bytes)} for offloaded buffers and streaming")
    return _plain(d)


def _empty(d: Decision) -> str:
    f, reason, devices = d.facts, d.reason, list(d.devices)
    device = devices[0] if devices else None
    if reason == "kept-free":
        return (f"device {device!r} gets nothing: the other accelerators hold the rest of the model "
                "(balanced_low_0 keeps the first accelerator free for generate())")
    if reason == "fewer-groups":
        return (f"device {device!r} gets nothing: there are {f['groups']} tie groups for {f['accelerators']} "
                "accelerators")
    if reason == "unbalanced":
        return (f"device {device!r} gets nothing: no split that gives every accelerator a group is as balanced "
                "within the budgets (a budget is too small for the groups at its position)")
    why = {
        "cpu-main": "no plan with one of them as the main device fits, or none is estimated faster than running "
                    "everything from RAM",
        "before-main": "holding anything would make one of them the main device, which keeps room for the streaming "
                       f"reserve; the plan with {f.get('main')!r} as main keeps more resident",
        "after-main-unbalanced": "no contiguous split of the resident groups that gives them one is as balanced "
                                 "within the budgets",
        "after-main-reserve-fits": "reserve's plan fits before them",
    }.get(reason)
    return f"accelerators {devices} get nothing: {why}" if why else _plain(d)


def _peaks(d: Decision) -> str:
    said = ", ".join(f"{device!r} {format_bytes(peak)} of {format_bytes(limit)} ({peak / limit:.0%})" if limit else
                     f"{device!r} {format_bytes(peak)}" for device, peak, limit in d.facts.get("peaks", ()))
    return f"accelerator peaks: {said}"


def _solver(d: Decision) -> str:
    f = d.facts
    if d.reason == "coarsened":
        return f"coarsened: {f['merges']} merges of consecutive units to stay under {f['max_units']} groups"
    return (f"CP-SAT over {f['groups']} groups for main devices {f['mains']}: best main {d.devices[0]!r}, "
            f"estimated {f['seconds'] * 1e3:.6f} ms per forward, "
            f"{'proven optimal' if f.get('proven') else 'not proven optimal'}"
            + ("; no better plan than the warm start" if f.get("warm_start") else ""))


def _fallback(d: Decision) -> str:
    f = d.facts
    if d.reason == "contract":
        return (f"no {f['strategy']} plan keeps the contract (main device {f['main']!r}, accelerators in index order, "
                "at least accelerate's bytes on them): accelerate's own map is kept")
    if d.reason == "main":
        return (f"no {f['strategy']} plan has the contract's main device {f['main']!r}: the plan that proved it the "
                "first accelerator that admits a plan is kept")
    if d.reason == "infeasible":
        return (f"{f['error']} No valid plan exists, so accelerate's own map is returned, as device_map='auto' would "
                "return it: it breaks these budgets at runtime (Plan.valid is False, Plan.violations says how); "
                "pass strict=True to raise instead.")
    return _plain(d)


def _runtime(d: Decision) -> str:
    f = d.facts
    head = f"prefetch depth {f.get('prefetch')} (the plan tries depths up to {f.get('asked')})"
    why = {
        "cpu-main": "the main device is the CPU, where making weights ready ahead competes with the forward for "
                    "the same cores (pass a measured profile to plan with it)",
        "deepest": "the deepest that keeps as many bytes on the fastest tier, streaming no more, as the plan without "
                   "prefetch",
        "no-deeper": "every deeper prefetch keeps fewer bytes on the fastest tier or streams more than the plan "
                     "without it",
    }.get(d.reason)
    return f"{head}: {why}" if why else _plain(d)


def _full(d: Decision) -> str:
    return (f"{d.devices[0]} full at {d.units[0]} ({format_bytes(d.bytes or 0)} kept free for the largest layer, as "
            "accelerate does); next device")


def _assign(d: Decision) -> str:
    if d.facts.get("tied"):
        return f"{d.units[0]} -> {d.devices[0]} with {list(d.units[1:])}"
    return ""   # units placed one by one: :func:`lines` lists them


def _choice_of(d: Decision) -> str:
    return _choice(d.facts)


def _moved(f: Mapping) -> str:
    """Where the every-token parts the dense map offloaded went, said for the main device the plan has: an
    accelerator, or RAM where the CPU is the main device (no accelerator budget)."""
    count, to, main = f["moved"], list(f.get("moved_to", ())), f["main"]
    if not count:
        return "none of them offloaded"
    if to and all(d in ("cpu", "disk") for d in to):
        return f"{count} modules moved from disk to RAM ({to[0]!r}, the main device) before them"
    where = ", ".join(repr(d) for d in to) or repr(main)
    return f"{count} modules moved to the accelerator{'s' if len(to) > 1 else ''} {where} before them"


def _experts(d: Decision) -> str:
    f = d.facts
    if f.get("kept"):
        why = {
            "floor": f"apart from their layers the experts would leave {format_bytes(f.get('bytes', 0))} "
                     "fewer on the fastest tier than accelerate's map (the contract's floor)",
            "disk": f"apart from their layers the experts would put {format_bytes(f.get('bytes', 0))} on disk against "
                    f"{format_bytes(f.get('dense_bytes', 0))} with the experts in their layers (the whole experts "
                    "modules leave the accelerators, and RAM holds fewer of them than the accelerators did)",
            "fast": f"apart from their layers the experts would keep {format_bytes(f.get('bytes', 0))} fewer on the "
                    "fastest tier than with the experts in their layers",
            "slower": f"expert by expert is estimated slower per decoding step: {f.get('seconds', 0) * 1e3:.3f} ms "
                      f"against {f.get('dense_seconds', 0) * 1e3:.3f} ms with the experts in their layers",
            "no-map": "no map with the experts modules apart keeps every runtime rule",
            "rule": f"apart from their layers the experts break a runtime rule: {f.get('violation')}"
                    + (" (list-type experts, or experts sharing tensors, stream to the main device under accelerate's "
                       "hooks, so a layer kept on another accelerator keeps them; fused ones run for the layer's "
                       "device)" if f.get("rule") == "no-split" else ""),
        }.get(d.reason)
        return f"experts kept with their layers: {why}" if why else _plain(d)
    source = "the expert profile" if f["profiled"] else "uniform use (no expert profile)"
    on = ", ".join(f"{n} resident on {device!r} ({format_bytes(b)})" for device, b, n in f["held"])
    slots = f.get("cache_slots", 0)
    cache = (f", and {slots} slots ({format_bytes(f['cache_bytes'])}) for recently routed experts on {f['main']!r}"
             if slots else "")
    over = ("over the accelerators in index order, then RAM" if f["main"] not in ("cpu", "disk") else
            f"in the RAM left on the main device {f['main']!r}")
    others = (f"the others stay on {list(f['others'])} and the runtime fetches or computes them where they live when "
              "routed" if f["others"] else "none stays in its file")
    return (f"experts of {f['layers']} mixture-of-experts layers as units: attention, norms, routers and shared "
            f"experts first ({_moved(f)}), then {f['chosen']} of {f['total']} experts resident, most used per byte "
            f"by {source}, {over}: {on or 'none'}{cache}; {others}; estimated "
            f"{f['seconds'] * 1e3:.3f} ms per forward of {f['tokens']} tokens ({format_bytes(f['streamed'])} "
            f"streamed), against {f['dense_seconds'] * 1e3:.3f} ms ({format_bytes(f['dense_streamed'])}) with the "
            "experts in their layers")


def _plain(d: Decision) -> str:
    """A decision of a kind or case this module has no words for: its kind and fields."""
    parts = [f"{d.kind}"]
    if d.devices:
        parts.append(f"on {list(d.devices)}")
    if d.units:
        parts.append(f"units {list(d.units[:3])}" + (f" and {len(d.units) - 3} more" if len(d.units) > 3 else ""))
    if d.bytes is not None:
        parts.append(format_bytes(d.bytes))
    if d.bound:
        parts.append(f"bound by {d.bound}")
    return " ".join(parts)


def _grow(d: Decision) -> str:
    f = d.facts
    return (f"{f['groups']} offloaded group{'s' if f['groups'] != 1 else ''} ({format_bytes(d.bytes or 0)}, from "
            f"{d.units[0]!r}) moved onto {d.devices[0]!r}: the units left offloaded decode where their weights live, "
            f"with their KV cache in RAM, so its peak was {format_bytes(f['peak'])} with "
            f"{format_bytes(f['room'])} left that the plan's own rules let units use")


def _sublayer(d: Decision) -> str:
    f = d.facts
    whole = (f"the whole-layer plan: decode {format_ms(f['decode_whole'])}, prefill {format_ms(f['prefill_whole'])}, "
             f"{format_bytes(f['bytes_whole'])} of weights and KV cache on {d.devices[0]!r}")
    if f["reason"] == "none-fits":
        return (f"no decoder layer split at {f['context']} tokens: no attention side of an offloaded layer fits on "
                f"{d.devices[0]!r} beside {whole} ({f['tried']} tried)")
    if f["reason"] == "fewer-bytes":
        return (f"no decoder layer split at {f['context']} tokens: each of the {f['valid']} valid split plans keeps "
                f"fewer bytes on {d.devices[0]!r} than {whole}, or breaks the contract")
    split = (f"{f['layers']} layer{'s' if f['layers'] != 1 else ''} split ({f['moved']} attention side"
             f"{'s' if f['moved'] != 1 else ''} moved on, {f['demoted']} MLP{'s' if f['demoted'] != 1 else ''} moved "
             f"off): decode {format_ms(f['decode'])}, prefill {format_ms(f['prefill'])}, {format_bytes(f['bytes'])} "
             f"of weights and KV cache ({format_bytes(f['cache'])} of it cache, against "
             f"{format_bytes(f['cache_whole'])})")
    if f["reason"] == "slower":
        return (f"layers kept whole at {f['context']} tokens: the fastest split plan decodes no faster ({split}) than "
                f"{whole}; estimates")
    return (f"{split} on {d.devices[0]!r}, against {whole}: each split layer's attention reads its KV cache there at "
            f"decode, its MLP computes where its weights live; estimates")


_SAY = {"assign": _assign, "full": _full, "split": _split, "empty": _empty, "peaks": _peaks, "kept": _kept,
        "choice": _choice_of, "fallback": _fallback, "solver": _solver, "runtime": _runtime,
        "experts": _experts, "grow": _grow, "sublayer": _sublayer}


def sentence(decision: Decision) -> str:
    """The decision in one sentence: its own ``text`` where it carries one, else said from its kind and fields
    (``""`` for an ``"assign"`` of units placed one by one, which :func:`lines` lists)."""
    if decision.text:
        return decision.text
    say = _SAY.get(decision.kind)
    try:
        return _plain(decision) if say is None else say(decision)
    except (KeyError, IndexError, TypeError, StopIteration):   # a caller's decision without the fields of its kind
        return _plain(decision)


def lines(decision: Decision) -> list[str]:
    """The decision as ``explain()`` lists it: its sentence, or for an ``"assign"`` of units placed one by one a line
    per unit (``"name -> device"``)."""
    said = sentence(decision)
    if said or decision.kind != "assign":
        return [said]
    return [f"{unit} -> {decision.devices[0]}" for unit in decision.units]


def notes(placement: Placement) -> tuple[str, ...]:
    """A placement's decisions as sentences, in order (:func:`lines`)."""
    return tuple(line for decision in placement.decisions for line in lines(decision))


def follows_accelerate(placement: Placement) -> bool:
    """Whether accelerate's algorithm made the map (it records ``"assign"`` and ``"full"`` decisions): it keeps room
    for the largest layer and never returns to a device it has left."""
    return any(d.kind in ("assign", "full") for d in placement.decisions)


def balances(placement: Placement) -> bool:
    """Whether the map is a balanced split (a ``"split"`` decision whose ``facts["method"]`` is ``"balanced"``)."""
    return any(d.kind == "split" and d.facts.get("method") == "balanced" for d in placement.decisions)
