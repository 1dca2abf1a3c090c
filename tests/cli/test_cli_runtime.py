"""``allocator plan --runtime allocator [--expert-profile FILE] [--prefetch N]`` (issue #39): the plan for our
offload runtime, its expert placement per mixture-of-experts layer and where each every-token part went, as text and
as JSON; and its bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import allocator
from allocator import cli
from allocator.cli.moe import EVERY_TOKEN, every_token_bytes
from allocator.cli.render import format_size

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import small_config  # noqa: E402

LAYERS = 4


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A Qwen3-MoE folder (4 layers of 8 experts, top-2; config only) and its RAM budget: 40 % of the model, which
    keeps 2 experts of layer 0 and 1 of each other layer in RAM, the rest on disk."""
    folder = tmp_path_factory.mktemp("moe") / "qwen3"
    small_config("qwen3_moe", layers=LAYERS, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(folder)
    model = cli.load_model(str(folder)).model
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    return folder, model, total, f"cpu={int(0.4 * total)}"


def data_of(capsys, *argv) -> dict:
    code, out, err = run(capsys, "plan", *argv, "--json", "-")
    assert code == 0, err
    return json.loads(out)


def section(out: str, title: str) -> list[list[str]]:
    """The rows (split on runs of spaces) of the table under the line starting with ``title``, to the blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def expand(label: str) -> list[str]:
    """``model.layers.1-3.mlp.experts`` -> the three names (the test's own reading of a grouped label)."""
    match = re.fullmatch(r"(.*\.)([\d,-]+)(\..*)", label)
    if match is None:
        return [label]
    numbers = []
    for run_ in match[2].split(","):
        a, _, b = run_.partition("-")
        numbers += range(int(a), int(b or a) + 1)
    return [f"{match[1]}{n}{match[3]}" for n in numbers]


def test_the_expert_table_is_the_plans_placement_grouped(capsys, qwen):
    folder, _, _, budget = qwen
    data = data_of(capsys, folder, "--max-memory", budget, "--runtime", "allocator")
    code, out, err = run(capsys, "plan", folder, "--max-memory", budget, "--runtime", "allocator")
    assert code == 0, err
    rows = section(out, "routed experts:")
    header, body, total = rows[0], rows[1:-1], rows[-1]
    devices = header[3:-1]
    assert devices == ["cpu (main: resident)", "disk"]
    names = [d.split()[0] for d in devices]
    placed = data["experts"]
    seen = []
    for label, experts, top_k, *counts, how in body:
        assert (experts, top_k, how) == ("8", "2", "per expert")
        for name in expand(label):
            seen.append(name)
            assert [placed[name].count(d) for d in names] == [int(c) for c in counts], name
    assert seen == list(placed) and len(seen) == LAYERS
    runs = sum(1 for i, name in enumerate(seen) if i == 0 or placed[name] != placed[seen[i - 1]])
    assert len(body) == runs < LAYERS   # identical consecutive layers share one row
    assert total[0] == "total" and [int(c) for c in total[2:]] == [
        sum(row.count(d) for row in placed.values()) for d in names]
    resident = sum(len(r) for r in allocator.Plan.from_dict(data).runtime.resident.values())
    assert int(total[2]) == resident > 0
    assert f"main device 'cpu', prefetch {data['runtime']['prefetch']}" in out


def test_every_token_parts_say_where_each_part_went(capsys, qwen):
    folder, model, total, budget = qwen
    code, out, err = run(capsys, "plan", folder, "--max-memory", "0=200KiB,cpu=600KiB", "--runtime", "allocator")
    assert code == 0, err
    rows = {r[0]: r[1:] for r in section(out, "every-token parts")}
    header = rows.pop("every-token part")
    assert header[1:] == ["0", "cpu", "disk"]
    assert list(rows) == [p for p in EVERY_TOKEN if p in rows]
    assert {"embeddings", "attention", "norms", "routers", "head"} <= set(rows)
    assert rows["routers"][0] == rows["attention"][0] == str(LAYERS)
    result = allocator.plan(model, {0: "200KiB", "cpu": "600KiB"}, runtime="allocator", strict=True)
    for part, module in (("embeddings", "model.embed_tokens"), ("head", "lm_head")):
        where = result.device_map[module]
        assert [c != "-" for c in rows[part][1:]] == [d == where for d in (0, "cpu", "disk")], part
    # every byte of the model is either a routed expert or in one every-token part, once
    found = every_token_bytes(result, model)
    experts = sum(layer.num_experts * layer.expert_bytes for layer in result.problem.moe)
    assert sum(sum(per.values()) for per, _ in found.values()) + experts == total


def test_tied_embeddings_are_counted_once():
    import torch
    from transformers import AutoModelForCausalLM

    config = small_config("qwen3_moe", layers=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    result = allocator.plan(model, {"cpu": "400KiB"}, runtime="allocator")
    found = every_token_bytes(result, model)
    experts = sum(layer.num_experts * layer.expert_bytes for layer in result.problem.moe)
    assert sum(sum(per.values()) for per, _ in found.values()) + experts == result.problem.graph.total
    assert "head" not in found   # the head's weight is the embeddings': counted there


def test_json_holds_the_experts_and_the_runtime(capsys, qwen):
    folder, _, _, budget = qwen
    ours = data_of(capsys, folder, "--max-memory", budget, "--runtime", "allocator")
    assert ours["options"]["runtime"] == ours["runtime"]["name"] == "allocator"
    assert set(ours["experts"]) == {f"model.layers.{i}.mlp.experts" for i in range(LAYERS)}
    assert ours["runtime"]["experts"] == ours["experts"]
    assert all(len(row) == 8 and set(row) <= {"cpu", "disk"} for row in ours["experts"].values())
    theirs = data_of(capsys, folder, "--max-memory", budget)
    assert theirs["experts"] is None and theirs["runtime"]["name"] == "accelerate"
    code, out, _ = run(capsys, "plan", folder, "--max-memory", budget)
    assert code == 0 and "routed experts" not in out and "runtime allocator" not in out


def test_expert_profile_decides_which_experts_stay_resident(capsys, qwen, tmp_path):
    folder, _, _, budget = qwen
    favourite = {f"model.layers.{i}.mlp.experts": (7 - i, 3) for i in range(LAYERS)}
    counts = {name: tuple(100 * (e == a) + 50 * (e == b) + 1 for e in range(8)) for name, (a, b) in favourite.items()}
    path = tmp_path / "experts.json"
    allocator.ExpertProfile(counts, tokens=321).save(path)
    data = data_of(capsys, folder, "--max-memory", budget, "--runtime", "allocator", "--expert-profile", path)
    assert data["options"]["expert_profile"]["counts"] == {k: list(v) for k, v in counts.items()}
    kept = {name: {e for e, d in enumerate(row) if d == "cpu"} for name, row in data["experts"].items()}
    assert sum(map(len, kept.values())) > 0
    for name, resident in kept.items():
        assert resident <= set(favourite[name]), (name, resident)   # never an expert the profile says is rare
        assert not resident or favourite[name][0] in resident
    code, out, _ = run(capsys, "plan", folder, "--max-memory", budget, "--runtime", "allocator",
                       "--expert-profile", path)
    assert code == 0 and "(the expert profile, 321 tokens)" in out


def test_prefetch_reaches_the_plan(capsys, qwen):
    folder, _, _, _ = qwen
    argv = (folder, "--max-memory", "0=300KiB,cpu=600KiB", "--runtime", "allocator")
    given = data_of(capsys, *argv, "--prefetch", "1")
    assert given["options"]["prefetch"] == given["runtime"]["prefetch"] == 1
    assert given["prefetch_reserve_bytes"] > 0
    default = data_of(capsys, *argv)   # the plan decides the depth, and says why
    assert default["options"]["prefetch"] == default["runtime"]["prefetch"]
    assert any(d["kind"] == "runtime" and "prefetch" in d["text"] for d in default["decisions"])


def test_expert_cache_reaches_the_plan(capsys, qwen):
    """``--expert-cache N`` plans with ``expert_cache=N``: the JSON carries it (options and runtime, its bytes in the
    runtime's buffers), and the text names the slots and their bytes."""
    folder, model, _, budget = qwen
    argv = (folder, "--max-memory", budget, "--runtime", "allocator")
    data = data_of(capsys, *argv, "--expert-cache", "2")
    expected = allocator.plan(model, {"cpu": int(budget.split("=")[1])}, runtime="allocator", expert_cache=2)
    assert data["options"]["expert_cache"] == data["runtime"]["expert_cache"] == 2
    nbytes = data["runtime"]["buffers"]["expert_cache"]
    assert nbytes == expected.runtime.buffers["expert_cache"] == 2 * max(m.expert_bytes for m in expected.problem.moe)
    assert data["experts"] == {k: list(v) for k, v in expected.experts.items()}
    code, out, err = run(capsys, "plan", *argv, "--expert-cache", "2")
    assert code == 0, err
    assert f"expert cache 2 slots ({format_size(nbytes)})" in out
    assert f"expert cache {format_size(nbytes)}" in out   # in the bytes held on the main device
    without = data_of(capsys, *argv)
    assert without["options"]["expert_cache"] == without["runtime"]["expert_cache"] == 0
    code, out, _ = run(capsys, "plan", *argv)
    assert "no expert cache" in out


def test_a_saved_runtime_plan_shows_the_same_runtime(capsys, qwen, tmp_path):
    folder, _, _, budget = qwen
    path = tmp_path / "plan.json"
    code, planned, err = run(capsys, "plan", folder, "--max-memory", budget, "--runtime", "allocator", "--json", path)
    assert code == 0, err
    code, checked, err = run(capsys, "plan", folder, "--from-json", path)
    assert code == 0, err
    assert section(checked, "routed experts:") == section(planned, "routed experts:")
    assert section(checked, "every-token parts") == section(planned, "every-token parts")


def test_a_dense_model_under_the_runtime_has_no_expert_table(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, architectures=["LlamaForCausalLM"],
                             tie_word_embeddings=False).save_pretrained(folder)
    code, out, err = run(capsys, "plan", folder, "--max-memory", "cpu=300KiB", "--runtime", "allocator")
    assert code == 0, err
    assert "runtime allocator" in out and "routed experts" not in out
    rows = {r[0]: r for r in section(out, "every-token parts")}
    assert {"embeddings", "attention", "norms", "head", "other"} <= set(rows) and "routers" not in rows


def test_bad_runtime_input_exits_2_with_one_line(capsys, qwen, tmp_path):
    folder, _, _, budget = qwen
    llama = tmp_path / "llama"
    pytest.importorskip("transformers").LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, architectures=["LlamaForCausalLM"]).save_pretrained(llama)
    (tmp_path / "not_json.json").write_text("{")
    (tmp_path / "bandwidths.json").write_text(json.dumps({"format": "allocator.profile/1"}))
    allocator.ExpertProfile({"model.layers.0.block_sparse_moe.experts": (1, 2)}).save(tmp_path / "other.json")
    allocator.ExpertProfile({"model.layers.0.mlp.experts": (1, 2, 3)}).save(tmp_path / "short.json")
    (tmp_path / "plan.json").write_text("{}")
    ours = ["plan", folder, "--max-memory", budget]
    cases = {
        "unknown runtime": ([*ours, "--runtime", "deepspeed"], "invalid choice: 'deepspeed'"),
        "missing profile": ([*ours, "--runtime", "allocator", "--expert-profile", tmp_path / "none.json"],
                            "cannot read it"),
        "profile not json": ([*ours, "--runtime", "allocator", "--expert-profile", tmp_path / "not_json.json"],
                             "is not an expert profile"),
        "bandwidth profile": ([*ours, "--runtime", "allocator", "--expert-profile", tmp_path / "bandwidths.json"],
                              "not an expert profile"),
        "profile of another model": ([*ours, "--runtime", "allocator", "--expert-profile", tmp_path / "other.json"],
                                     "names none of"),
        "profile with other experts": ([*ours, "--runtime", "allocator", "--expert-profile",
                                        tmp_path / "short.json"], "counts 3 experts"),
        "profile of a dense model": (["plan", llama, "--max-memory", budget, "--runtime", "allocator",
                                      "--expert-profile", tmp_path / "short.json"], "no mixture-of-experts layer"),
        "profile without the runtime": ([*ours, "--expert-profile", tmp_path / "short.json"],
                                        "--expert-profile needs --runtime allocator"),
        "prefetch without the runtime": ([*ours, "--prefetch", "1"], "--prefetch needs --runtime allocator"),
        "negative prefetch": ([*ours, "--runtime", "allocator", "--prefetch", "-1"], "0 or more"),
        "prefetch not a number": ([*ours, "--runtime", "allocator", "--prefetch", "two"], "invalid int value"),
        "cache without the runtime": ([*ours, "--expert-cache", "2"], "--expert-cache needs --runtime allocator"),
        "negative cache": ([*ours, "--runtime", "allocator", "--expert-cache", "-1"], "0 or more"),
        "cache not a number": ([*ours, "--runtime", "allocator", "--expert-cache", "many"], "invalid int value"),
        "cache beyond the room": ([*ours, "--runtime", "allocator", "--expert-cache", "1000"],
                                  "or less, or raise 'cpu'"),
        "cache on a dense model": (["plan", llama, "--max-memory", budget, "--runtime", "allocator",
                                    "--expert-cache", "2"], "no mixture-of-experts layer"),
        "runtime with a saved plan": (["plan", folder, "--from-json", tmp_path / "plan.json", "--runtime",
                                       "allocator"], "drop --runtime"),
    }
    failures = []
    for name, (argv, expected) in cases.items():
        code, out, err = run(capsys, *argv)
        if not (code == 2 and out == "" and err.startswith("allocator: error: ") and err.count("\n") == 1
                and "Traceback" not in err and expected in err):
            failures.append(f"{name}: exit {code}, stdout {out[:200]!r}, stderr {err[:400]!r}")
    assert not failures, "\n".join(failures)
