"""GPU benchmark: our plan against transformers' ``device_map="auto"`` on a real accelerator, in one command.

Three random llama-like models of different shapes (wide layers, many thin layers, a 128k vocabulary whose
``lm_head`` is the largest layer) are sized to the machine: each is about ``--model-gib`` GiB in bfloat16, less
where GPU memory, RAM or disk are short. Each is built on the GPU, saved with ``save_pretrained`` (safetensors)
to a temporary folder, and for GPU budgets of 30/50/70 % of the model (``{0: f * total, "cpu": 2 * total}``)
loaded twice by ``from_pretrained``: with ``device_map="auto"`` and with ``allocator.plan(meta_twin,
budget).device_map``. Per load: median latency of 20 forwards after 3 warm-ups (batch 1, 32 tokens,
``torch.cuda.synchronize`` around each), ``torch.cuda.max_memory_allocated`` over the forwards (reset after
loading), the memory allocated after loading, the bytes the map keeps on GPU 0, and the peak on GPU 0 that
``allocator`` predicts for the map (``plan.peak[0]`` for ours; :func:`allocator.validate.check` for auto's).

Built to finish within 8 minutes on one GPU: configurations left when ``--time-limit`` seconds have passed are
reported as skipped. Writes ``gpu.csv`` and ``gpu.md`` into ``--out``.

    python benchmarks/gpu.py              # on a machine with a CUDA GPU
    python benchmarks/gpu.py --dry-run    # anywhere, in seconds: tiny models, the CPU as the device, disk offload
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import importlib.metadata
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import allocator
from allocator.runtime import tensor_devices
from allocator.validate import check

OUT = Path(__file__).parent / "results"
BUDGETS = (0.3, 0.5, 0.7)
METHODS = ("auto", "ours")

# name -> llama config fields without num_hidden_layers (chosen to reach the target size), and a description.
SHAPES = {
    "llama-wide": (dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8,
                        vocab_size=32000), "4096 wide, few layers"),
    "llama-deep": (dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                        vocab_size=32000), "1024 wide, many layers"),
    "llama-vocab": (dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
                         vocab_size=128256), "128k vocabulary: lm_head is the largest layer"),
}
# Dry run: the same shapes, 16x narrower.
DRY_SHAPES = {
    "llama-wide": dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2000),
    "llama-deep": dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2000),
    "llama-vocab": dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=4000),
}


def _config(fields: dict, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**fields, num_hidden_layers=layers, max_position_embeddings=256, tie_word_embeddings=False)


def _meta(config, dtype):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)


def _bytes(model) -> int:
    return allocator.build_problem(model, {"cpu": 0}).graph.total


def size_config(fields: dict, target: int, dtype):
    """A config with as many layers as bring the model closest to ``target`` bytes (at least one layer)."""
    one, two = _bytes(_meta(_config(fields, 1), dtype)), _bytes(_meta(_config(fields, 2), dtype))
    per_layer, fixed = two - one, one - (two - one)
    layers = max(1, round((target - fixed) / per_layer))
    return _config(fields, layers), layers


def model_target_bytes(args) -> tuple[int, str]:
    """Bytes per model: ``--model-gib``, less where the GPU, RAM or disk is short; and why."""
    want = int(args.model_gib * 2**30)
    limits = {"--model-gib": want}
    if not args.dry_run:
        free, _ = torch.cuda.mem_get_info(0)
        limits["40% of free GPU memory"] = int(0.4 * free)  # built on the GPU, then the largest budget (70%) fits
    try:
        import psutil

        limits["25% of available RAM"] = int(0.25 * psutil.virtual_memory().available)
    except ImportError:
        pass
    limits["30% of free disk / 3"] = int(0.3 * shutil.disk_usage(tempfile.gettempdir()).free / 3)
    reason = min(limits, key=limits.get)
    return limits[reason], reason


# --------------------------------------------------------------------------------------------------------------
# Measurements.

def _quiet() -> None:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class Device:
    """The device under test: ``cuda:0`` with its memory counters, or (dry run) the CPU with none."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.key = "cpu" if dry_run else 0
        self.name = "cpu (dry run)" if dry_run else torch.cuda.get_device_name(0)

    def sync(self) -> None:
        if not self.dry_run:
            torch.cuda.synchronize()

    def reset(self) -> int | None:
        """Free what the last load left and zero the peak counter; the bytes still allocated (GPU only)."""
        if self.dry_run:
            return None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int | None:
        return None if self.dry_run else torch.cuda.max_memory_allocated()

    def allocated(self) -> int | None:
        return None if self.dry_run else torch.cuda.memory_allocated()

    def budget(self, f: float, total: int) -> dict:
        # Dry run: the CPU is main and the rest goes to disk, as on a machine without an accelerator.
        return {"cpu": int(f * total)} if self.dry_run else {0: int(f * total), "cpu": 2 * total}


def run_load(path, device_map, budget, device: Device, inputs, args, offload) -> dict:
    """Load once, time forwards, read memory; ``status`` says what went wrong if anything did."""
    from transformers import LlamaForCausalLM

    model = None
    base = device.reset()
    try:
        model = LlamaForCausalLM.from_pretrained(path, dtype=args.dtype, device_map=device_map,
                                                 max_memory=dict(budget), offload_folder=offload).eval()
        loaded_map = dict(getattr(model, "hf_device_map", {}))
        after_load = device.allocated()
        times = []
        with torch.no_grad():
            for _ in range(args.warmup):
                model(**inputs)
            device.sync()
            if not device.dry_run:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.forwards):
                device.sync()
                start = time.perf_counter()
                model(**inputs)
                device.sync()
                times.append(time.perf_counter() - start)
        peak = device.peak()
        return dict(status="ok", device_map=loaded_map, times=times,
                    after_load=None if after_load is None else after_load - base,
                    peak=None if peak is None else peak - base)
    except torch.cuda.OutOfMemoryError as err:
        return dict(status=f"out of memory: {str(err).splitlines()[0][:120]}", device_map=None, times=[],
                    after_load=None, peak=None)
    finally:
        del model  # collected by the next load's reset


def measure(args, device: Device, workdir: Path, deadline: float) -> tuple[list[dict], dict]:
    target, reason = (int(args.dry_model_mib * 2**20), "dry run") if args.dry_run else model_target_bytes(args)
    info = {"target_bytes": target, "target_reason": reason}
    rows = []
    gen = torch.Generator().manual_seed(0)
    inputs_cpu = {"input_ids": torch.randint(0, 2000, (1, args.tokens), generator=gen)}
    inputs = {k: v.to("cpu" if device.dry_run else "cuda:0") for k, v in inputs_cpu.items()}
    for name in args.models:
        fields = DRY_SHAPES[name] if args.dry_run else SHAPES[name][0]
        config, layers = size_config(fields, target, args.dtype)
        meta = _meta(config, args.dtype)
        total = _bytes(meta)
        path = str(workdir / name)
        if time.time() > deadline:
            rows += [_skipped(name, layers, total, f, m, device) for f in args.budgets for m in METHODS]
            continue
        start = time.perf_counter()
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device("cpu" if device.dry_run else "cuda:0"):  # random init on the GPU: seconds, not minutes
            AutoModelForCausalLM.from_config(config, dtype=args.dtype).save_pretrained(path)
        device.reset()
        print(f"{name}: {total / 2**30:.2f} GiB, {layers} layers, built and saved in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        for i, f in enumerate(args.budgets):
            budget = device.budget(f, total)
            problem = allocator.build_problem(meta, dict(budget))
            try:
                plan, no_plan = allocator.plan(meta, dict(budget)), None
            except allocator.InfeasiblePlacement as err:  # possible in a dry run: the CPU main must hold lm_head
                plan, no_plan = None, f"no plan: needs {err.minimum} B on {err.device!r}"
            order = METHODS if i % 2 == 0 else METHODS[::-1]
            for method in order:
                if time.time() > deadline:
                    rows.append(_skipped(name, layers, total, f, method, device))
                    continue
                if method == "ours" and plan is None:
                    rows.append(_row(name, layers, total, f, method, budget, problem, None, dict(
                        status=no_plan, device_map=None, times=[], after_load=None, peak=None), device))
                    continue
                with tempfile.TemporaryDirectory(dir=workdir) as offload:
                    result = run_load(path, "auto" if method == "auto" else plan.device_map, budget, device,
                                      inputs, args, offload)
                rows.append(_row(name, layers, total, f, method, budget, problem, plan, result, device))
                print(f"{name} {f:.0%} {method}: {rows[-1]['status']}, {rows[-1]['median_ms'] or '—'} ms",
                      file=sys.stderr, flush=True)
        shutil.rmtree(path, ignore_errors=True)
    return rows, info


def _skipped(name, layers, total, f, method, device) -> dict:
    row = _row(name, layers, total, f, method, device.budget(f, total), None, None,
               dict(status="skipped: time limit", device_map=None, times=[], after_load=None, peak=None), device)
    return row


def _row(name, layers, total, f, method, budget, problem, plan, result, device) -> dict:
    key = device.key
    device_map = result["device_map"]
    resident = predicted = valid = ""
    if problem is not None and device_map:
        g = problem.graph
        resident = sum(t.counted for t, d in zip(g.tensors, tensor_devices(g, device_map)) if d == key)
        violations, memory = check(problem, device_map)
        predicted, valid = memory.peak.get(key, 0), not violations
    times = result["times"]
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    return dict(
        model=name, layers=layers, model_bytes=total, budget=f"{f:.2f}", device_budget_bytes=budget[key],
        method=method, strategy=(plan.strategy if plan else "") if method == "ours" else "transformers-auto",
        status=result["status"], matches_plan=(device_map == plan.device_map) if method == "ours" and plan and
        device_map else "", resident_device_bytes=resident, predicted_peak_bytes=predicted, valid=valid,
        measured_peak_bytes="" if result["peak"] is None else result["peak"],
        after_load_bytes="" if result["after_load"] is None else result["after_load"],
        within_budget="" if result["peak"] is None else result["peak"] <= budget[key],
        n=len(times), median_ms=f"{statistics.median(times) * 1e3:.2f}" if times else "",
        q1_ms=f"{q[0] * 1e3:.2f}" if times else "", q3_ms=f"{q[2] * 1e3:.2f}" if times else "",
    )


# --------------------------------------------------------------------------------------------------------------
# Report.

def table(rows, dry_run: bool) -> str:
    unit = "MiB" if dry_run else "GiB"
    scale = 2**20 if dry_run else 2**30

    def size(n):
        return "—" if n == "" else f"{int(n) / scale:.2f}"

    by = {(r["model"], r["budget"], r["method"]): r for r in rows}
    cells = list(dict.fromkeys((r["model"], r["budget"]) for r in rows))
    lines = [f"| model | budget | on device, auto → ours ({unit}) | auto ms [IQR] | ours ms [IQR] | auto / ours | "
             f"peak measured / predicted, auto ({unit}) | peak measured / predicted, ours ({unit}) | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, budget in cells:
        a, o = by[model, budget, "auto"], by[model, budget, "ours"]

        def lat(r):
            return f"{r['median_ms']} [{r['q1_ms']}–{r['q3_ms']}]" if r["median_ms"] else "—"

        both = a["median_ms"] and o["median_ms"]
        ratio = f"**{float(a['median_ms']) / float(o['median_ms']):.2f}×**" if both else "—"
        status = "ok" if a["status"] == o["status"] == "ok" else f"auto: {a['status']}; ours: {o['status']}"
        over = {m: " (over budget)" if r["within_budget"] is False else "" for m, r in (("a", a), ("o", o))}
        lines.append(
            f"| {model} ({size(a['model_bytes'])} {unit}, {a['layers']} layers) | {float(budget):.0%} = "
            f"{size(a['device_budget_bytes'])} | {size(a['resident_device_bytes'])} → "
            f"{size(o['resident_device_bytes'])} | "
            f"{lat(a)} | {lat(o)} | {ratio} | {size(a['measured_peak_bytes'])} / {size(a['predicted_peak_bytes'])}"
            f"{over['a']} | {size(o['measured_peak_bytes'])} / {size(o['predicted_peak_bytes'])}{over['o']} | "
            f"{status} |")
    return "\n".join(lines)


def report(rows, info, args, device: Device, command, seconds) -> str:
    ok = [(a, o) for a in rows for o in rows if a["method"] == "auto" and o["method"] == "ours"
          and (a["model"], a["budget"]) == (o["model"], o["budget"]) and a["median_ms"] and o["median_ms"]]
    wins = sum(1 for a, o in ok if float(o["median_ms"]) < float(a["median_ms"]))
    differ = [(a, o) for a, o in ok if a["resident_device_bytes"] != o["resident_device_bytes"]]
    wins_differ = sum(1 for a, o in differ if float(o["median_ms"]) < float(a["median_ms"]))
    cuda = "" if device.dry_run else f", CUDA {torch.version.cuda}"
    parts = [
        "# GPU benchmark: our plan vs transformers `device_map=\"auto\"`" + (" — DRY RUN (CPU, tiny models)" if
                                                                            args.dry_run else "") + "\n",
        f"`{command}` — {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {seconds:.0f} s. Device: "
        f"{device.name}; {os.cpu_count()} CPU cores; torch {torch.__version__}{cuda}, transformers "
        f"{importlib.metadata.version('transformers')}, accelerate {importlib.metadata.version('accelerate')}; "
        f"{str(args.dtype).removeprefix('torch.')}.\n",
        f"Models of about {info['target_bytes'] / 2**30:.2f} GiB ({info['target_reason']}). Budgets: "
        + ("`{'cpu': f * total}` — the CPU is the main device, the rest is on disk (dry run). " if args.dry_run else
           "`{0: f * total, 'cpu': 2 * total}`. ")
        + f"{args.warmup} warm-up and {args.forwards} timed forwards per load, batch 1, {args.tokens} tokens. "
        "*Peak measured*: `torch.cuda.max_memory_allocated` during the timed forwards minus what was allocated "
        "before loading; *predicted*: the peak `allocator` computes for the map under accelerate's rules.\n",
        table(rows, args.dry_run), "",
        f"Ours faster by the median in {wins}/{len(ok)} measured cells; where the maps keep different bytes on the "
        f"device: {wins_differ}/{len(differ)}.",
    ]
    skipped = [r for r in rows if r["status"].startswith("skipped")]
    if skipped:
        parts.append(f"\n{len(skipped)} loads skipped at the {args.time_limit:.0f} s time limit.")
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU (no accelerator needed)")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS), help="fractions of the model")
    parser.add_argument("--model-gib", type=float, default=3.0, help="target size of each model (GiB)")
    parser.add_argument("--dry-model-mib", type=float, default=2.0, help="target size in a dry run (MiB)")
    parser.add_argument("--forwards", type=int, help="timed forwards per load (default 20; 3 in a dry run)")
    parser.add_argument("--warmup", type=int, help="untimed forwards per load (default 3; 1 in a dry run)")
    parser.add_argument("--tokens", type=int, default=32, help="input length (batch 1)")
    parser.add_argument("--time-limit", type=float, default=420.0,
                        help="seconds after which remaining loads are skipped (default 420: done within 8 minutes)")
    parser.add_argument("--workdir", type=Path, help="where models are saved (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; run on a machine with a GPU, or pass --dry-run")
    args.forwards = args.forwards or (3 if args.dry_run else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    args.dtype = torch.float32 if args.dry_run else torch.bfloat16
    start = time.time()
    if args.dry_run:
        torch.set_num_threads(1)  # tiny matmuls: more threads only spin on a shared machine
    _quiet()
    device = Device(args.dry_run)
    command = " ".join(["python benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        rows, info = measure(args, device, Path(tmp), start + args.time_limit)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "gpu.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = report(rows, info, args, device, command, time.time() - start)
    (args.out / "gpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
