"""The plan as data (``Plan.to_dict`` / ``Plan.from_dict``, :mod:`allocator.report.schema`) and the command line's
``--json -``, ``--json FILE`` and ``--from-json FILE``; with them the small edges of ``allocator plan``: dtype aliases,
a device given twice, a file inside a model folder, a line per empty accelerator, the status line."""

from __future__ import annotations

import io
import json

import pytest

import allocator
from allocator import cli
from allocator.cli.status import Status
from allocator.model import zoo
from allocator.report.schema import SCHEMA, SavedPlan

MiB = 2**20


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def gpt2():
    return zoo.build("gpt2")


@pytest.fixture(scope="module")
def plans(gpt2):
    """Plans of every kind the schema carries: offloaded to RAM and disk, with a generation budget, accelerate's map
    with violations, two accelerators."""
    return {
        "ram": allocator.plan(gpt2, {0: "200MiB", "cpu": "4GiB"}, dtype="bfloat16"),
        "disk": allocator.plan(gpt2, {0: "150MiB", "cpu": "40MiB"}),
        "generate": allocator.plan(gpt2, {0: "1GiB", "cpu": "4GiB"},
                                   generation=allocator.GenerationBudget(2, 512)),
        "accelerate": allocator.plan(gpt2, {0: "150MiB", "cpu": "1GiB"}, strategy="sequential"),
        "two": allocator.plan(gpt2, {0: "200MiB", 1: "200MiB", "cpu": "1GiB"}, dtype="float16"),
    }


@pytest.mark.parametrize("kind", ["ram", "disk", "generate", "accelerate", "two"])
def test_to_dict_is_json_and_round_trips(gpt2, plans, kind):
    p = plans[kind]
    data = p.to_dict()
    text = json.dumps(data)  # raises on anything JSON cannot hold
    assert data["schema"] == SCHEMA
    assert data["device_map"] == p.device_map and data["main_device"] == p.main_device
    assert data["peak"] == {str(d): v for d, v in p.peak.items()}
    assert all(isinstance(k, str) for k in data["budgets"]) and list(data["budgets"])[-1] == "disk"
    assert data["estimate"]["seconds"] == p.cost.seconds
    assert data["estimate"]["streamed_per_forward_bytes"] == p.cost.streamed_bytes
    assert data["reserve_bytes"] == p.streamed and data["prefetch_reserve_bytes"] == p.prefetch
    assert "streamed" not in data and "streamed_bytes" not in data["estimate"]   # one word, one meaning
    assert data["model"]["class"] == "GPT2LMHeadModel" and data["model"]["bytes"] == p.problem.graph.total
    assert data["model"]["parameters"] == sum(t.numel() for t in gpt2.parameters())
    assert data["model"]["hash"].startswith("sha256:") and len(data["model"]["hash"]) == 7 + 64
    assert data["violations"] == [{"kind": v.kind, "message": v.message} for v in p.violations]
    assert data["valid"] is p.valid
    saved = allocator.Plan.from_dict(json.loads(text))
    assert isinstance(saved, SavedPlan)
    assert saved.to_dict() == data
    assert saved.device_map == p.device_map  # device indices stay integers, as device_map= takes them


@pytest.mark.parametrize("kind", ["ram", "disk", "generate", "accelerate", "two"])
def test_from_dict_with_the_model_revalidates(gpt2, plans, kind):
    p = plans[kind]
    again = allocator.Plan.from_dict(json.loads(json.dumps(p.to_dict())), gpt2)
    assert isinstance(again, allocator.Plan)
    assert again.device_map == p.device_map and again.main_device == p.main_device
    assert dict(again.peak) == dict(p.peak) and dict(again.parts) == dict(p.parts)
    assert again.violations == p.violations and again.cost == p.cost
    assert again.problem.budgets == p.problem.budgets


def test_from_dict_finds_what_breaks_on_another_model(gpt2, plans):
    data = plans["ram"].to_dict()
    data["budgets"]["0"] = 50 * MiB  # the same map under a smaller budget
    again = allocator.Plan.from_dict(data, gpt2)
    assert not again.valid and any(v.kind == "budget" for v in again.violations)
    with pytest.raises(allocator.PlanModelMismatch, match="this plan is for GPT2LMHeadModel"):
        allocator.Plan.from_dict(plans["ram"].to_dict(), zoo.build("bert-base"))


def _llama(layers):
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_from_dict_against_another_model_says_so():
    """Issue 37: a plan saved for a 12-layer model, read with a 14-layer one, is refused by name (the budgets alone
    need not break), and the error says the fix; the same model built in another process reads it."""
    twelve, fourteen = _llama(12), _llama(14)
    data = json.loads(json.dumps(allocator.plan(twelve, {0: "100MiB", "cpu": "1GiB"}).to_dict()))
    with pytest.raises(allocator.PlanModelMismatch) as caught:
        allocator.Plan.from_dict(data, fourteen)
    message = str(caught.value)
    assert isinstance(caught.value, allocator.InvalidModel)
    assert "this plan is for LlamaForCausalLM, " in message and "but the model is LlamaForCausalLM, " in message
    assert f"{data['model']['parameters']:,} parameters" in message
    assert "make a new plan with allocator.plan(" in message
    assert caught.value.saved == data["model"] and caught.value.given["hash"] != data["model"]["hash"]
    assert allocator.Plan.from_dict(data, _llama(12)).valid   # another instance of the same model


@pytest.mark.parametrize("kept", ["shapes and hash", "shapes", "hash"])
def test_a_model_of_the_same_class_and_size_with_other_shapes_is_refused(kept):
    """Issue 46: ``nn.Linear(4, 8)`` and ``nn.Linear(8, 4)`` (no bias: 32 parameters, 128 bytes, map ``{"": 0}``
    both) differ only in their weight's shape; the shapes and the hash each refuse the other on their own."""
    import torch

    data = json.loads(json.dumps(allocator.plan(torch.nn.Linear(4, 8, bias=False), {0: 1000}).to_dict()))
    other = torch.nn.Linear(8, 4, bias=False)
    assert data["model"]["parameters"] == sum(p.numel() for p in other.parameters())
    assert data["model"]["shapes"] == {"weight": [8, 4]}
    for name in ("shapes", "hash"):
        if name not in kept:
            data["model"][name] = None
    with pytest.raises(allocator.PlanModelMismatch, match="make a new plan") as caught:
        allocator.Plan.from_dict(data, other)
    if "shapes" in kept:
        assert "'weight' is [4, 8] in the model, [8, 4] in the plan" in str(caught.value)
    assert allocator.Plan.from_dict(data, torch.nn.Linear(4, 8, bias=False)).valid   # the same shapes read


@pytest.mark.subprocess
def test_model_hash_is_stable_across_processes():
    import subprocess
    import sys

    code = ("import torch, transformers; from allocator.model.read import identify\n"
            "c = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=12, "
            "num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)\n"
            "with torch.device('meta'): m = transformers.LlamaForCausalLM(c)\n"
            "print(identify(m).digest)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == allocator.build_problem(_llama(12), {"cpu": 0}).identity.digest


def test_options_dtype_is_the_resolved_dtype_from_python_and_the_cli(capsys, gpt2):
    """Issue 37: the same plan records the same dtype whichever path made it (float32: the model's own)."""
    python = allocator.plan(gpt2, {0: "200MiB", "cpu": "4GiB"}).to_dict()
    code, out, err = run(capsys, "plan", "gpt2", "--max-memory", "0=200MiB,cpu=4GiB", "--json", "-")
    assert code == 0 and python["options"]["dtype"] == json.loads(out)["options"]["dtype"] == "float32"


def test_a_plan_of_schema_1_is_read_without_a_model_check(gpt2, plans):
    """The old names are not read back (only the map, budgets, options and decisions are), so a /1 plan reads."""
    data = plans["ram"].to_dict()
    old = {**data, "schema": "allocator.plan/1", "model": {"class": data["model"]["class"],
                                                            "bytes": data["model"]["bytes"]}}
    old["streamed"] = old.pop("reserve_bytes")
    again = allocator.Plan.from_dict(json.loads(json.dumps(old)), gpt2)
    assert again.device_map == plans["ram"].device_map and again.valid


@pytest.mark.parametrize("data, words", [
    ([1, 2], "a saved plan is a JSON object"),
    ({"device_map": {"": 0}}, "not an allocator plan"),
    ({"schema": "allocator.plan/4", "device_map": {}}, "is not read by this version"),
    ({"schema": SCHEMA, "device_map": {"": 0}}, "has no main_device, budgets"),
])
def test_from_dict_refuses_what_is_not_a_plan(data, words):
    with pytest.raises(allocator.InvalidOption, match=words):
        allocator.Plan.from_dict(data)


def test_from_dict_asks_again_for_what_json_cannot_hold(gpt2, plans):
    data = plans["ram"].to_dict()
    data["options"]["not_saved"] = ["size_fn"]
    with pytest.raises(allocator.InvalidOption, match="pass them again"):
        allocator.Plan.from_dict(data, gpt2)


def test_cli_json_to_stdout_is_one_object(capsys, gpt2):
    code, out, err = run(capsys, "plan", "gpt2", "--max-memory", "0=200MiB,cpu=4GiB", "--json", "-")
    assert code == 0 and err == ""
    data = json.loads(out)  # the whole of stdout is one JSON object
    ours = allocator.plan(gpt2, {0: "200MiB", "cpu": "4GiB"}, dtype="float32")
    assert data["device_map"] == ours.device_map and data["main_device"] == 0
    assert data["peak"] == {str(d): v for d, v in ours.peak.items()}


def test_cli_json_file_and_from_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "gpt2", "--max-memory", "0=200MiB,cpu=4GiB", "--dtype", "bf16",
                         "--json", path)
    assert code == 0 and err == "" and f"plan written to {path}" in out
    data = json.loads(path.read_text())
    assert data["options"]["dtype"] == "bfloat16"
    code, again, err = run(capsys, "plan", "gpt2", "--from-json", path)
    assert code == 0 and err == "" and f"plan read from {path}" in again
    table = lambda text: text[text.index("device "):text.index("strategy ")]  # noqa: E731
    assert table(again) == table(out)
    data["budgets"]["0"] = 50 * MiB
    path.write_text(json.dumps(data))
    code, out, err = run(capsys, "plan", "gpt2", "--from-json", path)
    assert code == 1 and "VIOLATION budget" in out and "breaks" in out.splitlines()[-1]


@pytest.mark.parametrize("argv, words", [
    (["--from-json", "{tmp}/bad.json"], "is not a JSON file"),
    (["--from-json", "{tmp}/other.json"], "not an allocator plan"),
    (["--from-json", "{tmp}/other.json", "--max-memory", "0=1GiB"], "drop --max-memory"),
    (["--max-memory", "0=8GiB,0=4GiB"], "gives device '0' twice"),
    (["--max-memory", "0=8GiB,cuda:0=4GiB"], "twice"),
    (["--dtype", "bf17"], "is not a torch dtype"),
])
def test_cli_bad_input_is_one_line(capsys, tmp_path, argv, words):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    code, out, err = run(capsys, "plan", "gpt2", *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and out == "" and err.count("\n") == 1 and words in err, err


def test_dtype_aliases(capsys, gpt2):
    half = allocator.build_problem(gpt2, {"cpu": 0}, dtype="float16").graph.total
    for alias, name in (("bf16", "bfloat16"), ("fp16", "float16"), ("FP32", "float32")):
        assert allocator.PlanOptions(dtype=alias).dtype == alias  # kept as given, read as the torch dtype
        code, out, err = run(capsys, "plan", "gpt2", "--max-memory", "0=2GiB", "--dtype", alias)
        assert code == 0 and f" in {name}\n" in out
    assert allocator.build_problem(gpt2, {"cpu": 0}, dtype="fp16").graph.total == half


def test_a_file_inside_a_model_folder_asks_for_the_folder(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    for name in ("model.safetensors", "generation_config.json"):
        (tmp_path / name).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " if name.endswith("s") else b"{}")
        code, out, err = run(capsys, "plan", tmp_path / name, "--max-memory", "0=1GiB")
        assert code == 2 and f"pass the folder instead: {tmp_path}" in err, err
    code, out, err = run(capsys, "plan", tmp_path / "config.json", "--max-memory", "0=1GiB")
    assert code == 0, err


def test_each_empty_accelerator_gets_one_line_saying_why(capsys, gpt2):
    # GPU 0 is too small to be the main device, GPU 1 holds the model, GPU 2 is not needed
    budget = {0: "1MiB", 1: "2GiB", 2: "2GiB", "cpu": "4GiB"}
    p = allocator.plan(gpt2, budget)
    assert p.main_device == 1
    code, out, err = run(capsys, "plan", "gpt2", "--max-memory", "0=1MiB,1=2GiB,2=2GiB,cpu=4GiB")
    lines = [line for line in out.splitlines() if " is empty: " in line]
    assert [line.split()[0] for line in lines] == ["0", "2"]
    why = "\n".join(p.explain().splitlines())
    for line in lines:  # the plan's own explanation, not another one
        assert line.partition(" is empty: ")[2] in why


def test_status_line_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for enabled, stream, shown in ((True, Terminal(), True), (False, Terminal(), False), (True, io.StringIO(), False)):
        status = Status(enabled=enabled, stream=stream)
        status.say("building gpt2 on the meta device...")
        status.say("planning")
        status.clear()
        text = stream.getvalue()
        assert bool(text) is shown
        if shown:  # each message replaces the last, and the line is erased at the end
            assert text.startswith("\rallocator: building") and "\rallocator: planning" in text
            assert text.endswith("\r") and text.rsplit("\r", 2)[1].strip() == ""
