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
"""

from __future__ import annotations

import argparse
import json
import logging
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
GIB = 2 ** 30
#: Cells of their own: (model, dtype, budget in bytes).
CELLS = {"llama-70b-bf16/4x40GiB": ("llama-70b", torch.bfloat16, {0: 40 * GIB, 1: 40 * GIB, 2: 40 * GIB,
                                                                   3: 40 * GIB, "cpu": 1024 * GIB})}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _median(model, budget, repeat: int, clock, **options) -> float:
    times = []
    for _ in range(repeat):
        t0 = clock()
        allocator.plan(model, budget, **options)
        times.append(clock() - t0)
    return round(statistics.median(times), 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--grid", nargs="+", default=list(GRID), help="budgets of the grid to run")
    ap.add_argument("--cells", nargs="*", default=list(CELLS), help="cells of their own to run")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall seconds, or this process's CPU seconds (steadier on a machine other jobs load: CP-SAT "
                         "runs one worker in this process)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    out = {}
    for name in args.models:
        model = zoo.build(name)
        total = allocator.build_problem(model, {"cpu": 10 ** 15}).graph.total
        for grid in args.grid:
            budget = {k: int(v * total) for k, v in GRID[grid].items()}
            out[f"{name}/{grid}"] = _median(model, budget, args.repeat, CLOCKS[args.clock])
    for cell in args.cells:
        name, dtype, budget = CELLS[cell]
        out[cell] = _median(zoo.build(name), budget, args.repeat, CLOCKS[args.clock], dtype=dtype)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
