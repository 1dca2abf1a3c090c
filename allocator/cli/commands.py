"""The commands: ``allocator plan`` (and ``plan --list``), ``allocator demo`` and ``allocator profile``. Each takes
the parsed arguments, prints its report on stdout and returns the exit status; errors are raised, typed, and turned
into one line by :func:`allocator.cli.main.main`."""

from __future__ import annotations

import dataclasses
import json
import os

from ..api import plan
from ..errors import AllocatorError, InvalidModel, InvalidOption, one_line
from ..model import as_dtype, zoo
from ..model.checkpoint import kept_in_float32
from ..model.load import did_you_mean, load_model
from ..problem import build_problem
from ..profile import Profile
from ..strategies import resolve
from .arguments import check_writable, load_profile, parse_generation, parse_inputs, parse_max_memory
from .render import (
    align, align_left, budget_spec, compare_text, device_table, dtype_line, dtype_name, format_size,
    generation_table, plot_plans, quantity, quantization_line, side_by_side,
)

__all__ = ["BASELINE", "DEMO_SCENARIOS", "cmd_plan", "cmd_demo", "cmd_profile", "list_examples"]


BASELINE = "sequential"
"""The strategy that reproduces accelerate's ``infer_auto_device_map`` output for output."""


DEMO_SCENARIOS: dict[str, dict] = {
    "one GPU at 60% of the model, RAM for the rest": {0: 0.60, "cpu": 1.0},
    "two GPUs at 15% each, RAM at 50%": {0: 0.15, 1: 0.15, "cpu": 0.50},
    "RAM only, 50% of the model (the rest on disk)": {"cpu": 0.50},
}
"""Budgets of ``allocator demo`` as fractions of the model's size."""


def list_examples() -> int:
    rows = [("name", "family", "what it is")] + [(n, e.family, e.description) for n, e in zoo.ZOO.items()]
    print("\n".join(align_left(rows)))
    print("\nallocator plan NAME --max-memory 0=8GiB,cpu=64GiB   (built on the meta device; nothing is downloaded)")
    return 0


def cmd_plan(args) -> int:
    if args.list:
        return list_examples()
    if args.source is None:
        raise InvalidOption("plan needs a SOURCE: a model folder, a config.json or a built-in example "
                            "(see 'allocator plan --list').")
    max_memory = parse_max_memory(args.max_memory) if args.max_memory is not None else None
    resolve(args.strategy)
    if args.dtype is not None:
        as_dtype(args.dtype, "--dtype")
    profile = load_profile(args.profile) if args.profile else None
    generation = parse_generation(args.generation) if args.generation is not None else None
    inputs = parse_inputs(args.inputs) if args.inputs is not None else "auto"   # PlanOptions' default
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    loaded = load_model(args.source, trust_remote_code=args.trust_remote_code)
    dtype = args.dtype or loaded.dtype
    kept, patterns = kept_in_float32(loaded.model, dtype)  # from_pretrained's _keep_in_fp32_modules(_strict)
    options = dict(dtype=dtype, profile=profile, generation=generation, special_dtypes=kept or None, inputs=inputs,
                   optimize=args.optimize)
    if loaded.quantization is not None:
        options.update(size_fn=loaded.quantization.size_fn, hf_quantizer=loaded.quantization.hf_quantizer)
    ours = plan(loaded.model, max_memory, strategy=args.strategy, objective=args.objective, strict=True, **options)
    print(f"{loaded.source}")
    print(f"{ours.problem.graph.model_class}: {format_size(ours.problem.graph.total)}"
          f"{f' in {dtype_name(dtype)}' if dtype else ''}{f'; bandwidths from {args.profile}' if profile else ''}")
    print(dtype_line(args.dtype, loaded) + (f"; {len(kept)} tensors kept in float32, as from_pretrained keeps "
                                             f"{', '.join(patterns)}" if kept else ""))
    if loaded.quantization is not None:
        print(quantization_line(loaded.quantization, dtype, ours))
    if ours.problem.flops is not None:
        print(ours.compute_term())
        if len(ours.problem.steps) > 1:
            print(f"{ours.per_step()}; the plan minimises the {args.optimize}")
    if max_memory is None:
        print(f"budgets: the default, this machine's free memory now ({budget_spec(ours.problem.budgets)}); "
              f"plan for another machine with --max-memory, e.g. 0=24GiB,cpu=64GiB")
    print()
    print(device_table(ours))
    if generation is not None:
        print()
        print(generation_table(ours))
    if args.explain:
        print()
        print(ours.explain())
    plans = {f"allocator ({ours.strategy})": ours}
    if args.compare:
        theirs = _baseline(loaded.model, max_memory, options)
        print()
        if isinstance(theirs, AllocatorError):
            print(f"accelerate (strategy {BASELINE}) finds no map: {one_line(theirs)}")
        else:
            print(f"accelerate's infer_auto_device_map (strategy {BASELINE}, reproduced output for output):")
            print(device_table(theirs))
            if generation is not None:
                print()
                print(generation_table(theirs))
            print()
            print(compare_text(ours, theirs, violations=False))
            plans = {"accelerate": theirs, **plans}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(ours.device_map, fh, indent=1)
        print(f"\ndevice map written to {args.json} (pass it as device_map= to from_pretrained or dispatch_model)")
    if args.plot:
        plot_plans(plans, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _baseline(model, max_memory, options):
    """accelerate's plan, or the error saying it finds none (a valid outcome to report, not a failure)."""
    try:
        return plan(model, max_memory, strategy=BASELINE, **options)
    except AllocatorError as err:
        return err


def cmd_demo(args) -> int:
    resolve(args.strategy)
    if args.model not in zoo.ZOO:
        raise InvalidModel(f"unknown built-in example {args.model!r}; see 'allocator plan --list'."
                           f"{did_you_mean(args.model)}")
    model = zoo.build(args.model)
    total = build_problem(model, {"cpu": 0}).graph.total
    print(f"allocator demo: {args.model}, {format_size(total)} in float32 ({zoo.ZOO[args.model].description}),")
    print("built on the meta device. accelerate's infer_auto_device_map against allocator's plan, per budget.")
    for title, shares in DEMO_SCENARIOS.items():
        budget = {d: int(total * f) for d, f in shares.items()}
        spec = ",".join(f"{d}={format_size(b).replace(' ', '')}" for d, b in budget.items())
        print(f"\n== {title}   (--max-memory {spec})")
        try:
            ours = plan(model, budget, strategy=args.strategy, strict=True)
        except AllocatorError as err:
            print(f"allocator finds no map: {one_line(err)}")
            continue
        theirs = _baseline(model, budget, {})
        if isinstance(theirs, AllocatorError):
            print(device_table(ours))
            print(f"accelerate finds no map: {one_line(theirs)}")
            continue
        print(side_by_side(ours, theirs))
        print(compare_text(ours, theirs))
    gpu, ram = (format_size(int(f * total)).replace(" ", "") for f in (0.4, 2))
    print(f"\nNext: allocator plan {args.model} --max-memory 0={gpu},cpu={ram} --compare --plot plan.png; "
          f"allocator plan --list{'' if args.model == 'segformer-b0' else '; allocator demo --model segformer-b0'}")
    return 0


def cmd_profile(args) -> int:
    check_writable(args.out, "--out")
    if args.folder is not None and not os.path.isdir(args.folder):
        raise InvalidOption(f"--folder {args.folder} is not a folder; give an existing one on the disk to measure.")
    measured = Profile.measure(folder=args.folder)
    rows = [("field", "value", "")]
    for field in dataclasses.fields(Profile):
        if field.name == "spread":
            continue
        value = getattr(measured, field.name)
        spread = measured.spread.get(field.name)
        rows.append((field.name, quantity(field.name, value),
                     "default" if spread is None else f"measured, spread {spread:.0%}"))
    print("\n".join(align(rows)))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(measured.to_dict(), fh, indent=1)
        print(f"\nprofile written to {args.out}; use it with: allocator plan SOURCE --profile {args.out}")
    return 0
