"""The offload runtime as a column: the same map run by accelerate's hooks and by ours (``allocator.offload``).

The four models of ``benchmarks/latency.py`` (llama, T5, ViT, Segformer; float32, random weights) are saved once.
For each RAM budget (30/50/70 % of the model; the CPU is the main device, the rest is streamed from disk), the map
is ``allocator.plan(meta, budget).device_map`` (the default plan, made for accelerate's hooks), loaded by
``from_pretrained`` once per runtime in this one process: one copy keeps accelerate's hooks, one copy per
``--prefetch`` value runs :func:`allocator.offload.attach` (``ours-k``: the kernel's read-ahead of the next ``k``
modules; with ``--thread`` also ``ours-k-thread``: a thread reads their pages in and makes their views ahead). A
copy fully in RAM is the reference: every timed output is compared with it (``torch.equal``).

Forwards take turns (the order rotates at every forward), one thread for torch (the prefetch thread is extra), inputs
fixed, ``torch.no_grad``. Regimes: *warm* (the page cache holds the files after warm-up) and *cold* (before every
forward, outside the timed region: our mappings' pages dropped with ``MADV_DONTNEED``, then
``posix_fadvise(DONTNEED)`` on the checkpoint and offload files, which were fsync'ed). A short greedy ``generate``
(llama, T5) is timed the same way and its tokens compared. The weights our runtime held at once
(``Attached.peak_held``) are reported next to what a plan made for that runtime reserves for the same map
(``check`` under ``PlanOptions(runtime="allocator", prefetch=k)``: streamed chain + prefetch).

    python benchmarks/latency_runtime.py                 # 4 models x 3 budgets, warm and cold, prefetch 0 1 2
    python benchmarks/latency_runtime.py --quick         # fewer forwards
    python benchmarks/latency_runtime.py --smoke         # tiny llama, one budget, 3 forwards (CI smoke)
    python benchmarks/latency_runtime.py --quick --contention 1   # beside one busy core, with RAM and patch() rows

``--contention N`` starts N busy processes (``benchutil.Contention``: a Python spin loop each, pinned to core ``i``
modulo the cores) for the duration of the cells, runs torch on its default threads unless ``--threads`` says
otherwise, and adds two runtimes to the rotation: ``ram`` (the model fully in RAM) and ``ours-patch`` (the path users
take: ``patch(runtime="allocator")`` around ``from_pretrained(device_map="auto")``, with its own plan's map).
``first_generate_ms`` is the first greedy ``generate`` after each runtime's load (models that generate).

Writes ``results/latency_runtime.csv`` and ``results/latency_runtime.md`` (``--out`` for another folder).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import allocator
from allocator import offload
from allocator.evaluate.validate import check

from benchutil import Contention, add_contention_arguments, cores, quiet, write_csv
from latency import Model, _drop_cache, _files, specs

OUT = Path(__file__).parent / "results"
GENERATES = ("llama", "t5")


def _load(model: Model, device_map, budget, folder):
    cls = specs()[model.name][0]
    kwargs = {} if budget is None else {"max_memory": dict(budget), "offload_folder": str(folder)}
    return cls.from_pretrained(model.path, dtype=torch.float32, device_map=device_map, **kwargs).eval()


def _generate_args(model: Model, inputs: dict) -> dict:
    extra = {"decoder_start_token_id": 0} if model.name == "t5" else {}
    return dict(input_ids=inputs["input_ids"], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                eos_token_id=None, **extra)


def _cell(model: Model, f: float, args, workdir: Path) -> list[dict]:
    """One (model, budget): every runtime loaded side by side, forwards taking turns."""
    budget = {"cpu": int(f * model.total)}
    plan = allocator.plan(model.meta, dict(budget))
    inputs = specs()[model.name][2](torch.Generator().manual_seed(0))
    runtimes = ["hooks", *[f"ours-{k}" for k in args.prefetch],
                *([f"ours-{k}-thread" for k in args.prefetch if k] if args.thread else []),
                *(["ram", "ours-patch"] if args.contention else [])]
    first = {}   # runtime -> ms of the first generate after its load (models that generate)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        loaded, attached = {}, {}
        for name in runtimes:
            if name == "ram":
                loaded[name] = _load(model, None, None, None)
            elif name == "ours-patch":   # the path users take: the plan made inside from_pretrained, then attached
                with allocator.patch(runtime="allocator"):
                    loaded[name] = _load(model, "auto", budget, Path(tmp) / name)
                attached[name] = offload.runtime_of(loaded[name])
            else:
                loaded[name] = _load(model, plan.device_map, budget, Path(tmp) / name)
            if name not in ("hooks", "ram", "ours-patch"):
                attached[name] = offload.attach(loaded[name], plan.device_map, prefetch=int(name.split("-")[1]),
                                                device=offload.HostDevice(thread=name.endswith("thread")))
            if model.name in GENERATES or model.name.startswith("tiny-llama"):
                with torch.no_grad():
                    start = time.perf_counter()
                    loaded[name].generate(**_generate_args(model, specs()[model.name][2](
                        torch.Generator().manual_seed(0))))
                    first[name] = round((time.perf_counter() - start) * 1e3, 3)
        reference = _load(model, None, None, None)
        cold_paths = _files(model.path, tmp)
        with torch.no_grad():
            expected = reference(**inputs)
            expected = getattr(expected, "logits", expected)
            tokens = reference.generate(**_generate_args(model, inputs)) if model.name in GENERATES else None
            rows = []
            for regime in args.regimes:
                jobs = [("forward", lambda m: m(**inputs))]
                if tokens is not None and args.generate:
                    jobs.append(("generate", lambda m: m.generate(**_generate_args(model, inputs))))
                for job, run in jobs:
                    times = {name: [] for name in runtimes}
                    equal = {name: True for name in runtimes}
                    for i in range(args.warmup + args.forwards):
                        k = i % len(runtimes)
                        for name in runtimes[k:] + runtimes[:k]:
                            if regime == "cold":
                                for a in attached.values():
                                    a.evict()
                                _drop_cache(cold_paths)
                            start = time.perf_counter()
                            out = run(loaded[name])
                            seconds = time.perf_counter() - start
                            if i >= args.warmup:
                                times[name].append(seconds)
                            got = out if job == "generate" else out.logits
                            equal[name] &= bool(torch.equal(got, tokens if job == "generate" else expected))
                    hooks = statistics.median(times["hooks"])
                    for name in runtimes:
                        med = statistics.median(times[name])
                        row = dict(model=model.name, budget=f, regime=regime, job=job, runtime=name,
                                   median_ms=round(med * 1e3, 3),
                                   speedup=round(hooks / med, 2) if name != "hooks" else 1.0,
                                   equal=equal[name], n=len(times[name]), disk_share=_disk_share(plan),
                                   peak_held="", reserve="", first_generate_ms=first.get(name, ""))
                        if name in attached:
                            runtime = attached[name]
                            problem = allocator.build_problem(model.meta, dict(budget), runtime="allocator",
                                                              prefetch=runtime.prefetch)
                            memory = check(problem, dict(loaded[name].hf_device_map))[1]
                            row.update(peak_held=runtime.peak_held, reserve=memory.streamed + memory.prefetch)
                        rows.append(row)
                    print(f"{model.name} {f:.0%} {regime} {job}: " + ", ".join(
                        f"{r['runtime']} {r['median_ms']} ms" for r in rows[-len(runtimes):]), file=sys.stderr,
                        flush=True)
        for name in attached:
            offload.detach(loaded[name])
    return rows


def _disk_share(plan) -> float:
    g = plan.problem.graph
    on_disk = plan.resident("disk") if "disk" in plan.device_map.values() else 0
    return round(on_disk / g.total, 3) if g.total else 0.0


def report(rows, args, command, seconds) -> str:
    lines = [
        "# Offload runtime: accelerate's hooks against `allocator.offload` on the same map",
        "",
        f"Measured {datetime.date.today().isoformat()} with `{command}` ({seconds:.0f} s) on {platform.machine()}, "
        f"{args.cores} (medians of interleaved runs), torch "
        f"{torch.__version__}, transformers {importlib.metadata.version('transformers')}, accelerate "
        f"{importlib.metadata.version('accelerate')}. One torch thread; CPU main device, the rest streamed from disk. "
        f"{args.forwards} timed runs per cell after {args.warmup} warm-up; `speedup` = hooks median / ours median; "
        "`equal`: every timed output equal (`torch.equal`) to the model fully in RAM (generate: the same tokens). "
        "`peak_held`: offloaded weight our runtime held at once; `reserve`: what a plan made for that runtime "
        "(`runtime=\"allocator\", prefetch=k`) reserves for this map (streamed chain + prefetch). `ours-k`: prefetch "
        "by the kernel's read-ahead (`madvise(MADV_WILLNEED)`) of the next k modules; `ours-k-thread`: a thread "
        "reads their pages in and makes their views ahead (held: counted in peak held).",
        "",
        f"Torch threads {torch.get_num_threads()}; contention: {args.busy}. `first generate ms`: the first greedy "
        "`generate` after the row's load (models that generate). With `--contention`: `ram` is the model fully in "
        "RAM, `ours-patch` the path users take (`patch(runtime=\"allocator\")` around `from_pretrained("
        "device_map=\"auto\")`, its own map), `hooks` what transformers runs (accelerate's hooks).",
        "",
        "| model | RAM | regime | job | runtime | median ms | speedup | equal | peak held | reserve "
        "| first generate ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budget']:.0%} | {r['regime']} | {r['job']} | {r['runtime']} | "
                     f"{r['median_ms']} | {r['speedup']} | {r['equal']} | {r['peak_held']} | {r['reserve']} | "
                     f"{r['first_generate_ms']} |")
    ours = [r for r in rows if r["runtime"].startswith("ours-")]
    lines.append("")
    for regime in args.regimes:
        for job in ("forward", "generate"):
            sel = [r for r in ours if r["regime"] == regime and r["job"] == job]
            if not sel:
                continue
            best = {}
            for r in sel:
                key = (r["model"], r["budget"])
                best[key] = max(best.get(key, 0), r["speedup"])
            at_least = sum(v >= 1.5 for v in best.values())
            lines.append(f"- {regime} {job}: best prefetch per cell {min(best.values())}-{max(best.values())}x "
                         f"({at_least}/{len(best)} cells >= 1.5x); every prefetch value "
                         f"{min(r['speedup'] for r in sel)}-{max(r['speedup'] for r in sel)}x.")
    lines.append(f"- outputs equal to the in-RAM model: {sum(r['equal'] for r in rows)}/{len(rows)} rows; peak held "
                 f"<= reserve: {sum(r['peak_held'] <= r['reserve'] for r in ours)}/{len(ours)} rows.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama", "t5", "vit", "segformer"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    ap.add_argument("--prefetch", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--regimes", nargs="+", default=["warm", "cold"], choices=["warm", "cold"])
    ap.add_argument("--forwards", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-generate", dest="generate", action="store_false")
    ap.add_argument("--thread", action="store_true",
                    help="also ours-k-thread: a prefetch thread reads pages in and makes the views ahead")
    ap.add_argument("--quick", action="store_true", help="7 timed runs per cell")
    ap.add_argument("--smoke", action="store_true", help="tiny llama, one budget, 3 runs, warm (CI)")
    add_contention_arguments(ap, "the cells; adds the rows ram and ours-patch")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.cores = cores()   # before the run loads the machine
    if args.quick:
        args.forwards = 7
    if args.smoke:
        args.models, args.budgets, args.forwards, args.warmup, args.regimes = ["tiny-llama"], [0.5], 3, 1, ["warm"]
    threads = args.threads if args.threads is not None else (0 if args.contention else 1)
    if threads:
        torch.set_num_threads(threads)
    quiet()
    command = "python benchmarks/latency_runtime.py " + " ".join(argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    busy = Contention(args.contention)
    args.busy = busy.describe()
    with tempfile.TemporaryDirectory() as tmp, busy:
        rows = []
        for name in args.models:
            model = Model(name, Path(tmp))
            for f in args.budgets:
                rows += _cell(model, f, args, Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "latency_runtime.csv", rows)
    text = report(rows, args, command.strip(), time.perf_counter() - start)
    (args.out / "latency_runtime.md").write_text(text)
    print(text)
    bad = [r for r in rows if not r["equal"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
