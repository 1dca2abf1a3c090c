"""Command line: ``allocator demo`` and ``allocator plan``.

Bad input exits with status 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .errors import AllocatorError

__all__ = ["main", "parse_max_memory"]


def parse_max_memory(text: str) -> dict:
    """``"0=20GiB,1=20GiB,cpu=64GiB"`` -> ``{0: "20GiB", 1: "20GiB", "cpu": "64GiB"}`` (sizes parsed later).

    >>> parse_max_memory("0=20GiB,cpu=64GiB")
    {0: '20GiB', 'cpu': '64GiB'}
    """
    from .errors import InvalidBudget

    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key or not value:
            raise InvalidBudget(f"--max-memory entry {part!r} is not DEVICE=SIZE; write e.g. 0=20GiB,cpu=64GiB.")
        out[int(key) if key.isdigit() else key] = value
    if not out:
        raise InvalidBudget("--max-memory is empty; write e.g. 0=20GiB,cpu=64GiB.")
    return out


def _demo(args) -> int:
    from . import plan, zoo
    from .problem import build_problem

    name = args.model
    model = zoo.build(name)
    total = build_problem(model, {"cpu": 0}).graph.total
    scenarios = {
        "one GPU at 60% of the model, RAM for the rest": {0: int(total * 0.6), "cpu": total},
        "two GPUs at 15% each, RAM at 50%": {0: int(total * 0.15), 1: int(total * 0.15), "cpu": int(total * 0.5)},
        "RAM only, 50% of the model": {"cpu": int(total * 0.5)},
    }
    print(f"allocator demo: {name} ({zoo.ZOO[name].description.splitlines()[0]})\n")
    for title, budget in scenarios.items():
        result = plan(model, budget, strategy=args.strategy)
        print(f"== {title}")
        print(_summary(result))
        print()
    return 0


def _summary(result) -> str:
    lines = result.explain().splitlines()
    return "\n".join(line for line in lines if not line.startswith("  - "))


def _plan(args) -> int:
    from . import plan, zoo

    if args.source not in zoo.ZOO:
        raise AllocatorError(f"unknown model {args.source!r}; built-in examples: {', '.join(zoo.names())}.")
    model = zoo.build(args.source)
    result = plan(model, parse_max_memory(args.max_memory), strategy=args.strategy, dtype=args.dtype)
    print(_summary(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.device_map, fh, indent=1)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="allocator", description="Plan where each part of a model lives.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan a built-in example under three budgets")
    demo.add_argument("--model", default="t5-base")
    demo.add_argument("--strategy", default="auto")
    p = sub.add_parser("plan", help="plan a built-in example")
    p.add_argument("source", help="a built-in example name (see 'allocator plan --list')")
    p.add_argument("--max-memory", required=True, help="e.g. 0=20GiB,1=20GiB,cpu=64GiB")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", default=None, help="write the device map to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    try:
        if args.command == "demo":
            if args.model not in __import__("allocator.zoo", fromlist=["ZOO"]).ZOO:
                raise AllocatorError(f"unknown model {args.model!r}; see 'allocator plan --help'.")
            return _demo(args)
        return _plan(args)
    except (AllocatorError, OSError) as err:
        print(f"allocator: error: {err}", file=sys.stderr)
        return 2
