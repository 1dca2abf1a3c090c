"""Planning speed: our greedy strategies against accelerate's ``infer_auto_device_map`` on very large module trees.

Two families of models, built on the meta device at about 1k, 10k, 20k, 50k and 200k modules:

- ``moe``: ``layers`` x (router + a ``ModuleList`` of many tiny two-``Linear`` experts), the layer class declared
  no-split (as transformers declares decoder layers);
- ``flat``: one ``nn.Sequential`` of tiny ``Linear`` layers.

The budget forces offload: GPU 0 gets 50 % of the model, the CPU the rest (``{0: total // 2, "cpu": total}``).
For each model it times, from one run:

- accelerate: ``accelerate.utils.infer_auto_device_map(model, max_memory, no_split_module_classes=...)``;
- ours, per strategy in ``sequential``, ``backfill``, ``reserve`` (the greedy family; not ``ilp``/``auto``):
  ``allocator.build_problem`` (the model read once), the strategy alone
  (``allocator.strategies.STRATEGIES[s](problem)`` on a problem just built, so that what the first evaluation of the
  graph costs, :class:`allocator.evaluate.runs.Columns`, counts), and the whole ``allocator.plan(model, budget,
  strategy=s)`` (build, strategy, validation, cost estimate), plus the peak Python memory of ``plan`` (``tracemalloc``).

Every timed call runs in a forked child with a time cap (``--cap``): a call past the cap is stopped and reported as
``> cap``; a larger size whose time extrapolated from the two previous sizes (power law) would exceed 1.5x the
cap is skipped and reported as such, with the extrapolated figure marked as an extrapolation. Fast calls are
repeated (median). Where a target is missed, ``cProfile`` of ``plan`` at ``--profile-size`` modules names the
functions that dominate. Writes ``planning_speed.csv`` and ``planning_speed.md`` into ``--out``.

    python benchmarks/planning_speed.py                  # 1k, 10k, 20k, 50k, 200k modules; cap 120 s
    python benchmarks/planning_speed.py --quick          # 1k, 10k, 20k; cap 60 s
    python benchmarks/planning_speed.py --sizes 1000     # smoke test
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import gc
import importlib.metadata
import io
import logging
import math
import multiprocessing
import os
import platform
import pstats
import statistics
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import torch
import torch.nn as nn

import allocator
from allocator.strategies import STRATEGIES

from benchutil import write_csv

OUT = Path(__file__).parent / "results"
SIZES = (1_000, 10_000, 20_000, 50_000, 200_000)
QUICK_SIZES = (1_000, 10_000, 20_000)
GREEDY = ("sequential", "backfill", "reserve")
FAMILIES = ("moe", "flat")
TARGET_SECONDS, TARGET_SIZE = 1.0, 200_000
TARGET_RATIO, TARGET_FROM = 5.0, 20_000


# --------------------------------------------------------------------------------------------------------------
# Models.

class TinyLinear(nn.Linear):
    """``nn.Linear`` without the initialisation, which on the meta device does nothing but takes 3/4 of the time."""

    def reset_parameters(self) -> None:
        pass


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = TinyLinear(8, 16)
        self.down = TinyLinear(16, 8)


class MoELayer(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.router = TinyLinear(8, experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))


class MoE(nn.Module):
    _no_split_modules = ["MoELayer"]

    def __init__(self, layers: int, experts: int):
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(experts) for _ in range(layers))


def build(family: str, modules: int) -> tuple[nn.Module, list[str] | None]:
    """A model of about ``modules`` modules on the meta device, and the no-split classes given to both planners."""
    with torch.device("meta"):
        if family == "moe":
            # Per layer: the layer, its router, the ModuleList and 3 modules per expert; layers ~ sqrt(modules / 24).
            layers = max(2, round(math.sqrt(modules / 24)))
            experts = max(1, ((modules - 2) // layers - 3) // 3)
            return MoE(layers, experts), ["MoELayer"]
        if family == "flat":
            return nn.Sequential(*(TinyLinear(8, 8) for _ in range(modules - 1))), None
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


# --------------------------------------------------------------------------------------------------------------
# Timing in forked children with a cap.

class Timeout(Exception):
    pass


def _child(fn, conn) -> None:
    # The parent's objects (the model) stay out of this process's garbage collections, as long-lived objects do in
    # a process of their own; otherwise the first full collection walks (and copies) the whole inherited heap.
    gc.freeze()
    try:
        conn.send(("ok", fn()))
    except BaseException as err:  # report, do not die silently
        conn.send(("error", f"{type(err).__name__}: {err}"))


def in_child(fn, timeout: float):
    """``fn()`` in a forked child (memory and time of its own); ``Timeout`` after ``timeout`` seconds."""
    ctx = multiprocessing.get_context("fork")
    conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, child_conn), daemon=True)
    proc.start()
    child_conn.close()
    try:
        if not conn.poll(timeout):
            raise Timeout
        status, value = conn.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    if status == "error":
        raise RuntimeError(value)
    return value


def timed(fn, *, min_total: float, max_repeats: int = 5, setup=None) -> tuple[float, int]:
    """Median seconds of ``fn()`` over repeats until ``min_total`` seconds have passed (at most ``max_repeats``).
    With ``setup``, each repeat times ``fn(setup())`` without the setup."""
    times = []
    while len(times) < max_repeats and (not times or sum(times) < min_total):
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def peak_python_memory(fn) -> int:
    """Peak bytes allocated by Python (``tracemalloc``) while ``fn()`` runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def traced_peak(fn, timing, cap: float):
    """``peak_python_memory(fn)`` in a child where ``fn`` took under a tenth of the cap (tracemalloc slows Python
    down several times); ``""`` otherwise or when it passes the cap."""
    if not timing or timing[0] * 10 >= cap:
        return ""
    try:
        return in_child(lambda: peak_python_memory(fn), cap)
    except Timeout:
        return ""


class Guard:
    """Per (family, measurement): stop after a timeout, skip sizes whose extrapolated time passes 1.5x the cap."""

    def __init__(self, cap: float):
        self.cap = cap
        self.history: dict[tuple, list[tuple[int, float]]] = {}
        self.stopped: dict[tuple, str] = {}

    def skip(self, key, modules: int) -> tuple[str, float | None] | None:
        """``(reason, extrapolated seconds or None)`` when the measurement should not be run."""
        if key in self.stopped:
            return self.stopped[key], None
        points = self.history.get(key, [])
        if len(points) >= 2:
            (n1, t1), (n2, t2) = points[-2:]
            exponent = max(1.0, math.log(max(t2, 1e-6) / max(t1, 1e-6)) / math.log(n2 / n1)) if n2 > n1 else 1.0
            guess = t2 * (modules / n2) ** exponent
            if guess > 1.5 * self.cap:
                return f"skipped: extrapolated {guess:.0f} s (n^{exponent:.2f} from {n1} and {n2} modules)", guess
        return None

    def record(self, key, modules: int, seconds: float | None) -> None:
        if seconds is None:
            self.stopped[key] = f"skipped: over the {self.cap:.0f} s cap at {modules} modules"
        else:
            self.history.setdefault(key, []).append((modules, seconds))


def measure_one(guard: Guard, key, modules: int, fn, *, timeout: float):
    """(value, status, extrapolated) of ``fn`` run in a child under the guard."""
    skip = guard.skip(key, modules)
    if skip:
        return None, skip[0], skip[1]
    try:
        value = in_child(fn, timeout)
    except Timeout:
        guard.record(key, modules, None)
        return None, f"> {timeout:.0f} s cap", None
    except RuntimeError as err:  # raised in the child: report it in the table
        return None, f"error: {str(err)[:100]}", None
    seconds = value[0] if isinstance(value, tuple) else value
    guard.record(key, modules, seconds)
    return value, "ok", None


# --------------------------------------------------------------------------------------------------------------
# The benchmark.

def measure(args) -> tuple[list[dict], dict]:
    rows, models = [], {}
    guard = Guard(args.cap)
    for family in args.families:
        for target in args.sizes:
            start = time.perf_counter()
            model, no_split = build(family, target)
            construction = time.perf_counter() - start
            modules = sum(1 for _ in model.modules())
            tensors = sum(1 for _ in model.parameters())
            total = allocator.build_problem(model, {"cpu": 0}, no_split_module_classes=no_split).graph.total
            budget = {0: total // 2, "cpu": total}
            models[family, target] = (model, no_split, budget, modules)
            # The floor of reading the model at all: one torch walk over every parameter (accelerate takes several).
            try:
                walk = in_child(lambda: timed(lambda: sum(1 for _ in model.named_parameters()), min_total=1.0)[0],
                                args.cap)
            except Timeout:
                walk = None
            base = dict(family=family, target_modules=target, modules=modules, tensors=tensors,
                        construction_s=f"{construction:.3f}", budget=str(budget),
                        named_parameters_s=f"{walk:.4f}" if walk is not None else "")

            def accelerate_call():
                import accelerate.utils

                return accelerate.utils.infer_auto_device_map(
                    model, copy.deepcopy(budget), no_split_module_classes=no_split)

            repeat = args.repeat_seconds
            acc, status, guess = measure_one(guard, (family, "accelerate"), modules,
                                             lambda: timed(accelerate_call, min_total=repeat), timeout=args.cap)
            acc_peak = traced_peak(accelerate_call, acc, args.cap)
            rows.append({**base, "method": "accelerate", "status": status, "build_problem_s": "", "strategy_s": "",
                         "plan_s": f"{acc[0]:.4f}" if acc else "", "repeats": acc[1] if acc else "",
                         "extrapolated_s": f"{guess:.1f}" if guess else "", "peak_python_bytes": acc_peak})

            build_call = lambda: allocator.build_problem(model, budget, no_split_module_classes=no_split)  # noqa: E731
            built, b_status, _ = measure_one(guard, (family, "build_problem"), modules,
                                             lambda: timed(build_call, min_total=repeat), timeout=args.cap)
            for strategy in args.strategies:
                plan_call = lambda s=strategy: allocator.plan(model, budget, strategy=s,  # noqa: E731
                                                               no_split_module_classes=no_split)
                strat = None
                s_status = b_status
                if built:  # on a problem just built, each time: what the graph's first evaluation costs counts
                    strat, s_status, _ = measure_one(guard, (family, strategy, "strategy"), modules,
                                                     lambda s=strategy: timed(lambda p: STRATEGIES[s](p),
                                                                              min_total=repeat, setup=build_call),
                                                     timeout=args.cap)
                plan, p_status, guess = measure_one(guard, (family, strategy, "plan"), modules,
                                                    lambda: timed(plan_call, min_total=repeat), timeout=args.cap)
                peak = traced_peak(plan_call, plan, args.cap)
                rows.append({**base, "method": strategy, "status": p_status if p_status != "ok" else s_status,
                             "build_problem_s": f"{built[0]:.4f}" if built else "",
                             "strategy_s": f"{strat[0]:.4f}" if strat else "",
                             "plan_s": f"{plan[0]:.4f}" if plan else "", "repeats": plan[1] if plan else "",
                             "extrapolated_s": f"{guess:.1f}" if guess else "", "peak_python_bytes": peak})
            done = [f"{r['method']} {r['plan_s'] or r['status']}" for r in rows
                    if r["modules"] == modules and r["family"] == family]
            print(f"{family} {modules} modules: {', '.join(done)}", file=sys.stderr, flush=True)
    for row in rows:
        row["accelerate_over_ours"] = _ratio(rows, row)
    return rows, models


def _ratio(rows, row) -> str:
    """accelerate's seconds / ours (``plan``) from the same run.

    ``>x`` where accelerate passed the cap at this size or a smaller one (a lower bound); ``~x`` where its time
    was extrapolated (an estimate).
    """
    if row["method"] == "accelerate" or not row["plan_s"]:
        return ""
    acc = next(r for r in rows if r["family"] == row["family"] and r["target_modules"] == row["target_modules"]
               and r["method"] == "accelerate")
    ours = float(row["plan_s"])
    if acc["plan_s"]:
        return f"{float(acc['plan_s']) / ours:.3f}"
    if acc["extrapolated_s"]:
        return f"~{float(acc['extrapolated_s']) / ours:.3f}"
    if "cap" in acc["status"]:
        cap = float(acc["status"].split(" s cap")[0].split()[-1])
        return f">{cap / ours:.3f}"
    return ""


# --------------------------------------------------------------------------------------------------------------
# Targets and profiles.

def targets(rows, strategies) -> list[tuple[str, str, bool | None, str]]:
    """(family, target, met or None when not measured, evidence) for the issue's targets, per strategy: seconds at
    200k modules (the strategy alone, and the whole plan) and the ratio to accelerate."""
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        for s in strategies:
            at = [r for r in mine if r["method"] == s and r["target_modules"] == TARGET_SIZE]
            # the strategy on a built problem, and the whole plan (which first reads the model: one walk of
            # named_parameters() alone is most of a second at 200k modules here)
            for what, column in (("strategy alone", "strategy_s"), ("plan", "plan_s")):
                name = f"{s} {what} ≤ {TARGET_SECONDS:g} s at {TARGET_SIZE // 1000}k"
                if not at:
                    out.append((family, name, None, "size not run"))
                    continue
                r = at[0]
                met = bool(r[column]) and float(r[column]) <= TARGET_SECONDS
                walk = r.get("named_parameters_s") if column == "plan_s" else ""
                walk = f" (one walk {float(walk):.2f} s)" if walk else ""
                out.append((family, name, met, f"{float(r[column]):.2f} s{walk}" if r[column] else r["status"]))
            big = [r for r in mine if r["method"] == s and r["target_modules"] >= TARGET_FROM]
            if not big:
                out.append((family, f"{s} plan ≥ {TARGET_RATIO:g}× accelerate from {TARGET_FROM // 1000}k", None,
                            "size not run"))
                continue
            evidence, met = [], True
            for r in big:
                ratio, size = r["accelerate_over_ours"], f"{r['target_modules'] // 1000}k"
                if not r["plan_s"]:
                    evidence.append(f"{size}: ours {r['status']}")
                    met = False
                    continue
                if not ratio or ratio[0] == "~":
                    extra = f" ({ratio}× extrapolated)" if ratio else ""
                    evidence.append(f"{size}: accelerate not measured{extra}")
                    met = None if met else met
                    continue
                evidence.append(f"{size}: {ratio}×")
                if float(ratio.lstrip(">")) < TARGET_RATIO:
                    met = (None if met else met) if ratio[0] == ">" else False
            out.append((family, f"{s} plan ≥ {TARGET_RATIO:g}× accelerate from {TARGET_FROM // 1000}k", met,
                        ", ".join(evidence)))
    return out


def profile(model, budget, no_split, strategy, top: int) -> dict:
    """cProfile of one ``allocator.plan``: its total seconds, the ``top`` functions by own time, and the ``top``
    functions of ``allocator`` by cumulative time, each as (name, calls, own s, cumulative s)."""
    prof = cProfile.Profile()
    prof.enable()
    allocator.plan(model, budget, strategy=strategy, no_split_module_classes=no_split)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    entries = [(f"{_short(filename)}:{line}({func})", nc, tt, ct)
               for (filename, line, func), (cc, nc, tt, ct, _) in stats.stats.items()]
    ours = [e for e in entries if e[0].startswith("allocator/") and not e[0].startswith("allocator/api.py")]
    return {"total": stats.total_tt, "own": sorted(entries, key=lambda e: e[2], reverse=True)[:top],
            "cumulative": sorted(ours, key=lambda e: e[3], reverse=True)[:top]}


def _short(filename: str) -> str:
    for marker in ("allocator/", "site-packages/"):
        if marker in filename:
            return filename[filename.index(marker) + (0 if marker == "allocator/" else len(marker)):]
    return filename if filename.startswith("~") else os.path.basename(filename)


def profiles(args, models, rows, results) -> dict:
    """Profiles of ``plan`` per family and strategy at ``--profile-size``, where a target is missed."""
    missed = {(fam, name.split()[0]) for fam, name, met, _ in results if met is False}
    out = {}
    for family, strategy in sorted(missed):
        model, no_split = build(family, args.profile_size)
        total = allocator.build_problem(model, {"cpu": 0}, no_split_module_classes=no_split).graph.total
        budget = {0: total // 2, "cpu": total}
        modules = sum(1 for _ in model.modules())
        try:
            out[family, strategy] = (modules, in_child(lambda: profile(model, budget, no_split, strategy, args.top),
                                                       3 * args.cap))
        except Timeout:
            out[family, strategy] = (modules, None)
        print(f"profiled {family} {strategy} at {modules} modules", file=sys.stderr, flush=True)
    return out


# --------------------------------------------------------------------------------------------------------------
# Report.

def _s(value: str, status: str) -> str:
    if value:
        v = float(value)
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return status.replace("skipped: ", "skip: ") if status and status != "ok" else "—"


def table(rows, family, strategies) -> str:
    by = {(r["target_modules"], r["method"]): r for r in rows if r["family"] == family}
    sizes = list(dict.fromkeys(r["target_modules"] for r in rows if r["family"] == family))
    head = ("| modules | one `named_parameters()` walk s | accelerate s | build_problem s | " + " | ".join(
        f"{s}: strategy s / plan s | acc / {s}" for s in strategies) + " | plan peak Python MiB (" +
        " / ".join(strategies) + ") | accelerate peak MiB |")
    lines = [head, "|" + "---|" * (6 + 2 * len(strategies))]
    for n in sizes:
        acc = by[n, "accelerate"]
        parts = [f"{acc['modules']:,}", _s(acc["named_parameters_s"], ""), _s(acc["plan_s"], acc["status"])]
        first = by[n, strategies[0]]
        parts.append(_s(first["build_problem_s"], first["status"] if not first["build_problem_s"] else ""))
        for s in strategies:
            r = by[n, s]
            parts.append(f"{_s(r['strategy_s'], '')} / **{_s(r['plan_s'], r['status'])}**")
            parts.append(f"{r['accelerate_over_ours']}×" if r["accelerate_over_ours"] else "—")
        parts.append(" / ".join(f"{int(by[n, s]['peak_python_bytes']) / 2**20:.0f}" if by[n, s]["peak_python_bytes"]
                                != "" else "—" for s in strategies))
        parts.append(f"{int(acc['peak_python_bytes']) / 2**20:.0f}" if acc["peak_python_bytes"] != "" else "—")
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def report(rows, results, profs, args, command, seconds) -> str:
    parts = [
        "# Planning speed: our greedy strategies vs accelerate's `infer_auto_device_map`\n",
        f"`{command}` — {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {seconds:.0f} s. "
        f"{platform.machine()}, "
        f"{os.cpu_count()} cores (shared, noisy), no accelerator; Python {platform.python_version()}, torch "
        f"{torch.__version__}, accelerate {importlib.metadata.version('accelerate')}.\n",
        f"Models on the meta device; budget `{{0: total // 2, 'cpu': total}}` (offload forced). *one walk*: "
        f"`for _ in model.named_parameters()` alone, the floor of any planner that reads the model (accelerate "
        f"walks it several times; we walk it once, reading its tables into columns). *build_problem*: "
        f"reading the model into a `Problem`; *strategy*: `STRATEGIES[s](problem)` alone; *plan* (bold): the whole "
        f"`allocator.plan(model, budget, strategy=s)` — build, strategy, validation and cost estimate — the time "
        f"compared with accelerate (*acc / s*: accelerate's seconds over ours, same run; `>x` is a lower bound where "
        f"accelerate passed the cap). Seconds are medians of up to 5 calls (repeated while under "
        f"{args.repeat_seconds:g} s in all). Cap {args.cap:.0f} s per call; "
        f"'skip: extrapolated' figures are extrapolations, not measurements. Peak Python memory: `tracemalloc` "
        f"during one call (the model itself excluded), measured where the call takes under a tenth of the cap.\n",
    ]
    for family in args.families:
        desc = {"moe": "ModuleList-of-experts MoE (layers ≈ √(modules/24), two-Linear experts; "
                       "`MoELayer` no-split)",
                "flat": "flat `nn.Sequential` of tiny `Linear` layers (nothing no-split)"}[family]
        parts += [f"## {family}: {desc}\n", table(rows, family, args.strategies), ""]
    parts += ["## Targets (reported, not asserted)\n", "| family | target | met | evidence |", "|---|---|---|---|"]
    for family, name, met, evidence in results:
        parts.append(f"| {family} | {name} | {'—' if met is None else 'yes' if met else '**no**'} | {evidence} |")
    if profs:
        parts += ["", "## Where our time goes (cProfile of one `allocator.plan` per family and strategy)\n",
                  f"Top {args.top} functions by own time, then the top {args.top} functions of `allocator` (its "
                  f"`api.py` wrappers left out) by cumulative time. Profiled at --profile-size modules, where a "
                  f"target above is missed.\n"]
        for (family, strategy), (modules, prof) in profs.items():
            if prof is None:
                parts += [f"**{family}, {strategy}, {modules:,} modules**: profile passed {3 * args.cap:.0f} s.\n"]
                continue
            total = prof["total"]
            parts += [f"**{family}, {strategy}, {modules:,} modules** — {total:.2f} s under the profiler\n"]
            for key, title in (("own", "own s"), ("cumulative", "cumulative s")):
                order = [2, 3] if key == "own" else [3, 2]
                parts += [f"| function | calls | {title} | % of plan | {'cumulative s' if key == 'own' else 'own s'} |",
                          "|---|---|---|---|---|"]
                parts += [f"| `{e[0]}` | {e[1]:,} | {e[order[0]]:.3f} | {100 * e[order[0]] / total:.0f}% | "
                          f"{e[order[1]]:.3f} |" for e in prof[key]]
                parts.append("")
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes 1k, 10k, 20k and a 60 s cap")
    parser.add_argument("--sizes", nargs="+", type=int, help="module counts (default 1k 10k 20k 50k 200k)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--strategies", nargs="+", choices=GREEDY, default=list(GREEDY))
    parser.add_argument("--cap", type=float, help="seconds allowed per timed call (default 120; 60 with --quick)")
    parser.add_argument("--repeat-seconds", type=float, default=1.0,
                        help="repeat a timed call until this many seconds have passed (at most 5 calls; median)")
    parser.add_argument("--profile-size", type=int, default=5_000, help="modules of the profiled models")
    parser.add_argument("--top", type=int, default=10, help="functions per profile")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    args.sizes = sorted(args.sizes or (QUICK_SIZES if args.quick else SIZES))
    args.cap = args.cap or (60.0 if args.quick else 120.0)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    command = " ".join(["python benchmarks/planning_speed.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.time()
    rows, models = measure(args)
    results = targets(rows, args.strategies)
    profs = profiles(args, models, rows, results)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "planning_speed.csv", rows)
    text = report(rows, results, profs, args, command, time.time() - start)
    (args.out / "planning_speed.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
