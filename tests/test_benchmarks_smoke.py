"""Smoke tests: every benchmark script runs end to end in a subprocess and writes its CSV and markdown.

Each script runs in its smallest mode into a temporary ``--out`` folder (placement and ilp_optimality: one
architecture; latency: ``--smoke``, a tiny llama, one budget, 3 forwards; planning speed: 1k modules, single calls;
gpu: ``--dry-run``, tiny models with the CPU as the device, its generate, runtime, pipeline and assisted cases;
latency_runtime: ``--smoke``, a tiny llama under accelerate's hooks and ours; accuracy: ``--smoke``, a tiny llama, one
budget, 2 forwards per map; counting cost: segformer-b0, one call; rss: ``--smoke``, the patched load alone). The
numbers are not checked, only that the files appear with rows.
"""

from __future__ import annotations

import csv
import json
import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TIMEOUT = 240  # seconds per script; each takes 10-30 s on 2 shared cores, most of it importing torch/transformers

CASES = {
    "placement": (["--models", "segformer-b0"], "placement"),
    "ilp_optimality": (["--models", "segformer-b0"], "ilp"),
    "latency": (["--smoke"], "latency"),
    "planning_speed": (["--sizes", "1000", "--repeat-seconds", "0"], "planning_speed"),
    "gpu": (["--dry-run", "--hybrid-budget", "0.5"], "gpu"),   # 0.5: the planner splits the dry run's layer
    "latency_runtime": (["--smoke"], "latency_runtime"),
    "accuracy": (["--smoke"], "accuracy"),
    "counting_cost": (["--models", "segformer-b0", "--repeat", "1"], "counting_cost"),
    "diffusion": (["--smoke", "--steps", "1"], "diffusion"),
    "rss": (["--smoke", "--paths", "patch"], "rss"),
}


def _table_rows(markdown: str) -> list[str]:
    """Body rows of the markdown tables (lines starting with '|', minus headers and separators)."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [line for i, line in enumerate(lines) if not line.startswith("|---")
            and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("script", list(CASES))
def test_benchmark_script_writes_results(script, tmp_path):
    args, stem = CASES[script]
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *args, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=BENCHMARKS.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS.parent),
                                                                      os.environ.get("PYTHONPATH")]))},
    )   # this tree's allocator, not the one the environment installed
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    with open(tmp_path / f"{stem}.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows, f"{stem}.csv has no rows"
    markdown = (tmp_path / f"{stem}.md").read_text()
    assert _table_rows(markdown), f"{stem}.md has no table rows:\n{markdown}"
    assert markdown in proc.stdout, "the script prints the markdown it writes"
    if script == "latency":  # both methods timed side by side, and the plan's map is the one loaded
        by = {r["method"]: r for r in rows}
        assert {"auto", "ours"} <= set(by)
        assert all(int(r["warm_n"]) == 3 and float(r["warm_median_ms"]) > 0 for r in by.values())
        assert by["ours"]["matches_plan"] == "True"
    if script == "latency_runtime":  # the hooks and our runtime at each prefetch, same outputs as in RAM
        assert {r["runtime"] for r in rows} == {"hooks", "ours-0", "ours-1", "ours-2"}
        assert all(r["equal"] == "True" and int(r["n"]) == 3 for r in rows)
        assert all(int(r["peak_held"]) <= int(r["reserve"]) for r in rows if r["runtime"] != "hooks")
    if script == "gpu":  # the runtime case: every runtime computes what the hooks compute, stand-in included
        with open(tmp_path / "gpu_runtime.csv", newline="") as fh:
            runtime = list(csv.DictReader(fh))
        assert {r["runtime"] for r in runtime} == {"hooks", "ours-0", "ours-1", "ours-1-standin"}
        assert all(r["status"] == "ok" and r["equal"] == "True" for r in runtime), runtime
    if script == "diffusion":  # every method's step computes what the model in RAM computes
        assert [r["method"] for r in rows] == ["diffusers-auto", "group-offload", "allocator-plan", "allocator"]
        assert all(r["equal"].startswith("equal") for r in rows), rows
        assert rows[-1]["runtime"] == "allocator" and rows[0]["runtime"] == "accelerate hooks"
    if script == "gpu":  # the hybrid case (issues #40, #49): streamed, hybrid and split decode the same tokens
        with open(tmp_path / "gpu_hybrid.csv", newline="") as fh:
            hybrid = list(csv.DictReader(fh))
        assert [r["runtime"] for r in hybrid] == ["stream", "hybrid", "split"], hybrid
        assert all(r["status"] == "ok" and r["tokens_equal"] == "True" for r in hybrid), hybrid
        assert int(hybrid[-1]["split_layers"]) > 0 and hybrid[-1]["split_reason"] == "faster", hybrid
    if script == "gpu" and importlib.util.find_spec("diffusers"):  # the diffusion case, dry: same outputs
        with open(tmp_path / "gpu_diffusion.csv", newline="") as fh:
            diffusion = list(csv.DictReader(fh))
        assert all(r["status"] == "ok" and r["equal"] == "True" for r in diffusion), diffusion
        with open(tmp_path / "gpu_pipeline.csv", newline="") as fh:   # issue #47: a pipeline, three ways
            pipeline = list(csv.DictReader(fh))
        assert [r["method"] for r in pipeline] == ["ours", "model-offload", "group-offload"], pipeline
        assert all(r["equal_to_ram"] == "True" for r in pipeline), pipeline
    if script == "gpu":  # issue #47: target + draft in one patch() block, assisted tokens equal the target's alone
        with open(tmp_path / "gpu_assisted.csv", newline="") as fh:
            assisted = list(csv.DictReader(fh))
        assert [r["method"] for r in assisted] == ["target alone", "assisted"], assisted
        assert all(r["tokens_equal"] == "True" and "disk" in r["target_map_devices"] for r in assisted), assisted
    if script == "rss":  # the patched load held anonymous memory, and detach + del gave it back
        assert float(rows[0]["loaded_anon_mib"]) > 0 and float(rows[0]["after_anon_mib"]) <= 10, rows
    if script == "accuracy":  # every map estimated and measured
        assert len(rows) >= 2 and all(float(r["estimated_ms"]) > 0 and float(r["measured_ms"]) > 0 for r in rows)
    if script == "gpu":  # the generate case: both maps run generate; ours is planned within the budget with it
        with open(tmp_path / "gpu_generate.csv", newline="") as fh:
            generate = list(csv.DictReader(fh))
        assert {r["method"] for r in generate} == {"auto", "ours"}
        for r in generate:
            assert r["status"] == "ok" and int(r["measured_peak_bytes"]) > 0, r
            if r["method"] == "ours":
                assert r["valid"] == "True" and int(r["predicted_peak_bytes"]) <= int(r["device_budget_bytes"]), r


def test_plan_time_prints_a_time_per_model_and_budget(capsys):
    import plan_time

    assert plan_time.main(["--models", "gpt2", "--repeat", "1", "--cells"]) == 0   # no cell of its own: llama-70b
    times = json.loads(capsys.readouterr().out)
    assert set(times) == {f"gpt2/{grid}" for grid in plan_time.GRID} and all(t > 0 for t in times.values())
    assert "4gpu60" in plan_time.GRID and set(plan_time.CELLS) == {"llama-70b-bf16/4x40GiB"}


def test_plan_time_keeps_the_plans_and_compares_two_files(capsys, tmp_path):
    import plan_time

    plans = tmp_path / "plans.pkl"
    assert plan_time.main(["--models", "gpt2", "--grid", "3gpu45", "--repeat", "1", "--cells", "--plans",
                           str(plans)]) == 0
    capsys.readouterr()
    kept = pickle.loads(plans.read_bytes())
    device_map, strategy, seconds, fast = kept["gpt2/3gpu45"]
    assert dict(device_map) and strategy.startswith("auto") and seconds > 0 and fast >= 0
    other = dict(kept, **{"gpt2/3gpu45": ([(k, "disk") for k, _ in device_map], strategy, seconds, fast + 1)})
    (tmp_path / "other.pkl").write_bytes(pickle.dumps(other))
    assert plan_time.main(["--compare", str(plans), str(tmp_path / "other.pkl")]) == 0
    out = capsys.readouterr().out
    assert f"gpt2/3gpu45: map differs; fast bytes {fast} -> {fast + 1} (+1)" in out and "1 of 1 cells differ" in out


CONTENTION = {   # script -> its arguments with one busy process, and the stem it writes
    "moe": (["--smoke", "--interleaved", "1", "--contention", "1", "--threads", "1"], "moe_interleaved"),
    "latency_runtime": (["--smoke", "--contention", "1", "--threads", "1"], "latency_runtime"),
}


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("script", list(CONTENTION))
def test_contention_mode_times_ram_transformers_ours_and_the_first_generate(script, tmp_path):
    """``--contention 1``: the rows run beside one busy process (named in the header), the model in RAM, what
    transformers runs and ours through ``patch()`` timed side by side, with the first ``generate`` after each load."""
    args, stem = CONTENTION[script]
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *args, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=BENCHMARKS.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS.parent),
                                                                      os.environ.get("PYTHONPATH")]))},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    with open(tmp_path / f"{stem}.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert "1 busy process" in (tmp_path / f"{stem}.md").read_text()
    if script == "moe":
        by = {r["row"]: r for r in rows}
        assert {"ram", "transformers", "ours-patch"} <= set(by)
        assert all(float(r[k]) > 0 for r in rows for k in ("load_s", "generate_1_s", "generate_2_s"))
        assert all(r["tokens_equal"] == "True" for r in rows)
    else:
        by = {r["runtime"]: r for r in rows}
        assert {"ram", "hooks", "ours-patch"} <= set(by)
        assert all(float(r["first_generate_ms"]) > 0 and r["equal"] == "True" for r in rows)


def test_contention_starts_busy_processes_and_ends_them():
    from benchutil import Contention

    with Contention(2) as busy:
        procs = list(busy.procs)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        assert busy.describe().startswith("2 busy processes")
    assert all(p.poll() is not None for p in procs) and busy.procs == []
    assert Contention(0).describe() == "none"


@pytest.mark.subprocess
@pytest.mark.slow
def test_diffusion_pipeline_benchmark_writes_its_rows(tmp_path):
    """``diffusion.py --pipeline --smoke``: a tiny FluxPipeline, ours, model offload and group offloading, one round;
    every image equal to the pipeline's in RAM, and each method moved something."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "diffusion.py"), "--pipeline", "--smoke", "--rounds", "1", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT, cwd=BENCHMARKS.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS.parent),
                                                                      os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / "diffusion_pipeline.csv", newline="") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert set(rows) == {"ours", "model-offload", "group-offload"}
    assert all(r["equal_to_ram"] == "True" and float(r["mib_moved_per_image"]) > 0 for r in rows.values())
    assert _table_rows((tmp_path / "diffusion_pipeline.md").read_text())
