"""Accuracy of the cost model: estimated against measured milliseconds per forward, map by map (issue #21).

Eight small random models (llama, t5, gpt2, bert, vit, segformer at 512², convnext, swin; float32) are saved with
``save_pretrained``. Per model and RAM budget (``{"cpu": f * total}``: the CPU is the main device, the rest goes to
disk), several maps are loaded by ``from_pretrained(device_map=...)``: allocator's plan, transformers'
``device_map="auto"``, and maps that put the first, the last or every other unit on disk (those that
``allocator.evaluate.validate`` accepts under the budget; distinct ones only). Each load lives in a forked process; the
loads of a cell take turns forward by forward, and each map's time is the median of its forwards (warm page
cache, one thread, ``torch.no_grad``).

The estimate of each map is ``allocator.estimate`` of a problem built with ``inputs`` at the benchmark's shapes
(FLOPs, ops and activations counted on the meta device) under ``Profile.measure()`` taken in the same run at the
same thread count (at the start, halfway and at the end; per field the median: the cores are shared, and one
measurement can fall in a busy moment); the page cache is warm, so the profile's ``disk_read`` is its measured
``disk_read_warm``.
Reported: per map estimated / measured, per model the median |est/meas - 1|, the maps off by more than 2x, and of
the pairs of maps in a cell whose measured order is significant (a sign test over the paired forwards, p < 0.05)
the fraction the estimate orders the same way. Writes ``accuracy.csv`` and ``accuracy.md``.

    python benchmarks/latency.py --accuracy            # 8 models x 3 budgets, 10 forwards per map
    python benchmarks/latency.py --accuracy --quick    # 8 models x 3 budgets, 6 forwards per map
    python benchmarks/accuracy.py --models llama --budgets 0.5 --forwards 4   # any subset
    python benchmarks/accuracy.py --smoke              # a tiny llama, one budget, 2 forwards (CI smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import allocator
from allocator.evaluate.units import problem_groups
from allocator.evaluate.validate import check

from benchutil import Worker, cores, quiet, write_csv

OUT = Path(__file__).parent / "results"
BUDGETS = (0.4, 0.7, 1.2)
MODELS = ("llama", "t5", "gpt2", "bert", "vit", "segformer", "convnext", "swin")


def specs() -> dict:
    """name -> (model class, config, input shapes). Shapes like real use: 128 tokens, 224² or 512² images."""
    import transformers as tf

    text = {"input_ids": (1, 128)}
    image = {"pixel_values": (1, 3, 224, 224)}
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=1024, vocab_size=8000, tie_word_embeddings=False), text),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(
            d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=8, vocab_size=8000),
            {"input_ids": (1, 128), "decoder_input_ids": (1, 32)}),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_embd=256, n_layer=6, n_head=8, vocab_size=8000,
                                                   n_positions=256), text),
        "bert": (tf.BertModel, tf.BertConfig(hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                                             intermediate_size=1024, vocab_size=8000), text),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(
            hidden_size=384, num_hidden_layers=8, num_attention_heads=6, intermediate_size=1536, image_size=224,
            patch_size=16, num_labels=1000), image),
        "segformer": (tf.SegformerForSemanticSegmentation, tf.SegformerConfig(
            hidden_sizes=[32, 64, 160, 256], depths=[2, 2, 2, 2], decoder_hidden_size=256, num_labels=150),
            {"pixel_values": (1, 3, 512, 512)}),
        "convnext": (tf.ConvNextForImageClassification, tf.ConvNextConfig(
            hidden_sizes=[48, 96, 192, 384], depths=[2, 2, 4, 2], num_labels=1000, image_size=224), image),
        "tiny-llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=1000, tie_word_embeddings=False), {"input_ids": (1, 8)}),
        "swin": (tf.SwinForImageClassification, tf.SwinConfig(
            embed_dim=48, depths=[2, 2, 4, 2], num_heads=[3, 6, 12, 24], image_size=224, window_size=7,
            num_labels=1000), image),
    }


def make_inputs(shapes: dict) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randint(0, 1000, v, generator=gen) if "ids" in k else torch.randn(*v, generator=gen)
            for k, v in shapes.items()}


# -- child: one load, forwards on request ----------------------------------------------------------------------------


def serve(job: dict, conn) -> None:
    try:
        torch.set_num_threads(1)
        quiet()
        cls, _, shapes = specs()[job["model"]]
        inputs = make_inputs(shapes)
        with tempfile.TemporaryDirectory(dir=job["workdir"]) as offload:
            model = cls.from_pretrained(job["path"], dtype=torch.float32, device_map=job["device_map"],
                                        max_memory=dict(job["max_memory"]), offload_folder=offload).eval()
            conn.send(dict(getattr(model, "hf_device_map", {"": "cpu"})))
            with torch.no_grad():
                while conn.recv() == "forward":
                    start = time.perf_counter()
                    model(**inputs)
                    conn.send(time.perf_counter() - start)
    except BaseException as err:   # tell the parent instead of dying silently
        conn.send({"error": f"{type(err).__name__}: {err}"})


# -- parent ----------------------------------------------------------------------------------------------------------


def candidate_maps(problem, plan_map: dict) -> dict:
    """name -> device map: the plan's, then units on disk from the front, from the back and every other one until
    the map is valid under the RAM budget (at least a third of the units); distinct ones only."""
    g = problem.graph
    found = list(problem_groups(problem).records())
    movable = [k for k, grp in enumerate(found) if not grp.resident_only]
    out = {"ours": plan_map}

    def fill(order):
        """Units of ``order`` to disk one by one until the map is valid (and at least a third of them went)."""
        on_disk = set()
        for k in order:
            on_disk.add(k)
            device_map = {u.name: "disk" if j in on_disk else "cpu" for j, grp in enumerate(found) for u in grp.units}
            if len(on_disk) >= len(movable) // 3 and not check(problem, device_map)[0]:
                return device_map
        return None

    orders = {"front": movable, "back": movable[::-1], "alternate": movable[::2] + movable[1::2]}
    seen = [plan_map]
    for name, order in orders.items():
        device_map = fill(order)
        if device_map is None or any(_same(device_map, m, g) for m in seen):
            continue
        out[name] = device_map
        seen.append(device_map)
    return out


def _same(a: dict, b: dict, g) -> bool:
    from allocator.evaluate.memory import tensor_devices

    return tensor_devices(g, a) == tensor_devices(g, b)


def sign_test(wins: int, n: int) -> float:
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, n - wins) + 1)) / 2**n
    return min(1.0, 2 * tail)


def run_cell(name: str, path: str, budget: dict, maps: dict, args, workdir: Path) -> dict:
    """Load every map of a cell side by side; forwards take turns (the order rotates). name -> (loaded map,
    forward seconds)."""
    workers = {}
    try:
        for method, device_map in maps.items():
            workers[method] = Worker(serve, dict(model=name, path=path, device_map=device_map, max_memory=budget,
                                                 workdir=str(workdir)), timeout=args.timeout, name=f"{name} {method}")
        for _ in range(args.warmup):
            for w in workers.values():
                w.ask("forward")
        times = {m: [] for m in workers}
        methods = list(workers)
        for i in range(args.forwards):
            k = i % len(methods)
            for method in methods[k:] + methods[:k]:
                times[method].append(workers[method].ask("forward"))
        return {m: (workers[m].loaded, times[m]) for m in methods}
    finally:
        for w in workers.values():
            w.close()


def measure(args, workdir: Path, profiles: list) -> list[tuple]:
    """Every cell's maps, loaded and timed: (model, budget, problem builder, map name, device map, seconds). The
    plans are made with the first profile; a profile is measured again halfway and at the end (``profiles`` gets
    them), so that the estimates use rates taken across the run."""
    records = []
    halfway = len(args.models) // 2
    for i, name in enumerate(args.models):
        if i == halfway and i > 0:
            profiles.append(allocator.Profile.measure(folder=workdir))
        cls, config, shapes = specs()[name]
        path = str(workdir / name)
        torch.manual_seed(0)
        cls(config).to(torch.float32).eval().save_pretrained(path)
        with torch.device("meta"):
            meta = cls(config)
        total = allocator.build_problem(meta, {"cpu": 0}).graph.total
        for f in args.budgets:
            budget = {"cpu": int(f * total)}
            problem = allocator.build_problem(meta, dict(budget), inputs=shapes, profile=profiles[0])
            plan = allocator.plan(meta, dict(budget), inputs=shapes, profile=profiles[0])
            maps = {"auto": "auto", **candidate_maps(problem, plan.device_map)}
            measured = run_cell(name, path, budget, maps, args, workdir)
            seen = []
            for method, (loaded, seconds) in measured.items():
                device_map = loaded if method == "auto" else maps[method]
                if method == "auto" and any(_same(loaded, m, problem.graph) for m in seen):
                    continue   # transformers' map equals one already measured
                seen.append(device_map)
                records.append((name, f, problem, method, device_map, seconds))
            print(f"{name} {f:.0%}: {len([r for r in records if r[:2] == (name, f)])} maps", file=sys.stderr,
                  flush=True)
    profiles.append(allocator.Profile.measure(folder=workdir))
    return records


def median_profile(profiles: list):
    """Per field the median of ``profiles`` (each field's spread: the largest of theirs and of the medians')."""
    fields = {}
    spread = {}
    for name in profiles[0].to_dict():
        if name == "spread":
            continue
        values = [getattr(p, name) for p in profiles]
        fields[name] = statistics.median(values)
        own = [p.spread[name] for p in profiles if name in p.spread]
        if own:
            spread[name] = max(own + [(max(values) - min(values)) / fields[name]])
    return allocator.Profile(**fields, spread=spread)


def rows_of(records: list[tuple], profile) -> list[dict]:
    """The estimate of each measured map under ``profile``, next to its median measured time."""
    rows = []
    for name, f, problem, method, device_map, seconds in records:
        est = allocator.estimate(problem, device_map, profile)
        meas = statistics.median(seconds)
        rows.append(dict(model=name, budget=f, map=method, estimated_ms=round(est.seconds * 1e3, 3),
                         measured_ms=round(meas * 1e3, 3), ratio=round(est.seconds / meas, 3),
                         disk_mb=round(est.disk_bytes / 1e6, 2), forwards=";".join(f"{s * 1e3:.3f}" for s in seconds)))
    return rows


def pairs(rows: list[dict]) -> tuple[int, int]:
    """(significant pairs, of which the estimate orders the same way), over the maps of each cell."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["model"], r["budget"]), []).append(r)
    significant = right = 0
    for cell in cells.values():
        for i, a in enumerate(cell):
            for b in cell[i + 1:]:
                fa = [float(x) for x in a["forwards"].split(";")]
                fb = [float(x) for x in b["forwards"].split(";")]
                wins = sum(x < y for x, y in zip(fa, fb))
                if sign_test(wins, min(len(fa), len(fb))) >= 0.05:
                    continue
                significant += 1
                right += (a["measured_ms"] < b["measured_ms"]) == (a["estimated_ms"] < b["estimated_ms"])
    return significant, right


def report(rows: list[dict], profile, args, command: str, seconds: float) -> str:
    errors = [abs(r["ratio"] - 1) for r in rows]
    off = [r for r in rows if not 0.5 <= r["ratio"] <= 2]
    significant, right = pairs(rows)
    lines = [
        "# Cost model accuracy: estimated vs measured ms per forward",
        "",
        f"`{command}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {seconds / 60:.1f} min; "
        f"{platform.machine()}, {args.cores}, torch {torch.__version__}, one "
        f"thread; warm page cache; {args.warmup} warm-up and {args.forwards} timed forwards per map, taking turns.",
        "",
        f"Profile: per field the median of {args.profiles} `Profile.measure()` in this run (at the start, halfway "
        "and at the end; one thread), `disk_read` set to its `disk_read_warm` (the page cache is warm); spread: the "
        "largest of each measurement's and of the measurements' own:",
        "",
        "| field | value | spread |",
        "|---|---|---|",
    ]
    for name in ("cpu_memory", "cpu_flops", "cpu_op_latency", "cpu_pointwise", "cpu_strided", "disk_read",
                 "offload_tensor_latency", "disk_tensor_latency"):
        lines.append(f"| {name} | {getattr(profile, name):.4g} | {profile.spread.get(name, 0):.0%} |")
    lines += ["", f"**Median |est/meas - 1|: {statistics.median(errors):.1%}** over {len(rows)} maps; "
              f"{len(off)} maps off by more than 2x; significant pairs ordered right: {right}/{significant}"
              f"{f' ({right / significant:.1%})' if significant else ''}.", "",
              "| model | maps | median \\|est/meas - 1\\| | min ratio | max ratio |", "|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        ratios = [r["ratio"] for r in mine]
        lines.append(f"| {model} | {len(mine)} | {statistics.median(abs(x - 1) for x in ratios):.1%} | "
                     f"{min(ratios):.2f} | {max(ratios):.2f} |")
    lines += ["", "| model | RAM budget | map | disk MB | estimated ms | measured ms | est/meas |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budget']:.0%} | {r['map']} | {r['disk_mb']} | {r['estimated_ms']} | "
                     f"{r['measured_ms']} | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 timed forwards and 1 warm-up per map")
    parser.add_argument("--smoke", action="store_true", help="a tiny llama, one budget, 2 forwards (CI)")
    parser.add_argument("--models", nargs="+", choices=sorted(specs()), help=f"default: {' '.join(MODELS)}")
    parser.add_argument("--budgets", nargs="+", type=float, help="RAM budgets, fractions of the model (default: "
                        f"{' '.join(map(str, BUDGETS))})")
    parser.add_argument("--forwards", type=int, help="timed forwards per map (default 10; --quick 6)")
    parser.add_argument("--warmup", type=int, help="untimed forwards per map (default 2; --quick 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per load or forward")
    parser.add_argument("--workdir", type=Path, help="where models are saved (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    args.cores = cores()   # before the run loads the machine
    if args.smoke:
        args.models, args.budgets = args.models or ["tiny-llama"], args.budgets or [0.5]
        args.forwards, args.warmup = args.forwards or 2, 0 if args.warmup is None else args.warmup
    args.models, args.budgets = args.models or list(MODELS), args.budgets or list(BUDGETS)
    args.forwards = args.forwards or (6 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    torch.set_num_threads(1)   # the workers' thread count; also keeps OpenMP's pool unstarted, which keeps fork safe
    quiet()
    command = " ".join(["python benchmarks/accuracy.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.time()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        profiles = [allocator.Profile.measure(folder=tmp)]
        records = measure(args, Path(tmp), profiles)
        measured = median_profile(profiles)
        profile = dataclasses.replace(measured, disk_read=measured.disk_read_warm)
        rows = rows_of(records, profile)
        args.profiles = len(profiles)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "accuracy.csv", rows)
    text = report(rows, profile, args, command, time.time() - start)
    (args.out / "accuracy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
