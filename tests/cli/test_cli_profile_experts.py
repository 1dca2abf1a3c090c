"""``allocator profile-experts FOLDER --prompts FILE --out FILE`` (issue #39): the routing counts of the model on the
prompts, equal to :func:`allocator.profile_experts` run in process, written as the JSON ``allocator plan --runtime
allocator --expert-profile FILE`` reads; and its bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import allocator
from allocator import cli

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import save_tokenizer, small_model  # noqa: E402

PROMPTS = "w1 w5 w9 w3\n\nw7 w7 w100 w2 w64\nhello w12 w12\n"


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Qwen3-MoE (4 layers of 8 experts, top-2) saved with its weights and a word-level tokenizer, and the model."""
    path = tmp_path_factory.mktemp("moe") / "qwen3"
    model = small_model("qwen3_moe", layers=4, architectures=["Qwen3MoeForCausalLM"])
    model.save_pretrained(path)
    save_tokenizer(path)
    return path, model


@pytest.mark.slow
@pytest.mark.parametrize("new_tokens", [0, 3])
def test_the_recorded_profile_is_the_models_routing_on_the_prompts(capsys, folder, tmp_path, new_tokens):
    import torch

    path, model = folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    out_file = tmp_path / "experts.json"
    code, out, err = run(capsys, "profile-experts", path, "--prompts", prompts, "--out", out_file,
                         "--max-new-tokens", new_tokens)
    assert code == 0, err
    assert err == ""
    recorded = allocator.ExpertProfile.load(out_file)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batches = []
    for line in filter(None, (t.strip() for t in PROMPTS.splitlines())):
        ids = tokenizer(line, return_tensors="pt")["input_ids"]
        if new_tokens:
            with torch.no_grad():
                ids = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        batches.append({"input_ids": ids})
    assert recorded == allocator.profile_experts(model, batches)
    assert recorded.tokens == sum(b["input_ids"].shape[1] for b in batches) == 4 + 5 + 3 + 3 * new_tokens
    assert f"{recorded.tokens} tokens over 3 prompts; 4 mixture-of-experts layers of 8 experts" in out
    code, planned, err = run(capsys, "plan", path, "--max-memory", "cpu=400KiB", "--runtime", "allocator",
                             "--expert-profile", out_file, "--json", "-")
    assert code == 0, err
    assert json.loads(planned)["options"]["expert_profile"]["tokens"] == recorded.tokens


def test_bad_profile_experts_input_exits_2_with_one_line(capsys, folder, tmp_path):
    path, _ = folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    no_weights = tmp_path / "no_weights"
    transformers.AutoConfig.from_pretrained(path).save_pretrained(no_weights)
    save_tokenizer(no_weights)
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((path / name).read_bytes())
    dense = tmp_path / "dense"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128,
                             architectures=["LlamaForCausalLM"]).save_pretrained(dense)
    out = tmp_path / "e.json"
    cases = {
        "no prompts flag": (["profile-experts", path, "--out", out], "--prompts"),
        "missing prompts": (["profile-experts", path, "--prompts", tmp_path / "none.txt", "--out", out],
                            "cannot read it"),
        "blank prompts": (["profile-experts", path, "--prompts", tmp_path / "blank.txt", "--out", out],
                          "holds no prompt"),
        "binary prompts": (["profile-experts", path, "--prompts", tmp_path / "binary.txt", "--out", out],
                           "cannot read it"),
        "missing folder": (["profile-experts", tmp_path / "none", "--prompts", prompts, "--out", out],
                           "is neither a model folder"),
        "dense model": (["profile-experts", dense, "--prompts", prompts, "--out", out], "no mixture-of-experts"),
        "no weights": (["profile-experts", no_weights, "--prompts", prompts, "--out", out],
                       "cannot load the weights"),
        "no tokenizer": (["profile-experts", no_tokenizer, "--prompts", prompts, "--out", out], "no tokenizer"),
        "out folder missing": (["profile-experts", path, "--prompts", prompts, "--out", tmp_path / "no" / "e.json"],
                               "does not exist"),
        "negative new tokens": (["profile-experts", path, "--prompts", prompts, "--out", out, "--max-new-tokens",
                                 "-1"], "0 or more"),
    }
    failures = []
    for name, (argv, expected) in cases.items():
        code, stdout, err = run(capsys, *argv)
        if not (code == 2 and stdout == "" and err.startswith("allocator: error: ") and err.count("\n") == 1
                and "Traceback" not in err and expected in err):
            failures.append(f"{name}: exit {code}, stdout {stdout[:200]!r}, stderr {err[:400]!r}")
    assert not failures, "\n".join(failures)
    assert not out.exists()


def test_a_folder_without_a_tokenizer_is_one_line_naming_the_cause_and_the_fix(capsys, tmp_path):
    """Issue #48: transformers' error for a Mixtral folder without tokenizer files runs over five lines (the three
    ways it tried, and sentencepiece); ours names the cause in one line, says the fix, and keeps transformers' error as
    its ``__cause__``."""
    from moe_models import small_config

    from allocator.cli.record import load_tokenizer

    folder = tmp_path / "mixtral"
    small_config("mixtral", 1, architectures=["MixtralForCausalLM"]).save_pretrained(folder)
    with pytest.raises(allocator.InvalidModel) as raised:
        load_tokenizer(str(folder))
    message = str(raised.value)
    assert message == (f"{folder} has no tokenizer transformers can load: the folder holds no tokenizer file "
                       "(tokenizer.json, tokenizer_config.json, tokenizer.model, ...); save the model's tokenizer "
                       f"beside it with tokenizer.save_pretrained({str(folder)!r}).")
    cause = raised.value.__cause__
    assert isinstance(cause, ValueError) and str(cause).count("\n") >= 3   # transformers' own, whole
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    code, out, err = run(capsys, "profile-experts", folder, "--prompts", prompts, "--out", tmp_path / "e.json")
    assert (code, out, err) == (2, "", f"allocator: error: {message}\n")


def test_a_tokenizer_file_transformers_fails_on_is_named_with_its_error_in_short(tmp_path):
    from moe_models import small_config

    from allocator.cli.record import load_tokenizer

    folder = tmp_path / "mixtral"
    small_config("mixtral", 1, architectures=["MixtralForCausalLM"]).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(allocator.InvalidModel) as raised:
        load_tokenizer(str(folder))
    message = str(raised.value)
    assert message.startswith(f"{folder} has no tokenizer transformers can load: transformers fails on its "
                              "tokenizer.json (")
    short = message.replace(str(folder), "<folder>")   # the temporary folder's path is as long as the machine makes it
    assert "\n" not in message and len(short) < 300 and raised.value.__cause__ is not None
