"""Planning time of the default strategy on real architectures, for comparing two commits of this package.

``allocator.plan(model, budget)`` (``strategy="auto"``) on zoo models built on the meta device, at five budgets
(one GPU at 30 % and 70 % of the model, RAM at 30 %, two GPUs at 30 % each, four GPUs at 15 % each), and llama-70b in
bfloat16 on four 40 GiB GPUs and RAM (the whole model fits on the GPUs) as a cell of its own, median of ``--repeat``
calls per cell, one thread, wall seconds (``--clock cpu``: this process's CPU seconds, for a machine other jobs
load). Prints JSON ``{"model/budget": seconds}``. To compare commits, run it with each checkout
first on ``PYTHONPATH`` (the script imports whichever ``allocator`` is found), alternating, and compare sums per
budget:

    PYTHONPATH=/path/to/before python benchmarks/plan_time.py > before.json
    PYTHONPATH=$PWD python benchmarks/plan_time.py > after.json

``--plans FILE`` also keeps each cell's plan (map, strategy, estimate, bytes on the fastest tier), and ``--compare A B``
says which cells' maps differ between two such files and how (the three- and four-GPU cells that
``compare_plans.py`` does not cover: ``--grid 4gpu60 4gpu120 4gpu-uneven 3gpu45``, budgets of :data:`MORE`)::

    PYTHONPATH=/path/to/before python benchmarks/plan_time.py --grid 4gpu60 4gpu120 4gpu-uneven 3gpu45 --repeat 1 \
        --plans before.pkl > /dev/null
    python benchmarks/plan_time.py --compare before.pkl after.pkl
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import statistics
import sys
import time
import warnings

import torch

import allocator
from allocator.model import zoo

MODELS = ["llama-3.2-1b", "gpt2", "t5-base", "clip-vit-base", "mixtral-8x7b", "qwen3-moe-30b-a3b", "segformer-b0",
          "gemma3-4b", "bert-base", "phi-3-mini"]
GRID = {"gpu30": {0: .30, "cpu": 2}, "gpu70": {0: .70, "cpu": 2}, "ram30": {"cpu": .30},
        "2gpu60": {0: .30, 1: .30, "cpu": 2}, "4gpu60": {0: .15, 1: .15, 2: .15, 3: .15, "cpu": 2}}
#: More budgets, run only when named in ``--grid``: three and four GPUs, which ``compare_plans.py`` does not cover.
MORE = {"4gpu120": {0: .30, 1: .30, 2: .30, 3: .30, "cpu": 2},
        "4gpu-uneven": {0: .25, 1: .10, 2: .20, 3: .05, "cpu": 2}, "3gpu45": {0: .15, 1: .15, 2: .15, "cpu": 2}}
GIB = 2 ** 30
#: Cells of their own: (model, dtype, budget in bytes).
CELLS = {"llama-70b-bf16/4x40GiB": ("llama-70b", torch.bfloat16, {0: 40 * GIB, 1: 40 * GIB, 2: 40 * GIB,
                                                                   3: 40 * GIB, "cpu": 1024 * GIB})}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _median(model, budget, repeat: int, clock, **options) -> tuple[float, tuple]:
    """The median time of ``repeat`` plans, and the last plan as data (map items, strategy, estimate, fast bytes)."""
    times = []
    for _ in range(repeat):
        t0 = clock()
        plan = allocator.plan(model, budget, **options)
        times.append(clock() - t0)
    kept = (list(plan.device_map.items()), plan.strategy, plan.cost.seconds, int(plan.cost.resident_fast))
    return round(statistics.median(times), 4), kept


def compare(before: str, after: str) -> list[str]:
    """The cells of two ``--plans`` files whose maps differ, each with its bytes on the fastest tier and estimate."""
    with open(before, "rb") as a, open(after, "rb") as b:
        old, new = pickle.load(a), pickle.load(b)
    lines = []
    for cell in sorted(set(old) & set(new)):
        (map_a, _, sec_a, fast_a), (map_b, _, sec_b, fast_b) = old[cell], new[cell]
        if map_a != map_b:
            lines.append(f"{cell}: map differs; fast bytes {fast_a} -> {fast_b} ({fast_b - fast_a:+d}), estimate "
                         f"{sec_a * 1e3:.6f} -> {sec_b * 1e3:.6f} ms")
    lines.append(f"{len(lines)} of {len(set(old) & set(new))} cells differ")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--grid", nargs="+", default=list(GRID), choices=[*GRID, *MORE], help="budgets of the grid to run")
    ap.add_argument("--cells", nargs="*", default=list(CELLS), help="cells of their own to run")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall seconds, or this process's CPU seconds (steadier on a machine other jobs load: CP-SAT "
                         "runs one worker in this process)")
    ap.add_argument("--plans", help="also write each cell's plan here (a pickle), for --compare")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --plans files and exit")
    args = ap.parse_args(argv)
    if args.compare:
        print("\n".join(compare(*args.compare)))
        return 0
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    out, plans = {}, {}
    for name in args.models:
        model = zoo.build(name)
        total = allocator.build_problem(model, {"cpu": 10 ** 15}).graph.total
        for grid in args.grid:
            budget = {k: int(v * total) for k, v in {**GRID, **MORE}[grid].items()}
            out[f"{name}/{grid}"], plans[f"{name}/{grid}"] = _median(model, budget, args.repeat, CLOCKS[args.clock])
    for cell in args.cells:
        name, dtype, budget = CELLS[cell]
        out[cell], plans[cell] = _median(zoo.build(name), budget, args.repeat, CLOCKS[args.clock], dtype=dtype)
    if args.plans:
        with open(args.plans, "wb") as f:
            pickle.dump(plans, f)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
