"""The commands: ``allocator plan`` (and ``plan --list``), ``allocator demo`` and ``allocator profile``. Each takes
the parsed arguments, prints its report on stdout and returns the exit status; errors are raised, typed, and turned
into one line by :func:`allocator.cli.main.main`."""

from __future__ import annotations

import dataclasses
import json
import os

from ..api import plan
from ..fit import fit
from ..errors import AllocatorError, InfeasiblePlacement, InvalidModel, InvalidOption, one_line
from ..model import as_dtype, zoo
from ..model.checkpoint import kept_in_float32
from ..model.load import did_you_mean, load_model
from ..report.explain import unbudgeted_ram
from ..report.plan import Plan
from ..report.schema import SCHEMA, read
from ..problem import build_problem
from ..profile import Profile
from ..strategies import resolve
from .arguments import (
    check_expert_cache, check_writable, load_expert_profile, load_profile, parse_generation, parse_inputs,
    parse_max_memory, warn_absent_accelerators,
)
from .moe import runtime_report
from .status import Status
from .render import (
    align, align_left, budget_spec, compare_text, device_table, dtype_line, dtype_name, empty_accelerators,
    format_size,
    generation_table, plot_plans, quantity, quantization_line, side_by_side,
)

__all__ = ["BASELINE", "DEMO_SCENARIOS", "cmd_plan", "cmd_fit", "cmd_demo", "cmd_profile", "list_examples"]


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


def planned_model(args, status: Status):
    """The model ``args.source`` built on the meta device, and the options its plans are made with: the dtype
    (``--dtype``, else the one ``from_pretrained`` would load), the tensors ``from_pretrained`` keeps in float32,
    the quantization's sizes, and ``--profile``, ``--inputs`` and ``--optimize`` where the command has them."""
    dtype = as_dtype(args.dtype, "--dtype") if args.dtype is not None else None
    profile = load_profile(args.profile) if getattr(args, "profile", None) else None
    inputs = parse_inputs(args.inputs) if getattr(args, "inputs", None) is not None else "auto"  # PlanOptions' default
    status.say(f"building {args.source} on the meta device (nothing is downloaded)...")
    loaded = load_model(args.source, trust_remote_code=args.trust_remote_code)
    dtype = dtype or loaded.dtype
    kept, patterns = kept_in_float32(loaded.model, dtype)  # from_pretrained's _keep_in_fp32_modules(_strict)
    options = dict(dtype=dtype, profile=profile, special_dtypes=kept or None, inputs=inputs,
                   optimize=getattr(args, "optimize", "prefill"))
    if loaded.quantization is not None:
        options.update(size_fn=loaded.quantization.size_fn, hf_quantizer=loaded.quantization.hf_quantizer)
    return loaded, options, patterns


def cmd_plan(args) -> int:
    if args.list:
        return list_examples()
    if args.source is None:
        raise InvalidOption("plan needs a SOURCE: a model folder, a config.json or a built-in example "
                            "(see 'allocator plan --list').")
    if args.from_json is not None and args.max_memory is not None:
        raise InvalidOption("--from-json checks a saved plan under the budgets it was made with; drop --max-memory "
                            "(or plan again without --from-json).")
    _check_runtime_flags(args)
    saved = read_saved(args.from_json) if args.from_json is not None else None
    max_memory = parse_max_memory(args.max_memory) if args.max_memory is not None else None
    resolve(args.strategy)
    generation = parse_generation(args.generation) if args.generation is not None else None
    if args.json != "-":
        check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    status = Status(enabled=not args.quiet)
    loaded, options, patterns = planned_model(args, status)
    warn_absent_accelerators(max_memory)   # once the source is known to be good: its error comes alone
    options["generation"] = generation
    if saved is not None:
        status.say(f"checking the plan of {args.from_json} against the model...")
        keep = {k: v for k, v in options.items() if k in ("size_fn", "hf_quantizer")}
        ours = Plan.from_dict(saved, loaded.model, **keep)
    else:
        status.say(f"planning {args.source}...")
        runtime = dict(runtime=args.runtime, prefetch=args.prefetch, expert_profile=(
            load_expert_profile(args.expert_profile, loaded.model) if args.expert_profile is not None else None))
        if args.expert_cache:
            runtime["expert_cache"] = check_expert_cache(args.expert_cache, loaded.model)
        try:
            ours = plan(loaded.model, max_memory, strategy=args.strategy, objective=args.objective, strict=True,
                        **options, **runtime)
        except InfeasiblePlacement as err:
            raise _with_tokens(err, loaded.model, max_memory, options, args.strategy) from None
    theirs = _baseline(loaded.model, max_memory, options) if args.compare and saved is None else None
    status.clear()
    if args.json == "-":
        print(json.dumps(ours.to_dict(), indent=1))
        return 0
    _report(args, loaded, ours, patterns, max_memory is None and saved is None)
    plans = {f"allocator ({ours.strategy})": ours}
    if theirs is not None:
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
            json.dump(ours.to_dict(), fh, indent=1)
        print(f"\nplan written to {args.json} (schema {SCHEMA}; its \"device_map\" is what from_pretrained and "
              f"dispatch_model take as device_map=)")
    if args.plot:
        plot_plans(plans, args.plot)
        print(f"plot written to {args.plot}")
    if saved is not None and ours.violations:
        print(f"\nthe saved plan breaks {len(ours.violations)} runtime rule(s) on this model (listed above)")
        return 1
    return 0


def _check_runtime_flags(args) -> None:
    """``--expert-profile``, ``--prefetch`` and ``--expert-cache`` say what our runtime does: they need ``--runtime
    allocator``; a saved plan (``--from-json``) carries its runtime."""
    given = [flag for flag, value in (("--expert-profile", args.expert_profile), ("--prefetch", args.prefetch),
                                      ("--expert-cache", args.expert_cache)) if value is not None]
    if args.from_json is not None and (given or args.runtime != "accelerate"):
        raise InvalidOption(f"--from-json checks a saved plan with the runtime it was made for; drop "
                            f"{' and '.join(given or ['--runtime'])} (or plan again without --from-json).")
    if given and args.runtime != "allocator":
        raise InvalidOption(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --runtime allocator: "
                            "they say what allocator's offload runtime does (accelerate's hooks keep experts with "
                            "their module and prefetch nothing).")
    if args.prefetch is not None and args.prefetch < 0:
        raise InvalidOption(f"--prefetch is a number of offloaded modules made ready ahead, 0 or more, got "
                            f"{args.prefetch}; e.g. --prefetch 1.")
    if args.expert_cache is not None and args.expert_cache < 0:
        raise InvalidOption(f"--expert-cache is a number of routed experts kept on the main device, 0 or more, got "
                            f"{args.expert_cache}; e.g. --expert-cache 96.")


def cmd_fit(args) -> int:
    """``allocator fit``: the longest context (``--batch``: the largest batch at ``--context``) with the whole model on
    the accelerators, what bounds it, its plan, and with ``--target`` the plan that offloads for a longer one."""
    if args.batch and args.context is None:
        raise InvalidOption("--batch searches the largest batch for a given context: add --context TOKENS, e.g. "
                            "--context 8192.")
    if args.context is not None and not args.batch:
        raise InvalidOption("--context fixes the context for --batch; without --batch, fit searches the context "
                            "itself (use --batch-size for its batch).")
    if not 0 <= args.margin < 1:
        raise InvalidOption(f"--margin is the fraction of each budget kept free, in [0, 1), got {args.margin}; "
                            "e.g. --margin 0.1.")
    max_memory = parse_max_memory(args.max_memory)
    resolve(args.strategy)
    if args.json != "-":
        check_writable(args.json, "--json")
    status = Status(enabled=not args.quiet)
    loaded, options, _ = planned_model(args, status)
    options["runtime"] = args.runtime
    warn_absent_accelerators(max_memory)
    status.say(f"searching the longest context of {args.source}...")
    try:
        found = fit(loaded.model, max_memory, batch_size=args.batch_size, max_length=args.context,
                    target=args.target, margin=args.margin, limit_positions=args.limit_positions,
                    strategy=args.strategy, **options)
    finally:
        status.clear()
    if args.json == "-":
        print(json.dumps(_fit_dict(found), indent=1))
        return 0
    print(loaded.source)
    if loaded.shape:
        print(f"{loaded.model.__class__.__name__}: {loaded.shape}")
    print(f"{loaded.model.__class__.__name__} in {dtype_name(options['dtype']) if options['dtype'] else 'its dtype'}; "
          f"budgets {args.max_memory}; {found.tries} budgets checked")
    print(found.summary())
    for title, shown in ((f"plan at {found.max_length:,} tokens, batch {found.batch_size}", found.plan),
                         (f"plan for --target {args.target:,}" if args.target else "", found.longer)):
        if shown is not None:
            print(f"\n{title}:")
            print(device_table(shown))
            print(generation_table(shown))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(_fit_dict(found), fh, indent=1)
        print(f"\nwritten to {args.json}")
    return 0


def _fit_dict(found) -> dict:
    """The fit as JSON: the answer, its bound, and the plans (schema of :meth:`allocator.Plan.to_dict`)."""
    return {"max_length": found.max_length, "batch_size": found.batch_size, "searched": found.searched,
            "device": found.device, "term": found.term, "reason": found.reason, "margin": found.margin,
            "positions": dict(zip(("name", "value"), found.positions)), "target": found.target,
            "attention": found.attention, "split_length": found.split_length, "split_map": found.split_map,
            "plan": found.plan.to_dict() if found.plan is not None else None,
            "longer": found.longer.to_dict() if found.longer is not None else None}


def _with_tokens(err: InfeasiblePlacement, model, max_memory, options: dict, strategy) -> InfeasiblePlacement:
    """A plan with a generation budget that fails says how many tokens fit on the accelerators at that batch."""
    generation = options["generation"]
    if generation is None:
        return err
    try:
        found = fit(model, max_memory, batch_size=generation.batch_size, strategy=strategy,
                    **{k: v for k, v in options.items() if k != "generation"})
    except AllocatorError:   # no accelerator budget, or a cache allocator does not model: the error as it was
        return err
    if not found.max_length:
        return err
    return InfeasiblePlacement(f"{err} With the whole model on the accelerators at most {found.max_length:,} tokens "
                               f"fit at batch {generation.batch_size} (--generation {generation.batch_size},"
                               f"{found.max_length}); 'allocator fit' says more.", device=err.device,
                               minimum=err.minimum)


def read_saved(path: str) -> dict:
    """The JSON object in ``path`` (``--from-json``), checked against the plan schema."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except ValueError as err:
        raise InvalidOption(f"--from-json {path} is not a JSON file ({one_line(err)}); write one with "
                            f"'allocator plan MODEL --json FILE'.") from None
    read(data)
    return data


def _report(args, loaded, ours, patterns, default_budgets: bool) -> None:
    """The report of ``allocator plan``: where the model came from, its size and dtype, the device table, why each
    empty accelerator holds nothing, the generation table and (``--explain``) the plan's story."""
    options = ours.problem.options
    dtype, kept = options.dtype, options.special_dtypes or {}
    print(f"{loaded.source}")
    print(f"{ours.problem.graph.model_class}: {f'{loaded.shape}; ' if loaded.shape else ''}"
          f"{format_size(ours.problem.graph.total)}"
          f"{f' in {dtype_name(dtype)}' if dtype else ''}"
          f"{f'; bandwidths from {args.profile}' if options.profile is not None and args.profile else ''}")
    print(dtype_line(args.dtype, loaded) + (f"; {len(kept)} tensors kept in float32, as from_pretrained keeps "
                                             f"{', '.join(patterns)}" if kept else ""))
    if loaded.quantization is not None:
        print(quantization_line(loaded.quantization, dtype, ours))
    if ours.problem.flops is not None:
        print(ours.compute_term())
        if len(ours.problem.steps) > 1:
            print(f"{ours.per_step()}; the plan minimises the {options.optimize}")
    if default_budgets:
        print(f"budgets: the default, this machine's free memory now ({budget_spec(ours.problem.budgets)}); "
              f"plan for another machine with --max-memory, e.g. 0=24GiB,cpu=64GiB")
    if args.from_json is not None:
        print(f"plan read from {args.from_json} and checked against this model under its budgets "
              f"({budget_spec(ours.problem.budgets)})")
    print()
    print(device_table(ours))
    for line in empty_accelerators(ours):
        print(line)
    unbudgeted = unbudgeted_ram(ours)
    if unbudgeted:
        print(unbudgeted)
    if ours.problem.generation is not None:
        print()
        print(generation_table(ours))
    if ours.runtime.streams:
        print()
        print(runtime_report(ours, loaded.model))
    if args.explain:
        print()
        print(ours.explain())


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
