"""Planning time of the default strategy on real architectures, for comparing two commits of this package.

``allocator.plan(model, budget)`` (``strategy="auto"``) on zoo models built on the meta device, at four budgets
(one GPU at 30 % and 70 % of the model, RAM at 30 %, two GPUs at 30 % each), median of ``--repeat`` calls per cell,
one thread. Prints JSON ``{"model/budget": seconds}``. To compare commits, run it with each checkout first on
``PYTHONPATH`` (the script imports whichever ``allocator`` is found), alternating, and compare sums per budget:

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
        "2gpu60": {0: .30, 1: .30, "cpu": 2}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    out = {}
    for name in args.models:
        model = zoo.build(name)
        total = allocator.build_problem(model, {"cpu": 10 ** 15}).graph.total
        for grid, shares in GRID.items():
            budget = {k: int(v * total) for k, v in shares.items()}
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                allocator.plan(model, budget)
                times.append(time.perf_counter() - t0)
            out[f"{name}/{grid}"] = round(statistics.median(times), 4)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
