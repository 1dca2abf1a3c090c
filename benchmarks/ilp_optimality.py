"""ILP benchmark: ``ilp`` over the zoo x the 11 budgets of ``placement.py``, against every other strategy.

Per cell: whether ``ilp`` proved its plan optimal, its planning time (wall and CPU: ``allocator.plan`` on the meta
model, building the problem included), the estimated milliseconds per forward of ``sequential``, ``backfill``,
``reserve``, ``ilp`` and ``auto`` (``allocator.estimate``, default ``Profile``) and each one's ratio to accelerate's
``infer_auto_device_map`` where accelerate's map is valid. Summary: proof rate, slowest cell, and every cell where a
valid plan of another strategy is estimated faster than ``ilp``'s. Rows come from ``placement.measure``. Writes
``benchmarks/results/ilp.csv`` and ``ilp.md``.

    python benchmarks/ilp_optimality.py                      # 41 architectures x 11 budgets
    python benchmarks/ilp_optimality.py --models t5-base     # some architectures
"""

from __future__ import annotations

import argparse
import datetime
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from placement import GRID, OUT, measure  # noqa: E402
from benchutil import write_csv  # noqa: E402

from allocator.model import zoo  # noqa: E402

STRATEGIES = ["sequential", "backfill", "reserve", "ilp", "auto"]
TOLERANCE = 1e-9  # relative: the estimate of equal maps may differ in the last bits only


def _est(row) -> float | None:
    return float(row["est_ms"]) if row and row["valid"] is True else None


def cells_table(rows) -> tuple[str, dict]:
    """Markdown, one line per cell, and the summary figures."""
    by = {(r["model"], r["cell"], r["method"]): r for r in rows}
    keys = list(dict.fromkeys((r["model"], r["cell"]) for r in rows))
    head = ["| model | cell | ilp proven | ilp wall s | ilp CPU s | " + " | ".join(f"{s} ms" for s in STRATEGIES)
            + " | " + " | ".join(f"{s} / acc." for s in STRATEGIES) + " |",
            "|---|---|---|---|---|" + "---|" * (2 * len(STRATEGIES))]
    lines, proven, plans, infeasible, beaten, walls, cpus, ratios = [], 0, 0, 0, [], [], [], []
    for model, cell in keys:
        ilp = by[model, cell, "ilp"]
        acc = _est(by.get((model, cell, "accelerate")))
        walls.append((float(ilp["seconds"]), model, cell))
        cpus.append(float(ilp["cpu_seconds"]))
        if ilp["valid"] == "infeasible":
            infeasible += 1
        else:
            plans += 1
            proven += ilp["optimal"] is True
        mine = _est(ilp)
        costs, rel = [], []
        for s in STRATEGIES:
            r = by[model, cell, s]
            e = _est(r)
            costs.append("none fits" if r["valid"] == "infeasible" else f"{e:.4g}" if e is not None else "invalid")
            rel.append(f"{e / acc:.3f}" if e is not None and acc else "")
            if s != "ilp" and e is not None and (mine is None or mine > e * (1 + TOLERANCE)):
                beaten.append(f"{model} {cell}: {s} {e:.6g} ms < ilp {mine}")
        if mine is not None and acc:
            ratios.append(mine / acc)
        proof = "" if ilp["valid"] == "infeasible" else "yes" if ilp["optimal"] is True else "**no**"
        lines.append(f"| {model} | {cell} | {proof} | {float(ilp['seconds']):.2f} | {float(ilp['cpu_seconds']):.2f} | "
                     + " | ".join(costs + rel) + " |")
    figures = dict(cells=len(keys), plans=plans, proven=proven, infeasible=infeasible, beaten=beaten,
                   slowest=max(walls), max_cpu=max(cpus), median_wall=statistics.median(w[0] for w in walls),
                   over5=sum(w[0] > 5 for w in walls),
                   ratio=statistics.geometric_mean(ratios) if ratios else float("nan"),
                   unproven=[f"{r['model']} {r['cell']}" for r in rows
                             if r["method"] == "ilp" and r["valid"] is True and r["optimal"] is not True])
    return "\n".join(head + lines), figures


def summary(f: dict) -> str:
    wall, model, cell = f["slowest"]
    return "\n".join([
        f"- `ilp` proved its plan optimal in **{f['proven']} / {f['plans']}** cells with a plan "
        f"({100 * f['proven'] / max(f['plans'], 1):.1f} %); {f['infeasible']} cell(s) have no valid plan "
        f"(every strategy raises `InfeasiblePlacement`). Unproven: {', '.join(f['unproven']) or 'none'}.",
        f"- Planning time of `ilp` (wall, `allocator.plan` including building the problem): median "
        f"{f['median_wall']:.2f} s, max {wall:.2f} s ({model} {cell}); {f['over5']} cell(s) over 5 s; max CPU time "
        f"{f['max_cpu']:.2f} s.",
        f"- Cells where a valid plan of another strategy is estimated faster than `ilp`'s: **{len(f['beaten'])}**"
        + ("" if not f["beaten"] else ": " + "; ".join(f["beaten"])) + ".",
        f"- `ilp`'s estimated time / accelerate's, geometric mean over cells where both are valid: {f['ratio']:.3f}.",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", help="explicit zoo names (default: the whole zoo)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    names = args.models or zoo.names()
    start, when = time.time(), datetime.datetime.now(datetime.timezone.utc)
    rows = measure(names, list(GRID), ["accelerate", *STRATEGIES])
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "ilp.csv", rows)
    table, figures = cells_table(rows)
    command = "python benchmarks/ilp_optimality.py" + (f" --models {' '.join(args.models)}" if args.models else "")
    text = (f"# ILP: optimality, planning time, cost against every strategy\n\n`{command}` — "
            f"{when:%Y-%m-%d %H:%M} UTC, {len(names)} architectures x {len(GRID)} budgets, "
            f"{time.time() - start:.0f} s.\n\n{summary(figures)}\n\nEstimated ms per forward (`allocator.estimate`, "
            f"default `Profile`) and the ratio to accelerate's where accelerate's map is valid; `invalid`: the map "
            f"breaks a runtime rule.\n\n{table}\n")
    (args.out / "ilp.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
