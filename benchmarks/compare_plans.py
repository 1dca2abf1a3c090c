"""Dump every planner output for a fixed set of inputs, to prove that a speed change kept the outputs identical.

Inputs: the zoo (every model x the budget scenarios of ``tests/zoo_scenarios.py``) and ``--trees`` seeded random
module trees (nesting, no-split classes, ties across branches, a module shared by two paths, declared tied keys,
buffers of every kind, parameters on the root) under random budgets and options. For each input it records, per
strategy (``sequential``, ``backfill``, ``reserve``, and ``auto`` on the trees): the map with its key order, the
peak, main device, streamed bytes, violations, cost and notes of ``allocator.plan`` (or the error); the graph's
fields; and ``check`` / ``estimate`` of random device maps (tensor keys, unknown keys and gaps included).

Run it once per version of the code, with the same ``PYTHONHASHSEED`` (tie groups, as accelerate finds them, follow the
iteration order of a set of strings, which changes from process to process), and compare the two files::

    PYTHONHASHSEED=0 PYTHONPATH=/path/to/old python benchmarks/compare_plans.py --out /tmp/before.pkl
    PYTHONHASHSEED=0 PYTHONPATH=$PWD        python benchmarks/compare_plans.py --out /tmp/after.pkl
    python benchmarks/compare_plans.py --compare /tmp/before.pkl /tmp/after.pkl
"""

from __future__ import annotations

import argparse
import logging
import math
import pickle
import random
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

CLASS_NAMES = ["Block", "Layer", "Attn", "Mlp", "Norm", "Stack"]
_CLASSES = {name: type(name, (nn.Module,), {}) for name in CLASS_NAMES}
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from zoo_scenarios import SCENARIOS  # noqa: E402  (the scenarios of the strategy tests)


def random_tree(rng: random.Random, max_depth: int = 3, max_children: int = 4) -> nn.Module:
    params: list[tuple[nn.Module, str, nn.Parameter]] = []
    modules: list[nn.Module] = []

    def make(depth: int) -> nn.Module:
        module = _CLASSES[rng.choice(CLASS_NAMES)]()
        modules.append(module)
        for i in range(rng.randint(0, 2)):
            numel = rng.choice([0, 1, 16, 64, 256, 1024, 4096])
            dtype = rng.choice([torch.float32, torch.float32, torch.float16])
            p = nn.Parameter(torch.empty(numel, dtype=dtype, device="meta"))
            module.register_parameter(f"w{i}", p)
            params.append((module, f"w{i}", p))
        if rng.randint(0, 4) == 0:
            dtype = rng.choice([torch.float32, torch.int64, torch.bool])
            module.register_buffer("buf", torch.empty(rng.choice([8, 64, 256]), dtype=dtype, device="meta"),
                                   persistent=rng.random() < 0.5)
        if depth < max_depth:
            for i in range(rng.randint(0, max_children)):
                module.add_module(f"c{i}", make(depth + 1))
        return module

    root = make(0)
    if rng.random() < 0.5:
        root.register_parameter("root_w", nn.Parameter(torch.empty(rng.choice([4, 128]), device="meta")))
    for _ in range(rng.randint(0, 2)):  # ties across branches
        if len(params) < 2:
            break
        src = rng.choice(params)
        dst = rng.choice(params)[0]
        if dst is not src[0]:
            dst.register_parameter(f"tied{len(dst._parameters)}", src[2])
    if rng.random() < 0.15 and len(modules) > 2:  # one module object under two paths
        shared = rng.choice(modules[1:])
        host = rng.choice(modules)
        if host is not shared and not _contains(shared, host):
            host.add_module("shared", shared)
    if rng.random() < 0.1 and params:  # one module lists a parameter twice (torch's generators yield it once)
        module, _, p = rng.choice(params)
        module.register_parameter("again", p)
    if rng.random() < 0.1:  # empty slots: a None parameter, buffer and child
        host = rng.choice(modules)
        host.register_parameter("none_w", None)
        host.register_buffer("none_b", None)
        host.add_module("none_m", None)
    if rng.random() < 0.2:  # transformers' declared ties: target -> source, separate objects before loading
        names = [n for n, _ in root.named_parameters()]
        if len(names) >= 2:
            a, b = rng.sample(names, 2)
            root.all_tied_weights_keys = {a: b}
    return root


def _contains(module: nn.Module, other: nn.Module) -> bool:
    return any(m is other for m in module.modules())


def random_budget(rng: random.Random, total: int) -> dict:
    kind = rng.choice(["gpu", "gpu2", "ram", "gpu-disk"])
    frac = lambda: int(total * rng.uniform(0.0, 1.2))  # noqa: E731
    ram = lambda: int(total * rng.uniform(0.2, 2.0))  # noqa: E731
    if kind == "gpu":
        return {0: frac(), "cpu": ram()}
    if kind == "gpu2":
        return {0: frac(), 1: frac(), "cpu": ram()}
    if kind == "gpu-disk":
        return {0: frac(), "cpu": ram(), "disk": frac()}
    return {"cpu": ram()}


def random_map(rng: random.Random, problem, devices) -> dict:
    g = problem.graph
    names = [n.name for n in g.nodes] + [t.name for t in g.tensors]
    keys = rng.sample(names, min(len(names), rng.randint(1, 6)))
    if rng.random() < 0.7:
        keys.append("")
    if rng.random() < 0.1:
        keys.append("no.such.module")
    return {k: rng.choice(devices) for k in keys}


def graph_record(g) -> tuple:
    return (
        [(n.name, n.cls, n.parent, n.children, n.params, n.buffers, n.alias_of) for n in g.nodes],
        [(t.name, t.module, t.local, t.is_param, t.persistent, t.numel, t.nbytes, t.nbytes_accelerate, t.canonical,
          t.storage, t._index, t.counted) for t in g.tensors],
        g.size, g.size_accelerate, sorted(g.no_split), sorted(g.no_split_declared), g.tied_groups, g.declared_ties,
        dict(g.node_index), dict(g.tensor_index), g.model_class,
    )


def plan_record(allocator, model, budget, strategy, **kwargs):
    try:
        p = allocator.plan(model, dict(budget), strategy=strategy, **kwargs)
    except Exception as err:  # the error is an output too
        return ("error", type(err).__name__, str(err))
    return (list(p.device_map.items()), sorted(p.peak.items(), key=str), p.main_device, p.streamed,
            [str(v) for v in p.violations], p.cost, _notes(allocator, p.placement), p.strategy)


def _notes(allocator, placement) -> tuple:
    """A placement's decisions as sentences: ``Placement.notes`` before the sentences moved to ``report/``
    (2026-12-05), :func:`allocator.report.decisions.notes` after."""
    if hasattr(placement, "notes"):
        return placement.notes
    from allocator.report.decisions import notes

    return notes(placement)


def explain_record(allocator, model, budget, strategy):
    """The text of ``Plan.explain()``: kept apart from the maps, as the words may change where the maps do not."""
    try:
        return allocator.plan(model, dict(budget), strategy=strategy).explain()
    except Exception as err:
        return ("error", type(err).__name__, str(err))


def check_record(problem, device_map):
    from allocator.evaluate.cost import estimate
    from allocator.evaluate.validate import check

    try:
        violations, memory = check(problem, device_map)
        cost = estimate(problem, device_map)
    except Exception as err:
        return ("error", type(err).__name__, str(err))
    return ([str(v) for v in violations], sorted(memory.peak.items(), key=str), memory.main, memory.streamed,
            memory.chain, cost)


def run(args) -> dict:
    import allocator
    from allocator.model import zoo

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    out = {}
    strategies = ("sequential", "backfill", "reserve")
    zoo_strategies = strategies + tuple(s for s in args.zoo_also.split(",") if s)
    if not args.no_zoo:
        for name in args.models.split(",") if args.models else zoo.names():
            model = zoo.build(name)
            problem = allocator.build_problem(model, {"cpu": 0})
            out["zoo-graph", name] = graph_record(problem.graph)
            total = problem.graph.total
            for scenario, fractions in SCENARIOS.items():
                budget = {d: int(total * f) for d, f in fractions.items()}
                for s in zoo_strategies:
                    out["zoo", name, scenario, s] = plan_record(allocator, model, budget, s)
                    if args.explain:
                        out["zoo-explain", name, scenario, s] = explain_record(allocator, model, budget, s)
            print(name, file=sys.stderr, flush=True)
    for seed in range(args.trees):
        rng = random.Random(seed)
        model = random_tree(rng)
        kwargs = dict(
            no_split_module_classes=rng.choice([None, ["Block"], ["Layer", "Attn"]]),
            offload_buffers=rng.random() < 0.5, clean_result=rng.random() < 0.5,
            fallback_allocation=rng.random() < 0.5, infer_no_split=rng.random() < 0.7,
        )
        try:
            problem = allocator.build_problem(model, {"cpu": 0},
                                              no_split_module_classes=kwargs["no_split_module_classes"],
                                              infer_no_split=kwargs["infer_no_split"])
        except Exception as err:
            out["tree", seed] = ("error", type(err).__name__, str(err))
            continue
        out["tree-graph", seed] = graph_record(problem.graph)
        budget = random_budget(rng, max(problem.graph.total, 1))
        for s in strategies + (("auto",) if seed % 4 == 0 else ()):
            out["tree", seed, s] = plan_record(allocator, model, budget, s, **kwargs)
        full = allocator.build_problem(model, dict(budget), **kwargs)
        devices = [d for d in full.budgets.order] + ["cpu"]
        for k in range(3):
            m = random_map(rng, full, devices)
            out["tree-map", seed, k] = (list(m.items()), check_record(full, m))
    return out


def _close(a, b) -> bool:
    """Equal, except that floats (estimated seconds) may differ by 1e-9 relative or 1 ps: a faster evaluation sums
    the same terms in another order, or in integer femtoseconds."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__") and type(a) is type(b):
        return all(_close(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


#: Modules of the package before the re-layout into folders (2026-12-03), and where their classes are now: a dump
#: made before it loads with the code after it.
MOVED = {
    "allocator.checkpoint": "allocator.model.checkpoint",
    "allocator.cost": "allocator.evaluate.cost",
    "allocator.cost_profile": "allocator.profile",
    "allocator.distributed": "allocator.parallel",
    "allocator.explain": "allocator.report.explain",
    "allocator.flops": "allocator.model.flops",
    "allocator.generation": "allocator.model.generation",
    "allocator.graph": "allocator.model",
    "allocator.graph.model": "allocator.model.graph",
    "allocator.graph.no_split": "allocator.model.no_split",
    "allocator.graph.read": "allocator.model.read",
    "allocator.graph.sizes": "allocator.model.sizes",
    "allocator.graph.table": "allocator.model.table",
    "allocator.graph.ties": "allocator.model.ties",
    "allocator.hf": "allocator.integrations.transformers",
    "allocator.introspect": "allocator.model.blocks",
    "allocator.kernels": "allocator.evaluate.kernels",
    "allocator.kit": "allocator.strategies.kit",
    "allocator.partition": "allocator.search.partition",
    "allocator.quantization": "allocator.model.quantization",
    "allocator.rules": "allocator.rules.dispatch",
    "allocator.runs": "allocator.evaluate.runs",
    "allocator.runtime": "allocator.evaluate.memory",
    "allocator.units": "allocator.evaluate.units",
    "allocator.validate": "allocator.evaluate.validate",
    "allocator.zoo": "allocator.model.zoo",
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return super().find_class(MOVED.get(module, module), name)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path, "rb") as fh:
        a = _Unpickler(fh).load()
    with open(b_path, "rb") as fh:
        b = _Unpickler(fh).load()
    keys = sorted(set(a) | set(b), key=str)
    exact = [k for k in keys if a.get(k, "<missing>") != b.get(k, "<missing>")]
    differ = [k for k in exact if not _close(a.get(k, "<missing>"), b.get(k, "<missing>"))]
    kinds = {}
    for k in keys:
        kinds[k[0]] = kinds.get(k[0], 0) + 1
    print(f"{len(keys)} records {kinds}; {len(differ)} differ ({len(exact) - len(differ)} more only in the last "
          "digits of estimated seconds: within 1e-9 relative or 1 ps)")
    for k in differ[:20]:
        print("DIFF", k)
        print("  before:", str(a.get(k, "<missing>"))[:600])
        print("  after: ", str(b.get(k, "<missing>"))[:600])
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="pickle to write")
    parser.add_argument("--trees", type=int, default=300)
    parser.add_argument("--no-zoo", action="store_true")
    parser.add_argument("--models", default="", help="zoo models to run, comma-separated (all when omitted)")
    parser.add_argument("--zoo-also", default="", help="more strategies to run over the zoo, comma-separated "
                        "(e.g. auto,ilp,balanced)")
    parser.add_argument("--explain", action="store_true", help="record Plan.explain() over the zoo too")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    with open(args.out, "wb") as fh:
        pickle.dump(run(args), fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
