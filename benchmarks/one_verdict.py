"""What one plan says, for the cases issue #46 names: run it on two commits and compare (estimates, on the meta device).

For each case it prints what the plan's data says (``Plan.to_dict()``): bytes resident and peak per device, the
parts of each peak, ``valid``, ``estimate.seconds`` and ``estimate.steps``, and where the plan keeps experts. Every
figure is an *estimate* of the cost model or a count of bytes the plan holds; nothing is timed. To compare commits::

    PYTHONPATH=/path/to/before python benchmarks/one_verdict.py > before.json
    PYTHONPATH=$PWD python benchmarks/one_verdict.py > after.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings

import torch

import allocator
from allocator.model import zoo

GiB = 2 ** 30


def _cases():
    """(name, model builder, budgets, options)."""
    bf16 = {"dtype": torch.bfloat16}
    yield ("llama-70b 24GiB+192GiB 32k allocator", "llama-70b", {0: "24GiB", "cpu": "192GiB"},
           {**bf16, "runtime": "allocator", "generation": allocator.GenerationBudget(1, 32768)})
    yield ("llama-70b 24GiB+192GiB 4k allocator", "llama-70b", {0: "24GiB", "cpu": "192GiB"},
           {**bf16, "runtime": "allocator", "generation": allocator.GenerationBudget(1, 4096)})
    yield ("llama-70b 24GiB+192GiB 4k accelerate", "llama-70b", {0: "24GiB", "cpu": "192GiB"},
           {**bf16, "generation": allocator.GenerationBudget(1, 4096)})
    yield ("qwen3-moe-30b-a3b 16GB+64GiB 4k allocator", "qwen3-moe-30b-a3b", {0: "16GB", "cpu": "64GiB"},
           {**bf16, "runtime": "allocator", "generation": allocator.GenerationBudget(1, 4096)})
    yield ("mixtral-8x7b 2x32GiB+128GiB allocator", "mixtral-8x7b", {0: "32GiB", 1: "32GiB", "cpu": "128GiB"},
           {**bf16, "runtime": "allocator"})
    yield ("mixtral-8x7b RAM 30% + disk allocator", "mixtral-8x7b", {"cpu": "27GiB", "disk": "1TiB"},
           {**bf16, "runtime": "allocator"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", help="names (substrings) of the cases to run")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    out = {}
    for name, model_name, budgets, options in _cases():
        if args.cases and not any(c in name for c in args.cases):
            continue
        p = allocator.plan(zoo.build(model_name), budgets, **options)
        data = p.to_dict()
        out[name] = {
            "valid": data["valid"],
            "main": data["main_device"],
            "resident_GiB": {d: round(v / GiB, 2) for d, v in data["resident"].items()},
            "peak_GiB": {d: round(v / GiB, 2) for d, v in data["peak"].items()},
            "parts_GiB": {d: {k: round(v / GiB, 2) for k, v in parts.items() if v}
                          for d, parts in data["parts"].items()},
            "estimate_s": round(data["estimate"]["seconds"], 4),
            "estimate_step": data["estimate"].get("step"),
            "steps_s": {k: round(v, 4) for k, v in data["estimate"]["steps"].items()},
            "experts_kept": sorted({str(d) for row in (data.get("experts") or {}).values() for d in row}),
        }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
