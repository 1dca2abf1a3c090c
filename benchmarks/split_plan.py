"""Decoder layers split under our runtime (issue #49): the plan with layers split against the whole-layer plan
(``split_layers=False``), for the cases the issue names. *Estimates* of the cost model on the meta device, bf16;
nothing runs.

Per case: where the plan keeps attention and its KV cache (layers whose attention computes on GPU 0), the layers
split, bytes on GPU 0 (resident weights, KV cache there, peak), the estimated prefill and decode steps, and the
plan's ``"sublayer"`` decision (``faster``, ``slower`` or ``none-fits``). Then ``fit(runtime="allocator")``: the
longest context with every layer's attention and KV cache on the GPU and the rest in RAM, beside the longest with the
whole model on it.

    python benchmarks/split_plan.py            # prints a markdown table; --csv PATH writes it too
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import allocator
from allocator.model import zoo
from allocator.model.split import find_splits
from allocator.strategies.split import split_layers

sys.path.insert(0, str(Path(__file__).parent))
from benchutil import quiet, write_csv  # noqa: E402

GiB = 2 ** 30
CASES = (
    ("llama-70b", {0: "24GiB", "cpu": "192GiB"}, 32768),
    ("llama-70b", {0: "24GiB", "cpu": "192GiB"}, 4096),
    ("llama-70b", {0: "24GiB", "cpu": "192GiB"}, 512),
    ("llama-8b", {0: "8GiB", "cpu": "64GiB"}, 32768),
    ("qwen3-moe-30b-a3b", {0: "16GiB", "cpu": "64GiB"}, 4096),
    ("qwen2-moe-a2.7b", {0: "5GiB", "cpu": "64GiB"}, 4096),
)
FITS = (("llama-8b", {0: "8GiB", "cpu": "64GiB"}), ("llama-70b", {0: "24GiB", "cpu": "192GiB"}),
        ("llama-70b", {0: "32GiB", "cpu": "192GiB"}))


def _attention_on(plan, model, device) -> int:
    """Layers whose attention computes on ``device`` (it, or a module above it, mapped there)."""
    def where(name):
        while name not in plan.device_map and name:
            name = name.rpartition(".")[0]
        return plan.device_map.get(name)
    return sum(1 for s in find_splits(model, plan.problem.graph.no_split) if where(s.attention) == device)


def row(name: str, budget: dict, length: int, split: bool) -> dict:
    model = zoo.build(name)
    p = allocator.plan(model, budget, dtype=torch.bfloat16, runtime="allocator",
                       generation=allocator.GenerationBudget(1, length), split_layers=split)
    said = p.placement.of_kind("sublayer")
    return {"model": name, "budget": "+".join(str(v) for v in budget.values()), "max_length": length,
            "plan": "split allowed" if split else "whole layers", "valid": p.valid,
            "attention_on_gpu": _attention_on(p, model, 0), "layers_split": len(split_layers(p.problem, p.device_map)),
            "main": p.main_device, "gpu_weights_GiB": round(p.resident(0) / GiB, 3),
            "gpu_cache_GiB": round(p.parts.get(0, {}).get("cache", 0) / GiB, 3),
            "gpu_peak_GiB": round(p.peak.get(0, 0) / GiB, 3),
            "prefill_s": round(p.costs["prefill"].seconds, 4), "decode_s": round(p.costs["decode"].seconds, 4),
            "decision": said[0].reason if said else ""}


def fit_row(name: str, budget: dict) -> dict:
    found = allocator.fit(zoo.build(name), budget, dtype=torch.bfloat16, runtime="allocator")
    return {"model": name, "budget": "+".join(str(v) for v in budget.values()), "whole_on_gpu_tokens": found.max_length,
            "attention_and_cache_on_gpu_tokens": found.split_length}


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, help="also write the plans' rows as CSV here")
    args = ap.parse_args(argv)
    quiet()
    rows = [row(name, budget, length, split) for name, budget, length in CASES for split in (False, True)]
    print("Estimates (cost model, meta device, bf16; nothing runs)\n")
    print(_table(rows))
    print()
    print(_table([fit_row(name, budget) for name, budget in FITS]))
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
