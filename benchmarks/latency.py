"""Latency benchmark: real forwards on this machine, our plan against transformers' ``device_map="auto"``.

Four small random models (llama, T5, ViT, Segformer; float32, 37-60 MB) are saved with ``save_pretrained``. For
each, RAM budgets of 30/50/70 % of the model (``{"cpu": int(f * total)}``: the CPU is the main device, the rest
goes to disk) are loaded by ``from_pretrained`` with the same ``max_memory`` and an offload folder, twice:
``device_map="auto"`` and ``allocator.plan(meta_twin, budget).device_map``. A third load with the whole model in
RAM (no budget) is the reference.

Each load lives in its own process, forked from this one, so that its memory is its own. The processes are
loaded side by side and driven over pipes one forward at a time, taking turns (the order rotates at every
forward), so that the machine's background load falls on all of them alike and every forward of ``auto`` has
a paired forward of ``ours`` taken moments apart. Inputs are fixed, ``torch.no_grad``, one thread.

Two cache regimes per load, after warm-up forwards each:

- *warm*: disk weights come from the page cache after the first forward (a machine with RAM to spare);
- *cold*: ``posix_fadvise(DONTNEED)`` on the checkpoint and offload files before every forward, outside the
  timed region, so that offloaded weights are really read from the disk.

Peak RSS: ``/proc/self/clear_refs`` resets the high-water mark after warm-up; ``VmHWM`` is read after the timed
forwards. Rounds load everything afresh. Writes ``latency.csv`` (one row per configuration) and ``latency.md``.

    python benchmarks/latency.py            # 4 models x 3 budgets, 3 rounds x 12 forwards, warm and cold
    python benchmarks/latency.py --quick    # 50 % budget only, 1 round x 20 forwards, warm only
    python benchmarks/latency.py --smoke    # tiny llama, 1 budget, 3 forwards (CI smoke test)
    python benchmarks/latency.py --accuracy [--quick]   # the cost model's accuracy (benchmarks/accuracy.py)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import allocator
from allocator.evaluate.memory import tensor_devices
from allocator.evaluate.validate import check

from benchutil import Worker, quiet, ram_held, write_csv

OUT = Path(__file__).parent / "results"
BUDGETS = (0.3, 0.5, 0.7)
METHODS = ("auto", "ours")
REFERENCE = "ram"
FULL_MODELS = ("llama", "t5", "vit", "segformer")


def _token_inputs(seq, vocab, decoder=0):
    def make(gen):
        inputs = {"input_ids": torch.randint(0, vocab, (1, seq), generator=gen)}
        if decoder:
            inputs["decoder_input_ids"] = torch.randint(0, vocab, (1, decoder), generator=gen)
        return inputs

    return make


def _pixel_inputs(size):
    return lambda gen: {"pixel_values": torch.randn(1, 3, size, size, generator=gen)}


def specs() -> dict:
    """name -> (model class, config, make_inputs(generator) -> dict). Inputs are small: weights dominate."""
    import transformers as tf

    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=1024, vocab_size=8000, tie_word_embeddings=False), _token_inputs(4, 8000)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(
            d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=8, vocab_size=8000),
            _token_inputs(4, 8000, decoder=2)),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(
            hidden_size=384, num_hidden_layers=8, num_attention_heads=6, intermediate_size=1536, image_size=32,
            patch_size=16, num_labels=1000), _pixel_inputs(32)),
        "segformer": (tf.SegformerForSemanticSegmentation, tf.SegformerConfig(
            hidden_sizes=[64, 128, 320, 512], depths=[2, 2, 2, 2], decoder_hidden_size=256, num_labels=150),
            _pixel_inputs(32)),
        "tiny-llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=1000, tie_word_embeddings=False), _token_inputs(8, 1000)),
    }


# --------------------------------------------------------------------------------------------------------------
# Child process: load one configuration, then run forwards on request.

def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return 1024 * int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _drop_cache(paths) -> None:
    """Ask the kernel to drop the page cache of ``paths`` (pages some process has mapped stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files(*folders) -> list[str]:
    return [str(p) for folder in folders for p in Path(folder).rglob("*") if p.is_file()]


def serve(job: dict, conn) -> None:
    """Child: load ``job['path']`` with ``job['device_map']`` and answer commands until ``stop``.

    Commands: ``("forward", regime)`` -> (wall seconds, thread CPU seconds); ``("reset", None)`` -> RSS before
    the timed forwards; ``("peak", None)`` -> (peak RSS since the reset, exact?).
    """
    try:
        torch.set_num_threads(1)
        quiet()
        cls, _, make_inputs = specs()[job["model"]]
        inputs = make_inputs(torch.Generator().manual_seed(0))
        with tempfile.TemporaryDirectory(dir=job["workdir"]) as offload:
            kwargs = {} if job["max_memory"] is None else {"max_memory": dict(job["max_memory"]),
                                                           "offload_folder": offload}
            model = cls.from_pretrained(job["path"], dtype=torch.float32, device_map=job["device_map"], **kwargs)
            model.eval()
            cold_paths = _files(job["path"], offload)
            conn.send({"device_map": dict(getattr(model, "hf_device_map", {"": "cpu"})), "ram_held": ram_held(model)})
            exact, sampled = False, 0
            with torch.no_grad():
                while True:
                    command, arg = conn.recv()
                    if command == "forward":
                        if arg == "cold":
                            _drop_cache(cold_paths)
                        wall, cpu = time.perf_counter(), time.thread_time()
                        model(**inputs)
                        conn.send((time.perf_counter() - wall, time.thread_time() - cpu))
                        sampled = max(sampled, _status_bytes("VmRSS"))
                    elif command == "reset":
                        sampled = _status_bytes("VmRSS")
                        exact = _reset_peak_rss()
                        conn.send(sampled)
                    elif command == "peak":
                        # Without clear_refs, RSS sampled after each forward: a lower bound of the peak.
                        conn.send((_status_bytes("VmHWM") if exact else sampled, exact))
                    else:
                        break
    except BaseException as err:  # tell the parent instead of dying silently
        conn.send({"error": f"{type(err).__name__}: {err}"})


# --------------------------------------------------------------------------------------------------------------
# Parent: save models, plan, drive the children, aggregate.

class Model:
    """One saved model: its path, meta twin and total counted bytes."""

    def __init__(self, name: str, root: Path):
        cls, config, _ = specs()[name]
        self.name, self.path = name, str(root / name)
        torch.manual_seed(0)
        cls(config).to(torch.float32).eval().save_pretrained(self.path)
        for path in _files(self.path):  # dirty pages ignore posix_fadvise(DONTNEED): write them out now
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        with torch.device("meta"):
            self.meta = cls(config)
        self.total = allocator.build_problem(self.meta, {"cpu": 0}).graph.total


def _run_cell(model: Model, f: float, plan, args, workdir: Path, round_index: int) -> dict:
    """One round of one (model, budget): load every method side by side and take turns forward by forward."""
    budget = {"cpu": int(f * model.total)}
    maps = {"auto": "auto", "ours": plan.device_map, REFERENCE: {"": "cpu"}}
    methods = [*METHODS, *([REFERENCE] if args.reference else [])]
    workers = {}
    try:
        for method in methods:
            workers[method] = Worker(serve, dict(
                model=model.name, path=model.path, budget=f, method=method, device_map=maps[method],
                max_memory=None if method == REFERENCE else budget, workdir=str(workdir), timeout=args.timeout),
                timeout=args.timeout, name=f"{model.name} {method} {f}", stop=("stop", None))
        out = {m: {"device_map": w.loaded["device_map"], "ram_held": w.loaded["ram_held"]} for m, w in workers.items()}
        for regime in args.regimes:
            for _ in range(args.warmup):
                for w in workers.values():
                    w.ask(("forward", regime))
            before = {m: w.ask(("reset", None)) for m, w in workers.items()}
            times = {m: [] for m in methods}
            for i in range(args.forwards):
                k = (i + round_index) % len(methods)
                for method in methods[k:] + methods[:k]:
                    times[method].append(workers[method].ask(("forward", regime)))
            for m, w in workers.items():
                peak, exact = w.ask(("peak", None))
                out[m][regime] = {"wall": [t[0] for t in times[m]], "cpu": [t[1] for t in times[m]],
                                  "rss_increase": peak - before[m], "rss_peak": peak, "exact": exact}
        return out
    finally:
        for w in workers.values():
            w.close()


def sign_test(wins: int, n: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven when either method is as likely to win."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, n - wins) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _quantiles(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def measure(args, workdir: Path) -> list[dict]:
    models = {}
    for name in args.models:
        models[name] = Model(name, workdir)
        print(f"saved {name}: {models[name].total / 1e6:.1f} MB", file=sys.stderr, flush=True)
    cells = [(m, f) for m in args.models for f in args.budgets]
    plans = {}
    for name, f in cells:
        start = time.perf_counter()
        plan = allocator.plan(models[name].meta, {"cpu": int(f * models[name].total)})
        plans[name, f] = (plan, time.perf_counter() - start)
    runs = {cell: [] for cell in cells}
    for r in range(args.rounds):
        for name, f in cells:
            runs[name, f].append(_run_cell(models[name], f, plans[name, f][0], args, workdir, r))
            print(f"round {r + 1}/{args.rounds} {name} {f:.0%}: done", file=sys.stderr, flush=True)
    rows = []
    for name, f in cells:
        rows += _rows(models[name], f, *plans[name, f], runs[name, f], args)
    return rows


def _rows(model: Model, f: float, plan, plan_seconds: float, runs: list, args) -> list[dict]:
    budget = {"cpu": int(f * model.total)}
    problem = allocator.build_problem(model.meta, dict(budget))
    g = problem.graph
    maps = {m: runs[0][m]["device_map"] for m in runs[0]}
    rows = []
    for method in runs[0]:
        device_map = maps[method]
        violations, memory = check(problem, device_map)
        devices = tensor_devices(g, device_map)
        resident = sum(t.counted for t, d in zip(g.tensors, devices) if d == "cpu")
        streamed = [t for t, d in zip(g.tensors, devices) if d == "disk" and t.is_param]  # read at every forward
        row = dict(
            model=model.name, model_bytes=model.total, budget=f"{f:.2f}", budget_bytes=budget["cpu"], method=method,
            strategy={"ours": plan.strategy, "auto": "transformers-auto", REFERENCE: "all in RAM"}[method],
            maps_differ=maps["auto"] != maps["ours"], stable_map=all(run[method]["device_map"] == device_map
                                                                   for run in runs),
            matches_plan=device_map == plan.device_map if method == "ours" else "",
            resident_bytes=resident, resident_share=f"{resident / model.total:.4f}",
            disk_tensors=len(streamed), disk_bytes=sum(t.nbytes for t in streamed),
            ram_held_bytes=runs[0][method]["ram_held"],
            predicted_peak_bytes=memory.peak.get("cpu", 0) if method != REFERENCE else "",
            predicted_streamed_bytes=memory.streamed if method != REFERENCE else "",
            valid=(not violations) if method != REFERENCE else "",
            est_ms=f"{allocator.estimate(problem, device_map).seconds * 1e3:.3f}",
            plan_seconds=f"{plan_seconds:.3f}" if method == "ours" else "",
        )
        for regime in ("warm", "cold"):
            keys = ("n", "q1_ms", "median_ms", "q3_ms", "cpu_median_ms", "paired_auto_over_ours",
                    "pairs_ours_faster", "sign_test_p", "rss_increase_bytes", "rss_peak_bytes", "rss_exact")
            if regime not in args.regimes:
                row.update({f"{regime}_{k}": "" for k in keys})
                continue
            wall = [t for run in runs for t in run[method][regime]["wall"]]
            cpu = [t for run in runs for t in run[method][regime]["cpu"]]
            q1, med, q3 = _quantiles(wall)
            paired = faster = p_value = ""
            if method == "ours":
                ratios = [a / o for run in runs
                          for a, o in zip(run["auto"][regime]["wall"], run["ours"][regime]["wall"])]
                paired = f"{statistics.median(ratios):.4f}"
                wins = sum(r > 1 for r in ratios)
                faster, p_value = f"{wins}/{len(ratios)}", f"{sign_test(wins, len(ratios)):.4f}"
            row.update({
                f"{regime}_n": len(wall), f"{regime}_q1_ms": f"{q1 * 1e3:.3f}",
                f"{regime}_median_ms": f"{med * 1e3:.3f}",
                f"{regime}_q3_ms": f"{q3 * 1e3:.3f}", f"{regime}_cpu_median_ms": f"{statistics.median(cpu) * 1e3:.3f}",
                f"{regime}_paired_auto_over_ours": paired, f"{regime}_pairs_ours_faster": faster,
                f"{regime}_sign_test_p": p_value,
                f"{regime}_rss_increase_bytes": max(run[method][regime]["rss_increase"] for run in runs),
                f"{regime}_rss_peak_bytes": max(run[method][regime]["rss_peak"] for run in runs),
                f"{regime}_rss_exact": all(run[method][regime]["exact"] for run in runs),
            })
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------------------
# Report.

def _mb(n) -> str:
    return f"{int(n) / 1e6:.1f}"


def verdicts(rows, regime) -> list[tuple]:
    """(model, budget, auto median ms, ours median ms, ours faster?) for each cell whose maps differ."""
    by = {(r["model"], r["budget"], r["method"]): r for r in rows}
    out = []
    for r in rows:
        if r["method"] != "ours" or not r["maps_differ"] or not r[f"{regime}_median_ms"]:
            continue
        a, o = float(by[r["model"], r["budget"], "auto"][f"{regime}_median_ms"]), float(r[f"{regime}_median_ms"])
        out.append((r["model"], r["budget"], a, o, o < a))
    return out


def table(rows, regime) -> str:
    by = {(r["model"], r["budget"], r["method"]): r for r in rows}
    cells = list(dict.fromkeys((r["model"], r["budget"]) for r in rows))
    head = ["| model | RAM budget | in RAM, auto → ours (MB) | maps differ | auto ms [IQR] | ours ms [IQR] | "
            "auto / ours (medians) | paired auto / ours | ours faster in pairs (sign test p) | CPU ms auto / ours | "
            "all in RAM ms | "
            "disk tensors auto / ours | RSS increase auto / ours (MB) | estimated ms auto / ours |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines = []

    def lat(r):
        return (f"{float(r[f'{regime}_median_ms']):.2f} "
                f"[{float(r[f'{regime}_q1_ms']):.2f}–{float(r[f'{regime}_q3_ms']):.2f}]")

    for model, budget in cells:
        a, o, ref = by[model, budget, "auto"], by[model, budget, "ours"], by.get((model, budget, REFERENCE))
        if not a[f"{regime}_median_ms"]:
            continue
        ratio = float(a[f"{regime}_median_ms"]) / float(o[f"{regime}_median_ms"])
        ref_ms = f"{float(ref[f'{regime}_median_ms']):.1f}" if ref else "—"
        lines.append(
            f"| {model} ({_mb(a['model_bytes'])} MB) | {float(budget):.0%} | {_mb(a['resident_bytes'])} → "
            f"{_mb(o['resident_bytes'])} | {'yes' if a['maps_differ'] else 'no'} | {lat(a)} | {lat(o)} | "
            f"**{ratio:.2f}×** | {float(o[f'{regime}_paired_auto_over_ours']):.2f}× | "
            f"{o[f'{regime}_pairs_ours_faster']} ({float(o[f'{regime}_sign_test_p']):.2g}) | "
            f"{float(a[f'{regime}_cpu_median_ms']):.1f} / {float(o[f'{regime}_cpu_median_ms']):.1f} | "
            f"{ref_ms} | {a['disk_tensors']} / {o['disk_tensors']} | "
            f"{_mb(a[f'{regime}_rss_increase_bytes'])} / {_mb(o[f'{regime}_rss_increase_bytes'])} | "
            f"{float(a['est_ms']):.1f} / {float(o['est_ms']):.1f} |")
    return "\n".join(head + lines)


def report(rows, args, command, seconds) -> str:
    n = {regime: rows[0][f"{regime}_n"] for regime in ("warm", "cold") if rows[0][f"{regime}_n"]}
    exact = all(r[f"{regime}_rss_exact"] for r in rows for regime in n)
    parts = [
        "# Latency: our plan vs transformers `device_map=\"auto\"` (CPU main device, disk offload)\n",
        f"`{command}` — {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {seconds:.0f} s. "
        f"{platform.machine()}, {os.cpu_count()} cores (shared, noisy), no accelerator; torch {torch.__version__} "
        f"(1 thread), transformers {_version('transformers')}, accelerate {_version('accelerate')}.\n",
        f"Every configuration is loaded {args.rounds}× in a fresh forked process; the processes of one model and "
        f"budget are loaded side by side and take turns one forward at a time. {args.warmup} warm-up forwards, then "
        f"{args.forwards} timed forwards per load and regime ({', '.join(f'{k}: {v}' for k, v in n.items())} "
        f"forwards per configuration in all). *ms*: median wall time per forward [interquartile range]; *paired*: "
        f"median over forward pairs taken moments apart of auto's time / ours; *CPU ms*: median thread CPU time "
        f"(insensitive to other processes on this shared machine, blind to I/O waits); *in RAM*: bytes of the "
        f"model the map keeps in RAM (the rest is read from disk at every forward); *RSS increase*: the process's "
        f"peak RSS during the timed forwards minus its RSS before them, max over loads "
        f"({'exact: VmHWM reset by /proc/self/clear_refs' if exact else 'sampled after each forward: a lower bound'}); "
        f"*estimated*: `allocator.estimate` with its default profile.\n",
    ]
    for regime, title in (("warm", "Warm page cache"), ("cold", "Cold cache: page cache dropped before every forward")):
        if regime not in n:
            continue
        parts += [f"## {title}\n", table(rows, regime), "", _verdict(rows, regime), ""]
    parts += [_where_time_goes(rows, args.regimes), "", _checks(rows)]
    return "\n".join(parts) + "\n"


def _verdict(rows, regime) -> str:
    """The target, by the median, and what the paired sign test says about the cells that miss it."""
    by = {(r["model"], r["budget"], r["method"]): r for r in rows}
    v = verdicts(rows, regime)
    wins = sum(1 for *_, ok in v if ok)
    ours = [by[m, b, "ours"] for m, b, *_ in v]
    significant = [r for r in ours if float(r[f"{regime}_sign_test_p"]) < 0.05]
    sig_faster = sum(1 for r in significant if float(r[f"{regime}_paired_auto_over_ours"]) > 1)
    text = (f"Target — ours faster than auto by the median wherever the maps differ: **{wins}/{len(v)} cells"
            f"{', holds' if v and wins == len(v) else ', does not hold everywhere' if v else ''}**. By a paired sign "
            f"test at p < 0.05, ours is faster in {sig_faster} cells and slower in {len(significant) - sig_faster}.")
    slower = []
    for m, b, a, o, ok in v:
        if ok:
            continue
        r = by[m, b, "ours"]
        p = float(r[f"{regime}_sign_test_p"])
        if p >= 0.05:
            meaning = "not distinguishable from noise"
        elif float(r[f"{regime}_paired_auto_over_ours"]) < 1:
            meaning = "a real loss"
        else:
            meaning = "yet ours wins most pairs"
        slower.append(f"{m} {float(b):.0%} ({o:.2f} vs {a:.2f} ms; ours faster in {r[f'{regime}_pairs_ours_faster']} "
                      f"pairs, p = {p:.2g}: {meaning})")
    return text + (f" Slower by the median: {'; '.join(slower)}." if slower else "")


def _fit(points):
    """Least squares ``y = a * x1 + b * x2`` with ``a, b >= 0`` over ``(x1, x2, y)``; (a, b, R^2) or None.

    Two unknowns: the unconstrained solution when both are non-negative, else the better of the two one-variable
    fits (the other coefficient 0).
    """
    if len(points) < 3:
        return None
    ys = [y for *_, y in points]
    mean = statistics.mean(ys)
    total = sum((y - mean) ** 2 for y in ys)

    def r2(a, b):
        resid = sum((y - a * x1 - b * x2) ** 2 for x1, x2, y in points)
        return (1 - resid / total) if total else float("nan")

    s11 = sum(x1 * x1 for x1, _, _ in points)
    s12 = sum(x1 * x2 for x1, x2, _ in points)
    s22 = sum(x2 * x2 for _, x2, _ in points)
    s1y = sum(x1 * y for x1, _, y in points)
    s2y = sum(x2 * y for _, x2, y in points)
    det = s11 * s22 - s12 * s12
    if abs(det) > 1e-12 * max(1.0, s11 * s22):
        a, b = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if a >= 0 and b >= 0:
            return a, b, r2(a, b)
    options = [(max(0.0, s1y / s11) if s11 else 0.0, 0.0), (0.0, max(0.0, s2y / s22) if s22 else 0.0)]
    a, b = max(options, key=lambda ab: r2(*ab))
    return a, b, r2(a, b)


def _where_time_goes(rows, regimes) -> str:
    """Per model: the time a map adds over all-in-RAM, fitted to the tensors and the bytes it reads from disk."""
    regime = "warm" if "warm" in regimes else regimes[0]
    by = {(r["model"], r["budget"], r["method"]): r for r in rows}
    lines = ["## Where the time goes\n",
             "accelerate streams an offloaded module's weights at every forward, one tensor at a time: "
             "`OffloadedWeightsLoader.__getitem__` opens the checkpoint with `safe_open` (parsing its header and "
             "mapping the file) for *each* tensor, copies it out, and `set_module_tensor_to_device` swaps it in, then "
             "back to meta after the module ran. So a map pays a fixed cost per tensor it leaves on disk, on top of "
             "the bytes. Fit per model over its offloaded loads (" + regime + " cache): extra ms over the all-in-RAM "
             "load = *a* × tensors on disk + *b* × MB on disk (least squares, a, b ≥ 0).\n",
             "| model | a: ms per tensor on disk | b: ms per MB on disk | R² | configurations |",
             "|---|---|---|---|---|"]
    fits = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        points = []
        for r in rows:
            ref = by.get((model, r["budget"], REFERENCE))
            if r["model"] != model or r["method"] == REFERENCE or ref is None or not r[f"{regime}_median_ms"]:
                continue
            points.append((int(r["disk_tensors"]), int(r["disk_bytes"]) / 1e6,
                           float(r[f"{regime}_median_ms"]) - float(ref[f"{regime}_median_ms"])))
        fits[model] = _fit(points)
        if fits[model]:
            a, b, r2 = fits[model]
            lines.append(f"| {model} | {a:.3f} | {b:.3f} | {r2:.2f} | {len(points)} |")
        else:
            lines.append(f"| {model} | — | — | — | {len(points)} (too few to fit) |")
    slower: dict[tuple, list[str]] = {}  # cell -> regimes where ours is slower by the median
    for reg in regimes:
        for m, b, _, _, ok in verdicts(rows, reg):
            if not ok:
                slower.setdefault((m, b), []).append(reg)
    for (model, budget), where in slower.items():
        a_row, o_row = by[model, budget, "auto"], by[model, budget, "ours"]
        fit = fits.get(model)
        predicted = ""
        if fit:
            a, b, _ = fit
            pa = a * int(a_row["disk_tensors"]) + b * int(a_row["disk_bytes"]) / 1e6
            po = a * int(o_row["disk_tensors"]) + b * int(o_row["disk_bytes"]) / 1e6
            predicted = f" The fit puts ours at {po:.1f} ms over all-in-RAM and auto at {pa:.1f} ms."
        head = (f"\n**{model} at {float(budget):.0%}** (ours slower by the median, {' and '.join(where)} cache): "
                f"ours keeps {_mb(o_row['resident_bytes'])} MB in RAM against auto's {_mb(a_row['resident_bytes'])} MB "
                f"and reads {_mb(o_row['disk_bytes'])} MB from disk per forward against {_mb(a_row['disk_bytes'])} MB, "
                f"in {o_row['disk_tensors']} tensors against {a_row['disk_tensors']}.{predicted} ")
        sign = " ".join(
            f"{reg.capitalize()}: ours faster in {o_row[f'{reg}_pairs_ours_faster']} paired forwards (sign test "
            f"p = {float(o_row[f'{reg}_sign_test_p']):.2g})." for reg in where)
        if int(o_row["disk_tensors"]) > int(a_row["disk_tensors"]):
            lines.append(head + "Fewer bytes but more tensors on disk: on this runtime a tensor on disk costs a "
                         "fixed amount whatever its size, so keeping megabytes in RAM while leaving more (small) "
                         "tensors on disk buys little or nothing — the fit says the two effects nearly cancel, the "
                         "measurement that the tensors win. `allocator.estimate` charges offloaded bytes and nothing "
                         "per offloaded tensor, so the planner cannot see this trade. " + sign)
        else:
            lines.append(head + "Ours moves fewer bytes in fewer tensors, so nothing in the mechanism makes it "
                         "slower; the medians differ by the machine's noise. " + sign)
    return "\n".join(lines)


def _checks(rows) -> str:
    """What the runs say about the memory model: loaded maps vs plans, held RAM vs budget."""
    lines = ["## Checks\n"]
    ours = [r for r in rows if r["method"] == "ours"]
    bad = [f"{r['model']} {float(r['budget']):.0%}" for r in ours if r["matches_plan"] is False]
    lines.append(f"- The map transformers loaded equals the plan in {len(ours) - len(bad)}/{len(ours)} cells"
                 + (f" (differs: {', '.join(bad)})" if bad else "") + ".")
    unstable = [f"{r['model']} {float(r['budget']):.0%} {r['method']}" for r in rows if not r["stable_map"]]
    lines.append("- Every load of a configuration got the same map." if not unstable else
                 f"- Maps changed between loads: {', '.join(unstable)}.")
    over = [f"{r['model']} {float(r['budget']):.0%} {r['method']}" for r in rows if r["method"] != REFERENCE
            and int(r["ram_held_bytes"]) + int(r["predicted_streamed_bytes"]) > int(r["budget_bytes"])]
    lines.append("- Weights held in RAM after loading plus the predicted streaming reserve fit the budget for every "
                 "map." if not over else f"- Held + streamed exceed the budget: {', '.join(over)}.")
    return "\n".join(lines)


def _version(name: str) -> str:
    return importlib.metadata.version(name)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--accuracy" in argv:   # the cost model's accuracy, map by map: benchmarks/accuracy.py
        import accuracy

        return accuracy.main([a for a in argv if a != "--accuracy"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accuracy", action="store_true",
                        help="estimated vs measured ms per map, 8 models (benchmarks/accuracy.py; its options follow)")
    parser.add_argument("--quick", action="store_true", help="50%% budget only, 1 round of 20 forwards, warm only")
    parser.add_argument("--smoke", action="store_true", help="tiny llama, one budget, 3 forwards (CI)")
    parser.add_argument("--models", nargs="+", choices=sorted(specs()), help="default: llama t5 vit segformer")
    parser.add_argument("--budgets", nargs="+", type=float, help="RAM budgets, fractions of the model")
    parser.add_argument("--rounds", type=int, help="fresh loads per configuration (default 3)")
    parser.add_argument("--forwards", type=int, help="timed forwards per load and regime (default 12)")
    parser.add_argument("--warmup", type=int, help="untimed forwards per load and regime (default 3)")
    parser.add_argument("--no-cold", dest="cold", action="store_false", default=None, help="warm cache only")
    parser.add_argument("--no-reference", dest="reference", action="store_false", help="skip the all-in-RAM load")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per load or forward")
    parser.add_argument("--workdir", type=Path, help="where models are saved (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    mode = {"smoke": dict(models=["tiny-llama"], budgets=[0.5], rounds=1, forwards=3, warmup=1, cold=True),
            "quick": dict(models=list(FULL_MODELS), budgets=[0.5], rounds=1, forwards=20, warmup=3, cold=False),
            "full": dict(models=list(FULL_MODELS), budgets=list(BUDGETS), rounds=3, forwards=12, warmup=3, cold=True)}
    for key, value in mode["smoke" if args.smoke else "quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.regimes = ["warm", "cold"] if args.cold else ["warm"]
    torch.set_num_threads(1)  # also keeps OpenMP's thread pool unstarted here, which keeps fork safe
    quiet()
    command = " ".join(["python benchmarks/latency.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.time()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        rows = measure(args, Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "latency.csv", rows)
    text = report(rows, args, command, time.time() - start)
    (args.out / "latency.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
