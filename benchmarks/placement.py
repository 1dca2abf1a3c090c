"""Placement benchmark: the zoo x budgets, accelerate and transformers against our strategies, on the meta device.

For every cell it records, per method: the share of the model resident on the fastest tier (accelerators, or RAM
when there are none), the estimated time per forward, whether the map is valid under accelerate's runtime rules
(``allocator.evaluate.validate``), the violations, the planning time (wall and CPU) and, for our strategies, whether the
plan is proven optimal (``Plan.optimal``; ``ilp``). Writes ``benchmarks/results/placement.csv``, ``placement.md`` and
``placement.png``.

    python benchmarks/placement.py           # all 41 architectures x 13 budgets
    python benchmarks/placement.py --quick   # 8 architectures
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import allocator
from allocator.model import zoo
from allocator.evaluate.cost import estimate
from allocator.evaluate.validate import check

from benchutil import write_csv

GRID = {
    "gpu15": {0: .15, "cpu": 2}, "gpu30": {0: .30, "cpu": 2}, "gpu50": {0: .50, "cpu": 2},
    "gpu60": {0: .60, "cpu": 2}, "gpu70": {0: .70, "cpu": 2}, "gpu90": {0: .90, "cpu": 2},
    "2gpu30": {0: .15, 1: .15, "cpu": 2}, "2gpu60": {0: .30, 1: .30, "cpu": 2}, "2gpu90": {0: .45, 1: .45, "cpu": 2},
    "2gpu120": {0: .60, 1: .60, "cpu": 2}, "4gpu120": {0: .30, 1: .30, 2: .30, 3: .30, "cpu": 2},
    "ram30": {"cpu": .30}, "ram60": {"cpu": .60},
}
QUICK = ["llama-8b", "gpt2", "t5-base", "segformer-b0", "convnext-tiny", "swin-tiny", "gemma3-4b", "mamba-130m"]
OURS = ["sequential", "backfill", "reserve", "ilp", "auto", "balanced"]
OUT = Path(__file__).parent / "results"


def accelerate_map(model, budget, problem):
    import accelerate.utils

    return dict(accelerate.utils.infer_auto_device_map(
        model, copy.deepcopy(budget), no_split_module_classes=sorted(problem.graph.no_split_declared)))


def transformers_map(mode):
    """transformers 5's own route for a string ``device_map``: ``_get_device_map`` (its ``get_balanced_memory`` with
    ``low_zero`` for the balanced modes, then its ``infer_auto_device_map``), unpatched."""

    def run(model, budget, problem):
        from transformers.integrations.accelerate import _get_device_map

        return dict(_get_device_map(model, mode, copy.deepcopy(budget), None))

    return run


def ours(strategy):
    def run(model, budget, problem):
        return allocator.plan(model, budget, strategy=strategy, strict=True)

    return run


METHODS = {"accelerate": accelerate_map, "transformers-auto": transformers_map("auto"),
           "transformers-balanced": transformers_map("balanced"), **{s: ours(s) for s in OURS}}


def measure(names, cells, methods=None):
    """One row per (architecture, budget cell, method) of ``methods`` (a subset of :data:`METHODS`; all when
    omitted)."""
    methods = {m: METHODS[m] for m in (methods or METHODS)}
    rows = []
    for name in names:
        model = zoo.build(name)
        total = allocator.build_problem(model, {"cpu": 0}).graph.total
        for cell in cells:
            budget = {d: int(total * f) for d, f in GRID[cell].items()}
            problem = allocator.build_problem(model, budget)
            for method, fn in methods.items():
                start, cpu = time.perf_counter(), time.process_time()
                try:
                    device_map = fn(model, budget, problem)
                except allocator.InfeasiblePlacement as err:
                    rows.append(dict(model=name, cell=cell, method=method, share="", est_ms="", valid="infeasible",
                                     violations="", contract="", seconds=f"{time.perf_counter() - start:.4f}",
                                     cpu_seconds=f"{time.process_time() - cpu:.4f}", optimal="",
                                     minimum_ram=err.minimum, largest="", offloaded=""))
                    continue
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                optimal = getattr(device_map, "optimal", None)
                device_map = getattr(device_map, "device_map", device_map)
                violations, memory = check(problem, device_map)
                broken = allocator.contract_violations(problem, device_map) if not violations else []
                cost = estimate(problem, device_map)
                accelerators = [memory.peak[d] for d in problem.budgets.accelerators if d in memory.peak]
                rows.append(dict(model=name, cell=cell, method=method,
                                 share=f"{cost.resident_fast / total:.4f}", est_ms=f"{cost.seconds * 1e3:.4f}",
                                 valid=not violations,
                                 violations=";".join(sorted({v.kind for v in violations})),
                                 contract=";".join(sorted({v.kind for v in broken})),
                                 seconds=f"{seconds:.4f}", cpu_seconds=f"{cpu:.4f}",
                                 optimal="" if optimal is None else optimal, minimum_ram="",
                                 largest=f"{max(accelerators) / total:.4f}" if accelerators else "",
                                 offloaded=bool({"cpu", "disk"} & set(device_map.values()))))
        print(f"{name}: done", file=sys.stderr, flush=True)
    return rows


def table(rows, cells, field="share") -> str:
    """Markdown: per model and cell, accelerate -> ours (auto); '!' marks an invalid map."""
    def cell_text(r):
        if r["valid"] == "infeasible":
            return "none fits"
        value = f"{100 * float(r['share']):.0f}%" if field == "share" else f"{float(r['est_ms']):.3g}"
        return f"{value}{'' if r['valid'] else '!'}"

    by = {(r["model"], r["cell"], r["method"]): r for r in rows}
    models = list(dict.fromkeys(r["model"] for r in rows))
    lines = ["| model | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
    for m in models:
        parts = [f"{cell_text(by[m, c, 'accelerate'])} → **{cell_text(by[m, c, 'auto'])}**" for c in cells]
        lines.append(f"| {m} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def _ratio(rows, method) -> tuple[float, float, int]:
    """Geometric mean and worst of (estimated time of ``method`` / accelerate's) where both maps are valid."""
    by = {(r["model"], r["cell"], r["method"]): r for r in rows}
    ratios = []
    for r in rows:
        if r["method"] != method or r["valid"] is not True:
            continue
        acc = by[r["model"], r["cell"], "accelerate"]
        if acc["valid"] is True and float(acc["est_ms"]) > 0:
            ratios.append(float(r["est_ms"]) / float(acc["est_ms"]))
    if not ratios:
        return float("nan"), float("nan"), 0
    return statistics.geometric_mean(ratios), max(ratios), len(ratios)


def summary(rows) -> str:
    out = []
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        invalid = sum(1 for r in mine if r["valid"] is False)
        infeasible = sum(1 for r in mine if r["valid"] == "infeasible")
        broken = sum(1 for r in mine if r["valid"] is True and r["contract"])
        shares = [float(r["share"]) for r in mine if r["valid"] is True]
        secs = [float(r["seconds"]) for r in mine]
        geo, worst, n = _ratio(rows, method)
        out.append(f"| {method} | {len(mine)} | {invalid} | {infeasible} | {broken} | "
                   f"{100 * statistics.mean(shares):.1f}% | {geo:.3f} (worst {worst:.3f}, {n} cells) | "
                   f"{1000 * statistics.median(secs):.1f} ms |")
    gains = []
    for r in rows:
        if r["method"] != "auto" or r["valid"] is not True:
            continue
        acc = next(x for x in rows
                   if x["model"] == r["model"] and x["cell"] == r["cell"] and x["method"] == "accelerate")
        if acc["valid"] is True:
            gains.append(float(r["share"]) - float(acc["share"]))
    head = ["| method | cells | invalid maps | no valid map | valid maps breaking the contract | "
            "mean resident share (valid maps) | est. time / accelerate's (geo. mean) | median planning time |",
            "|---|---|---|---|---|---|---|---|"]
    tail = (f"\n\nWhere accelerate's map is valid ({len(gains)} cells), `auto` keeps on average "
            f"{100 * statistics.mean(gains):.1f} points more of the model on the fastest tier "
            f"(max {100 * max(gains):.1f}, min {100 * min(gains):.1f}).") if gains else ""
    return "\n".join(head + out) + tail


def balanced_summary(rows) -> str:
    """Multi-accelerator cells: transformers' "balanced" against ours, by spills and by the largest accelerator peak."""
    by = {(r["model"], r["cell"], r["method"]): r for r in rows}
    cells = [c for c in GRID if sum(1 for d in GRID[c] if d not in ("cpu", "disk")) > 1]
    spills, ratios, n = 0, [], 0
    for (model, cell, method), ours in by.items():
        if method != "balanced" or cell not in cells or ours["valid"] is not True:
            continue
        theirs = by[model, cell, "transformers-balanced"]
        n += 1
        if theirs["valid"] is True and theirs["offloaded"] is True and ours["offloaded"] is False:
            spills += 1
        if theirs["valid"] is True and ours["offloaded"] is False and theirs["offloaded"] is False \
                and theirs["largest"]:
            ratios.append(float(ours["largest"]) / float(theirs["largest"]))
    if not n:
        return ""
    text = (f"Multi-accelerator cells ({', '.join(cells)}; {n} with a valid `balanced` map): transformers' "
            f'`device_map="balanced"` offloads to cpu/disk in {spills} of them where `balanced` keeps the whole model '
            f"on the accelerators")
    if ratios:
        text += (f"; where both keep it all resident ({len(ratios)} cells), `balanced`'s largest accelerator peak is "
                 f"{statistics.geometric_mean(ratios):.3f}x transformers' (geometric mean; worst {max(ratios):.3f}x)")
    return text + "."


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in GRID if c.startswith("gpu")]
    x = [GRID[c][0] * 100 for c in cells]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, style in (("accelerate", "o--"), ("transformers-auto", "s:"), ("auto", "D-")):
        ys = []
        for c in cells:
            vals = [float(r["share"]) for r in rows if r["cell"] == c and r["method"] == method and r["valid"] is True]
            ys.append(100 * statistics.mean(vals) if vals else float("nan"))
        ax.plot(x, ys, style, label=f"{method} (valid maps)")
    ax.plot([0, 100], [0, 100], color="0.8", lw=1, label="budget")
    ax.set_xlabel("GPU budget, % of the model")
    ax.set_ylabel("model resident on the GPU, % (mean over models)")
    ax.set_title("Resident share vs budget, one GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 architectures instead of the whole zoo")
    parser.add_argument("--models", nargs="*", help="explicit zoo names")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    names = args.models or (QUICK if args.quick else zoo.names())
    cells = list(GRID)
    start = time.time()
    rows = measure(names, cells)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "placement.csv", rows)
    text = (f"# Placement benchmark\n\n`python benchmarks/placement.py{' --quick' if args.quick else ''}` — "
            f"{len(names)} architectures x {len(cells)} budgets, {time.time() - start:.0f} s.\n\n"
            f"{summary(rows)}\n\n{balanced_summary(rows)}\n\n"
            "Resident share on the fastest tier, accelerate → ours (`auto`); "
            f"`!` = the map breaks a runtime rule (it would run out of memory or fail); "
            f"'none fits' = no valid map exists for these budgets and `auto` says the minimum RAM.\n\n"
            f"{table(rows, cells)}\n\nEstimated milliseconds per forward (`allocator.evaluate.cost.estimate`, default "
            f"`Profile`: 512 tokens, A100-class accelerator, PCIe 4.0 pageable copies), accelerate → ours (`auto`):\n\n"
            f"{table(rows, cells, 'est_ms')}\n")
    (args.out / "placement.md").write_text(text)
    plot(rows, args.out / "placement.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
