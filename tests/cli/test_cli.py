"""The command line: ``allocator plan`` (example, model folder, config.json, --compare, --json, --plot, --profile),
``allocator demo``, ``allocator profile``, and every kind of bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import allocator
from allocator import cli
from allocator.model import zoo
from allocator.profile import Profile

SEG = "segformer-b0"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def seg():
    """The Segformer-b0 meta model, its size, and the budget of one GPU at 60% of it (accelerate: ~4% on the GPU)."""
    model = zoo.build(SEG)
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    budget = {0: int(0.6 * total), "cpu": 2 * total}
    return model, total, budget


def spec(budget) -> str:
    return ",".join(f"{d}={b}" for d, b in budget.items())


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def llama_folder(path, **config):
    transformers = pytest.importorskip("transformers")
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
    transformers.LlamaConfig(**{**cfg, **config}).save_pretrained(path)
    return path


# -- plan ------------------------------------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_list_in_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "allocator", "plan", "--list"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for name in zoo.names():
        assert f"\n{name} " in done.stdout
    assert done.stderr == ""


@pytest.mark.subprocess
def test_bad_input_in_a_subprocess_is_one_line():
    done = subprocess.run([sys.executable, "-m", "allocator", "plan", "nope-7b"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("allocator: error: 'nope-7b' is neither")


@pytest.mark.subprocess
def test_version_in_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "allocator", "--version"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"allocator {allocator.__version__}\n", "")


@pytest.mark.subprocess
def test_a_closed_pipe_ends_quietly():
    """``allocator plan llama-8b ... --compare | head -3``: no traceback, no "Broken pipe" on stderr, status 0. The
    reader here closes the pipe before anything is written, so the write always fails (``head`` may read everything
    before it exits, and then nothing fails). ``plan --list`` stands for every command: main handles the pipe."""
    argv = [sys.executable, "-m", "allocator", "plan", "--list"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""


@pytest.mark.parametrize("argv,suggested", [
    (["plan", "llama8b"], "llama-8b"), (["plan", "Segformer-B0"], "segformer-b0"),
    (["demo", "--model", "t5base"], "t5-base"),
])
def test_unknown_example_suggests_the_closest_name(capsys, argv, suggested):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("allocator: error: ") and err.rstrip().endswith(f"Did you mean {suggested!r}?")


def test_no_suggestion_for_a_name_like_no_example(capsys):
    code, _, err = run(capsys, "plan", "nope-7b")
    assert code == 2 and "Did you mean" not in err


def test_default_budget_is_marked_as_the_default(capsys):
    code, out, err = run(capsys, "plan", SEG)
    assert code == 0 and err == ""
    line = next(x for x in out.splitlines() if x.startswith("budgets: "))
    # the machine's accelerators come first where it has some; RAM is always among the budgets
    assert "the default, this machine's free memory now (" in line and "cpu=" in line and "--max-memory" in line
    code, out, _ = run(capsys, "plan", SEG, "--max-memory", "cpu=1GiB")
    assert code == 0 and "budgets: the default" not in out


def test_infeasible_without_accelerators_does_not_suggest_them(capsys):
    code, _, err = run(capsys, "plan", SEG, "--max-memory", "cpu=1MiB")
    assert code == 2 and "smallest RAM budget" in err and "accelerators" not in err
    code, _, err = run(capsys, "plan", SEG, "--max-memory", "0=1KiB,cpu=1MiB")
    assert code == 2 and "or give accelerators more room." in err


def test_likely_budget_mistakes_warn_on_one_line_each(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # conftest ignores warnings; the command line shows what Python would
        code, out, err = run(capsys, "plan", SEG, "--max-memory", "0=64,cpu=10gb")
    assert code == 0 and "budget" in out
    # a third line where this machine has no GPU 0 (test_a_device_this_machine_lacks_is_a_warning_line)
    lines = [line for line in err.splitlines() if "this machine does not have" not in line]
    assert len(err.splitlines()) == 2 + bool(allocator.problem.absent_accelerators([0]))
    assert len(lines) == 2 and all(line.startswith("allocator: warning: ") for line in lines)  # once each, not per read
    assert "max_memory[0] = 64 is read as 64 bytes" in lines[0] and "'64GiB'" in lines[0]
    assert "max_memory['cpu'] '10gb' is read as 10 Gbit = 1250000000 bytes" in lines[1] and "'10GB'" in lines[1]


@pytest.mark.parametrize("command", [["plan", SEG], ["fit", "llama-3.2-1b", "--batch-size", "1"]])
def test_a_device_this_machine_lacks_is_a_warning_line(capsys, command):
    """No machine has GPU 97: plan and fit plan onto it for a machine that has it, and say so on stderr, once, as a
    warning (not at INFO, which nobody sees)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # conftest ignores warnings; the command line shows what Python would
        code, out, err = run(capsys, *command, "--max-memory", "97=8GiB,cpu=64GiB", "--quiet")
    assert code == 0 and out
    assert err.splitlines() == [
        "allocator: warning: --max-memory names accelerator 97, which this machine does not have: the plan is for a "
        "machine that has it, and loading it here would fail; leave it out of --max-memory to plan for this machine."]
    if command[0] == "plan":   # fit needs an accelerator
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            code, _, err = run(capsys, *command, "--max-memory", "cpu=64GiB", "--quiet")
        assert code == 0 and err == ""


def custom_code_folder(path, model_type="tiny-custom"):
    """A model folder whose config.json names its own code in ``auto_map`` (a renamed Llama)."""
    path.mkdir()
    (path / "configuration_tiny.py").write_text(textwrap.dedent(f"""
        from transformers import LlamaConfig


        class TinyConfig(LlamaConfig):
            model_type = {model_type!r}
        """))
    (path / "modeling_tiny.py").write_text(textwrap.dedent("""
        from transformers import LlamaForCausalLM

        from .configuration_tiny import TinyConfig


        class TinyForCausalLM(LlamaForCausalLM):
            config_class = TinyConfig
        """))
    (path / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": ["TinyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig",
                     "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"},
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "dtype": "float32"}))
    return path


def test_custom_code_needs_trust_remote_code(capsys, tmp_path):
    pytest.importorskip("transformers")
    folder = custom_code_folder(tmp_path / "custom")
    code, out, err = run(capsys, "plan", folder, "--max-memory", "cpu=10MiB")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("allocator: error: the config ") and "add --trust-remote-code" in err


@pytest.mark.subprocess
@pytest.mark.slow
def test_trust_remote_code_builds_with_the_folders_code_in_a_subprocess(tmp_path):
    pytest.importorskip("transformers")
    folder = custom_code_folder(tmp_path / "custom")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}  # transformers copies the code to its modules cache
    done = subprocess.run([sys.executable, "-m", "allocator", "plan", str(folder), "--max-memory", "cpu=10MiB",
                           "--trust-remote-code"], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"TinyForCausalLM from {folder} (the folder's own code, --trust-remote-code)\n")


def test_auto_map_of_a_type_transformers_knows_builds_without_the_code(capsys, tmp_path):
    pytest.importorskip("transformers")
    folder = custom_code_folder(tmp_path / "native", model_type="llama")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "architectures": ["LlamaForCausalLM"]}))
    code, out, err = run(capsys, "plan", folder, "--max-memory", "cpu=10MiB")
    assert code == 0 and err == ""
    assert out.startswith(f"LlamaForCausalLM from {folder} (config.auto_map names custom code; built with "
                          "transformers' own classes: add --trust-remote-code")


def test_plan_example(capsys, seg):
    model, total, budget = seg
    code, out, err = run(capsys, "plan", SEG, "--max-memory", spec(budget))
    assert code == 0 and err == ""
    ours = allocator.plan(model, budget)
    assert out.startswith(f"{SEG} (built-in example: ")
    table = out[out.index("device "):]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:3]}
    assert set(rows) == {"0", "cpu"}
    assert " ".join(rows["0"][3:5]) == cli._size(ours.resident(0))
    assert f"{ours.resident(0) / total:.1%}" in rows["0"]
    assert f"strategy {ours.strategy}" in out and f"estimated {cli._ms(ours.cost.seconds)} per forward" in out
    assert "accelerate" not in out


def test_plan_compare_against_accelerate(capsys, seg):
    model, total, budget = seg
    code, out, err = run(capsys, "plan", SEG, "--max-memory", spec(budget), "--compare")
    assert code == 0 and err == ""
    ours = allocator.plan(model, budget)
    theirs = allocator.plan(model, budget, strategy="sequential")
    assert theirs.cost.resident_fast < 0.1 * total < 0.4 * total < ours.cost.resident_fast  # the Segformer imbalance
    assert f"accelerate {cli._size(theirs.cost.resident_fast)} ({theirs.cost.resident_fast / total:.1%}) -> " \
           f"allocator {cli._size(ours.cost.resident_fast)} ({ours.cost.resident_fast / total:.1%})" in out
    ratio = theirs.cost.seconds / ours.cost.seconds   # bytes rank first: the estimate may say the same or slower
    verdict = f"{ratio:.2f}x faster" if ratio > 1.005 else f"{1 / ratio:.2f}x slower" if ratio < 0.995 else "the same"
    assert f"({verdict})" in out
    assert "accelerate's map is valid." in out
    assert out.count("\ndevice ") == 2  # our table and accelerate's


def test_plan_compare_reports_accelerate_violations(capsys, seg):
    model, total, _ = seg
    budget = {0: int(0.15 * total), 1: int(0.15 * total), "cpu": 2 * total}
    theirs = allocator.plan(model, budget, strategy="sequential")
    assert theirs.violations
    code, out, err = run(capsys, "plan", SEG, "--max-memory", spec(budget), "--compare", "--strategy", "reserve")
    assert code == 0 and err == ""
    assert "accelerate's map is INVALID" in out
    assert out.count("VIOLATION ") == len(theirs.violations)
    assert "strategy reserve" in out


def test_plan_json_is_a_valid_device_map(capsys, seg, tmp_path):
    model, _, budget = seg
    path = tmp_path / "map.json"
    code, out, err = run(capsys, "plan", SEG, "--max-memory", spec(budget), "--json", path)
    assert code == 0 and err == "" and f"written to {path}" in out
    device_map = json.loads(path.read_text())["device_map"]
    assert device_map == allocator.plan(model, budget).device_map
    assert 0 in device_map.values()  # indices stay integers, as dispatch_model needs
    assert allocator.validate(model, device_map, budget) == []


def test_plan_plot_is_a_png(capsys, seg, tmp_path):
    _, _, budget = seg
    for extra in ([], ["--compare"]):
        path = tmp_path / f"plot{len(extra)}.png"
        code, out, err = run(capsys, "plan", SEG, "--max-memory", spec(budget), "--plot", path, *extra)
        assert code == 0 and err == ""
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


@pytest.mark.parametrize("shares", [{0: 0.6, "cpu": 2.0}, {0: 0.3, 1: 0.3, "cpu": 2.0}, {"cpu": 0.5}])
def test_plot_labels_say_model_or_budget_and_none_sits_on_a_budget_line(seg, tmp_path, shares):
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection

    model, total, _ = seg
    budget = {d: int(f * total) for d, f in shares.items()}
    plans = {"accelerate": allocator.plan(model, budget, strategy="sequential"),
             "allocator": allocator.plan(model, budget)}
    fig = cli.plot_plans(plans, str(tmp_path / "p.png"))
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    labels = [t for t in ax.texts if "%" in t.get_text()]
    assert {"of model", "of budget"} <= {w for t in labels for w in ("of model", "of budget") if w in t.get_text()}
    assert all("of model" in t.get_text() or "of budget" in t.get_text() for t in labels)
    budget_lines = [seg_ for c in ax.collections if isinstance(c, LineCollection) for seg_ in c.get_segments()]
    assert budget_lines
    for (x0, y), (x1, _) in budget_lines:
        (px0, py), (px1, _) = ax.transData.transform([(x0, y), (x1, y)])
        for t in labels:
            box = t.get_window_extent(renderer)
            crosses = box.x1 > px0 and box.x0 < px1 and box.y0 - 1 <= py <= box.y1 + 1
            assert not crosses, f"label {t.get_text()!r} sits on the budget line at {y:.2f}"


def test_plan_profile_round_trip(capsys, seg, tmp_path):
    model, _, budget = seg
    slow = Profile(host_to_device=1e9, cpu_memory=5e9)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(slow.to_dict()))
    code, out, err = run(capsys, "plan", SEG, "--max-memory", spec(budget), "--profile", path, "--strategy", "reserve")
    assert code == 0 and err == ""
    expected = allocator.plan(model, budget, strategy="reserve", profile=slow).cost.seconds
    default = allocator.plan(model, budget, strategy="reserve").cost.seconds
    assert cli._ms(expected) != cli._ms(default)
    assert f"estimated {cli._ms(expected)} per forward" in out and f"bandwidths from {path}" in out


def test_plan_local_folder_and_config_json(capsys, tmp_path):
    folder = llama_folder(tmp_path / "llama", architectures=["LlamaForCausalLM"])
    outputs = []
    for source in (folder, folder / "config.json"):
        code, out, err = run(capsys, "plan", source, "--max-memory", "0=100KiB,cpu=10MiB", "--compare")
        assert code == 0 and err == ""
        assert out.startswith(f"LlamaForCausalLM from {source}\n")
        outputs.append(out.split("\n", 1)[1])
    assert outputs[0] == outputs[1]


def test_a_folder_prints_its_shape_and_warns_once_for_a_missing_size_field(capsys, tmp_path):
    """Issue 37: a folder's config.json without num_hidden_layers is built with LlamaConfig's default (32 layers):
    one warning line names the field and the default, and the shape line says what was planned."""
    folder = llama_folder(tmp_path / "llama", architectures=["LlamaForCausalLM"])
    code, out, err = run(capsys, "plan", folder, "--max-memory", "0=100KiB,cpu=10MiB")
    shape = cli.load_model(str(folder)).shape
    assert code == 0 and err == "" and out.splitlines()[1].startswith(f"LlamaForCausalLM: {shape}; ")
    assert shape.startswith("2 layers, hidden 64, 4/2 heads, vocab 1000, ") and shape.endswith(" parameters")
    data = json.loads((folder / "config.json").read_text())
    del data["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # conftest ignores warnings; the command line shows what Python would
        code, out, err = run(capsys, "plan", folder, "--max-memory", "0=100KiB,cpu=10MiB")
    lines = [line for line in err.splitlines() if "which this machine does not have" not in line]   # GPU 0
    assert code == 0 and len(lines) == 1 and lines[0].startswith("allocator: warning: ")
    assert "does not set num_hidden_layers" in lines[0] and "default 32" in lines[0]
    assert out.splitlines()[1].startswith("LlamaForCausalLM: 32 layers, hidden 64, ")


def test_generation_shows_where_the_room_for_generate_goes_without_explain(capsys, tmp_path):
    folder = llama_folder(tmp_path / "llama", architectures=["LlamaForCausalLM"])
    budget = "0=1MiB,cpu=10MiB"
    code, out, err = run(capsys, "plan", folder, "--max-memory", budget, "--generation", "2,64")
    assert code == 0 and err == ""
    assert "why:" not in out   # not the explanation: the table
    table = out[out.index("generate: batch 2, max_length 64"):].splitlines()
    assert table[1].split() == ["device", "weights", "runtime", "cache", "logits", "activations", "peak", "of",
                                "budget"]
    ours = allocator.plan(cli.load_model(str(folder)).model, cli.parse_max_memory(budget),
                          generation=cli.parse_generation("2,64"))
    row = table[2].split()
    assert row[0] == "0" and ours.parts[0]["cache"] > 0 and ours.parts[0]["activations"] > 0
    cells = [" ".join(row[i:i + 2]) for i in range(1, 13, 2)]
    runtime = sum(ours.parts[0][k] for k in ("experts", "expert_cache", "fetch", "reserve"))
    assert cells == [cli._size(ours.parts[0]["weights"]), cli._size(runtime)] + \
        [cli._size(ours.parts[0][k]) for k in ("cache", "logits", "activations")] + [cli._size(ours.peak[0])]
    code, out, err = run(capsys, "plan", folder, "--max-memory", budget)
    assert code == 0 and "activations" not in out and "cache" not in out


def test_explain_prints_why(capsys, tmp_path):
    folder = llama_folder(tmp_path / "llama", architectures=["LlamaForCausalLM"])
    budget = "0=500KiB,cpu=10MiB"
    code, out, err = run(capsys, "plan", folder, "--max-memory", budget, "--explain")
    assert code == 0 and err == ""
    ours = allocator.plan(cli.load_model(str(folder)).model, cli.parse_max_memory(budget))
    assert ours.explain() in out
    assert "\nwhy:\n" in out and "auto chose" in out and "candidates:" not in out
    assert f"streaming reserve on {ours.main_device!r}: " in out and "are offloaded to 'cpu'" in out


def test_plan_local_folder_without_architectures_uses_automodel(capsys, tmp_path):
    folder = llama_folder(tmp_path / "bare")
    code, out, err = run(capsys, "plan", folder, "--max-memory", "cpu=10MiB")
    assert code == 0 and err == ""
    assert out.startswith(f"LlamaModel from {folder} (config.architectures is empty)")


def test_plan_dtype_from_config_and_flag(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    folder = llama_folder(tmp_path / "bf16", architectures=["LlamaForCausalLM"], dtype="bfloat16")
    sizes = {}
    for flag in ([], ["--dtype", "float32"], ["--dtype", "float16"]):
        code, out, err = run(capsys, "plan", folder, "--max-memory", "cpu=10MiB", *flag)
        assert code == 0 and err == ""
        sizes[tuple(flag)] = out.splitlines()[1].replace(f"{cli.load_model(str(folder)).shape}; ", "")
    with torch.device("meta"):
        import transformers

        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
    half = allocator.build_problem(model, {"cpu": 0}, dtype=torch.bfloat16).graph.total
    assert sizes[()] == f"LlamaForCausalLM: {cli._size(half)} in bfloat16"
    assert sizes[("--dtype", "float16")] == f"LlamaForCausalLM: {cli._size(half)} in float16"
    full = allocator.build_problem(model, {"cpu": 0}, dtype=torch.float32).graph.total
    assert sizes[("--dtype", "float32")].startswith(f"LlamaForCausalLM: {cli._size(full)}")


# -- demo and profile ------------------------------------------------------------------------------------------------


def test_demo(capsys):
    code, out, err = run(capsys, "demo")
    assert code == 0 and err == ""
    assert out.startswith("allocator demo: t5-base")
    assert out.count("\n== ") == len(cli.DEMO_SCENARIOS)
    assert "accelerate's map is INVALID" in out  # two GPUs at 15%: GPU 1 becomes main with no room to stream
    assert out.count("x faster)") == len(cli.DEMO_SCENARIOS)


def test_profile_out(capsys, tmp_path):
    path = tmp_path / "p.json"
    code, out, err = run(capsys, "profile", "--out", path)
    assert code == 0 and err == ""
    measured = Profile.from_dict(json.loads(path.read_text()))
    assert measured.cpu_memory != Profile().cpu_memory
    assert "cpu_memory" in out and "measured" in out and f"--profile {path}" in out
    assert cli.load_profile(str(path)) == measured


@pytest.mark.subprocess
def test_profile_in_a_subprocess_prints_latencies_in_time_units_and_nothing_on_stderr():
    done = subprocess.run([sys.executable, "-m", "allocator", "profile"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""  # not accelerate's "Some parameters are on the meta device"
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    for name in ("switch_latency", "offload_tensor_latency", "disk_tensor_latency"):
        assert rows[name].split()[2] in ("µs", "ms"), rows[name]
    assert rows["disk_read"].split()[2] == "GB/s"


# -- bad input -------------------------------------------------------------------------------------------------------


def _bad_cases(tmp):
    empty = tmp / "empty"
    empty.mkdir()
    unknown_type = tmp / "unknown_type"
    unknown_type.mkdir()
    (unknown_type / "config.json").write_text('{"model_type": "no-such-architecture"}')
    not_json = tmp / "not_json"
    not_json.mkdir()
    (not_json / "config.json").write_text("{model_type: llama")
    unbuildable = tmp / "unbuildable"
    unbuildable.mkdir()
    (unbuildable / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": -5}))
    zero_heads = tmp / "zero_heads"
    zero_heads.mkdir()
    (zero_heads / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0}')
    profiles = {
        "not_json": "{", "list": "[1, 2]", "unknown": '{"warp_speed": 1}', "negative": '{"disk_read": -1}',
        "binary": b"\xff\xfe\x00",
    }
    for name, text in profiles.items():
        (tmp / f"{name}.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    mm = ["--max-memory", "0=5MiB,cpu=1GiB"]
    return {
        "unknown device": (["plan", SEG, "--max-memory", "gpu0=1GiB"], "unknown device 'gpu0'"),
        "malformed size": (["plan", SEG, "--max-memory", "0=lots"], "'lots' is not a size"),
        "size without a unit": (["plan", SEG, "--max-memory", "0=1e9,cpu=1GiB"], "give the int 1000000000 for bytes"),
        "entry without size": (["plan", SEG, "--max-memory", "0,cpu=1GiB"], "is not DEVICE=SIZE"),
        "empty max memory": (["plan", SEG, "--max-memory", ","], "--max-memory is empty"),
        "device twice": (["plan", SEG, "--max-memory", "0=1GiB,cuda:0=1GiB"], "appears twice"),
        "missing folder": (["plan", str(tmp / "missing"), *mm], "is neither a model folder"),
        "hub id": (["plan", "meta-llama/Llama-3-8B", *mm], "never downloads"),
        "folder without config": (["plan", str(empty), *mm], "has no config.json"),
        "unknown model type": (["plan", str(unknown_type), *mm], "transformers cannot read the config"),
        "config not json": (["plan", str(not_json / "config.json"), *mm], "transformers cannot read the config"),
        "config fails its checks": (["plan", str(zero_heads), *mm], "ZeroDivisionError"),
        "config cannot build": (["plan", str(unbuildable), *mm], "transformers cannot build LlamaForCausalLM"),
        "unknown strategy": (["plan", SEG, *mm, "--strategy", "fast"], "unknown strategy 'fast'"),
        "unknown example": (["plan", "nope-7b", *mm], "'nope-7b' is neither"),
        "unknown demo model": (["demo", "--model", "nope-7b"], "unknown built-in example 'nope-7b'"),
        "unknown demo strategy": (["demo", "--strategy", "fast"], "unknown strategy 'fast'"),
        "missing profile": (["plan", SEG, *mm, "--profile", str(tmp / "none.json")], "cannot read profile"),
        "binary profile": (["plan", SEG, *mm, "--profile", str(tmp / "binary.json")], "cannot read profile"),
        "profile not json": (["plan", SEG, *mm, "--profile", str(tmp / "not_json.json")], "is not JSON"),
        "profile a list": (["plan", SEG, *mm, "--profile", str(tmp / "list.json")], "expected an object"),
        "profile unknown field": (["plan", SEG, *mm, "--profile", str(tmp / "unknown.json")], "unknown Profile fields"),
        "profile negative": (["plan", SEG, *mm, "--profile", str(tmp / "negative.json")], "finite number >= 0"),
        "bad dtype": (["plan", SEG, *mm, "--dtype", "int9"], "'int9' is not a torch dtype"),
        "infeasible": (["plan", SEG, "--max-memory", "cpu=1MiB"], "smallest RAM budget found to work"),
        "json folder missing": (["plan", SEG, *mm, "--json", str(tmp / "no" / "m.json")], "does not exist"),
        "plot folder missing": (["plan", SEG, *mm, "--plot", str(tmp / "no" / "p.png")], "does not exist"),
        "profile out folder missing": (["profile", "--out", str(tmp / "no" / "p.json")], "does not exist"),
        "no source": (["plan", *mm], "plan needs a SOURCE"),
        "no command": ([], "required"),
        "unknown command": (["frob"], "invalid choice: 'frob'"),
        "unknown flag": (["plan", SEG, "--bogus"], "unrecognized arguments: --bogus"),
    }


def test_bad_input_exits_2_with_one_line(capsys, tmp_path):
    failures = []
    for name, (argv, expected) in _bad_cases(tmp_path).items():
        code, out, err = run(capsys, *argv)
        ok = (code == 2 and out == "" and err.startswith("allocator: error: ") and err.count("\n") == 1
              and "Traceback" not in err and expected in err)
        if not ok:
            failures.append(f"{name}: exit {code}, stdout {out[:200]!r}, stderr {err[:400]!r}")
    assert not failures, "\n".join(failures)


def test_unbudgeted_ram_on_the_main_device_is_said_in_the_report(capsys):
    code, out, _ = run(capsys, "plan", SEG, "--max-memory", "97=1KiB", "--quiet")
    line = [x for x in out.splitlines() if x.startswith("RAM is not budgeted: 'cpu' (the main device) holds ")]
    assert code == 0 and len(line) == 1 and "checked against nothing" in line[0]
    code, out, _ = run(capsys, "plan", SEG, "--max-memory", "97=1KiB,cpu=1GiB", "--quiet")
    assert code == 0 and "RAM is not budgeted" not in out
