"""What counting FLOPs costs a plan: ``allocator.plan`` without ``inputs`` against ``inputs="default"``.

For each built-in example (meta device, nothing downloaded) with GPU 0 at 40 % of the model and RAM for the rest,
times ``allocator.plan(model, budget)`` and ``allocator.plan(model, budget, inputs="default")`` (a 512-token
prompt, or the config's image size), medians of ``--repeat`` calls each (after one untimed call of each, so that
imports and the graph reader's caches are warm), and says whether the count was complete. This decides whether
``PlanOptions.inputs`` may default to ``"default"``. Writes ``counting_cost.csv`` and ``counting_cost.md``.

    python benchmarks/counting_cost.py
    python benchmarks/counting_cost.py --models segformer-b0 --repeat 1   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import allocator
from allocator.model import zoo

from benchutil import cores, quiet, write_csv

OUT = Path(__file__).parent / "results"
MODELS = ("llama-3.2-1b", "t5-base", "vit-base", "segformer-b0", "swin-tiny", "mamba-130m", "llama-70b")


def timed(model, budget: dict, inputs, repeat: int) -> tuple[float, object]:
    found = allocator.plan(model, budget, inputs=inputs)
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        found = allocator.plan(model, budget, inputs=inputs)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"default: {' '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls of each (median)")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    args.cores = cores()   # before the run loads the machine
    quiet()
    torch.set_num_threads(1)
    command = " ".join(["python benchmarks/counting_cost.py", *(sys.argv[1:] if argv is None else argv)])
    rows = []
    for name in args.models:
        model = zoo.build(name)
        total = allocator.build_problem(model, {"cpu": 0}).graph.total
        budget = {0: int(0.4 * total), "cpu": 2 * total}
        plain, _ = timed(model, budget, None, args.repeat)
        counted, found = timed(model, budget, "default", args.repeat)
        count = found.problem.flops
        shapes = " ".join(f"{k}={'x'.join(map(str, v))}" for k, v in count.inputs.items())
        rows.append(dict(model=name, plan_s=round(plain, 4), plan_counted_s=round(counted, 4),
                         ratio=round(counted / plain, 1), ops=sum(count.ops.values()),
                         gflop=round(count.total / 1e9, 1), complete=count.complete, inputs=shapes))
        print(f"{name}: {plain:.3f} s -> {counted:.3f} s", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "counting_cost.csv", rows)
    lines = ["# What counting FLOPs costs a plan", "",
             f"`{command}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()}, "
             f"{args.cores}, torch {torch.__version__}; median of {args.repeat} "
             "calls each; GPU 0 at 40 % of the model.", "",
             "| model | inputs | plan, s | plan with inputs='default', s | × | ops | GFLOP | complete |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['inputs']} | {r['plan_s']} | {r['plan_counted_s']} | {r['ratio']} | {r['ops']} | "
              f"{r['gflop']} | {r['complete']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (args.out / "counting_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
