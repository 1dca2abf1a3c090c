"""Plans are made in the dtype ``from_pretrained`` would load: the config's ``dtype``, else the checkpoint index's,
else the first floating tensor of the weights (safetensors headers only), else float32 for a bare config; built-in
examples in their published checkpoint's dtype. Checked against transformers' own resolution (``_get_dtype``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import allocator
from allocator import cli
from allocator.model import zoo
from allocator.model.checkpoint import load_dtype, safetensors_dtypes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def folder(path, *, dtype=None, weights=None, index_dtype=None):
    """A model folder: config.json (with ``dtype`` or none), and ``weights`` ({name: tensor}) as model.safetensors,
    or as two shards and an index (with ``index_dtype`` in its metadata) when ``index_dtype`` is given."""
    path.mkdir(parents=True)
    config = transformers.LlamaConfig(**TINY).to_dict()
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if dtype is not None:
        config["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(config))
    if weights is None:
        return path
    if index_dtype is None:
        safetensors_torch.save_file(weights, str(path / "model.safetensors"))
        return path
    names = sorted(weights)
    shards = {"model-00002-of-00002.safetensors": names[::2], "model-00001-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        safetensors_torch.save_file({k: weights[k] for k in keys}, str(path / shard))
    index = {"metadata": {"dtype": index_dtype} if index_dtype else {},
             "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def transformers_dtype(path):
    """What transformers' ``from_pretrained`` resolves ``dtype="auto"`` (its default) to for ``path``."""
    from transformers import modeling_utils as mu

    get = getattr(mu, "_get_dtype", None)
    if get is None:
        pytest.skip("this transformers has no modeling_utils._get_dtype")
    config = transformers.AutoConfig.from_pretrained(path)
    files, metadata = allocator.model.checkpoint.weights_files(str(path))
    sharded = None
    if files and (path / "model.safetensors.index.json").exists():
        sharded = {**metadata}
    _, dtype = get("auto", files or None, config, sharded, None, True)
    return dtype


def test_zoo_entries_name_their_published_dtype_and_build_stays_float32():
    assert zoo.dtype("llama-8b") == "bfloat16" and zoo.ZOO["llama-8b"].dtype == "bfloat16"
    assert (zoo.dtype("opt-1.3b"), zoo.dtype("llava-1.5-7b"), zoo.dtype("t5-base")) == ("float16", "float16",
                                                                                         "float32")
    assert all(isinstance(getattr(torch, zoo.dtype(n)), torch.dtype) for n in zoo.names())
    assert {p.dtype for p in zoo.build("llama-3.2-1b").parameters()} == {torch.float32}
    with pytest.raises(KeyError, match="unknown zoo model"):
        zoo.dtype("nope")


@pytest.mark.parametrize("case", ["config", "weights", "index", "shards", "bare"])
def test_load_dtype_matches_transformers(tmp_path, case):
    weights = {"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.float16),
               "a.position_ids": torch.zeros(3, dtype=torch.int64),
               "model.norm.weight": torch.zeros(2, dtype=torch.bfloat16)}
    path = {
        "config": lambda p: folder(p, dtype="bfloat16", weights=weights),
        "weights": lambda p: folder(p, weights=weights),           # sorted keys: a.position_ids (int), then fp16
        "index": lambda p: folder(p, weights=weights, index_dtype="bfloat16"),
        "shards": lambda p: folder(p, weights=weights, index_dtype=""),  # first shard by name holds the fp16 tensor
        "bare": lambda p: folder(p),
    }[case](tmp_path / case)
    config = transformers.AutoConfig.from_pretrained(path)
    dtype, why = load_dtype(str(path), config.dtype)
    expected = {"config": torch.bfloat16, "weights": torch.float16, "index": torch.bfloat16, "shards": torch.float16,
                "bare": torch.float32}[case]
    assert dtype == expected
    assert {"config": "the config's dtype", "weights": "the dtype of the weights in model.safetensors",
            "index": "checkpoint index's metadata", "shards": "model-00001-of-00002.safetensors",
            "bare": "no weights are beside it"}[case] in why
    if case != "bare":  # transformers has nothing to resolve without weights
        assert transformers_dtype(path) == expected
    assert load_dtype(str(path / "config.json"), config.dtype) == (dtype, why)  # weights beside a config.json


def test_safetensors_header_is_read_without_the_data(tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"b": torch.zeros(1000, 1000, dtype=torch.bfloat16),
                                 "q": torch.zeros(8, dtype=torch.float8_e4m3fn)}, str(path))
    assert safetensors_dtypes(str(path)) == {"b": "bfloat16", "q": "float8_e4m3fn"}
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(allocator.InvalidModel, match="cannot read the safetensors header"):
        safetensors_dtypes(str(bad))


def test_cli_plans_a_folder_in_its_weights_dtype(tmp_path, capsys):
    path = folder(tmp_path / "m", weights={"lm_head.weight": torch.zeros(2, 2, dtype=torch.bfloat16)})
    assert cli.main(["plan", str(path), "--max-memory", "cpu=10MiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith(" in bfloat16")
    assert out[2] == ("dtype bfloat16 (the dtype of the weights in model.safetensors (the config names none), as "
                      "from_pretrained loads it)")
    assert cli.main(["plan", str(path), "--max-memory", "cpu=10MiB", "--dtype", "float16"]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("dtype float16 (--dtype; from_pretrained would load "
                                                              "bfloat16: the dtype of the weights in model.safetensors")


@pytest.mark.subprocess
def test_cli_plans_a_builtin_example_in_its_published_dtype():
    """``allocator plan llama-3.2-1b``: 2.3 GiB in bfloat16 (as from_pretrained loads it), not 4.6 GiB in float32."""
    model = zoo.build("llama-3.2-1b")
    float32 = allocator.build_problem(model, {"cpu": 0}).graph.total
    bf16 = allocator.build_problem(model, {"cpu": 0}, dtype=torch.bfloat16).graph.total
    done = subprocess.run([sys.executable, "-m", "allocator", "plan", "llama-3.2-1b", "--max-memory",
                           "0=1GiB,cpu=8GiB"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1] == f"LlamaForCausalLM: {cli._size(bf16)} in bfloat16"
    # half the weights; the float32 inv_freq (a non-persistent buffer: no loader casts it) keeps its size
    kept = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
               if name.rpartition(".")[2] in model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set)
    assert kept and 2 * bf16 - float32 == kept
    assert lines[2] == "dtype bfloat16 (the published checkpoint's dtype, as from_pretrained loads it)"


def test_modules_kept_in_float32_are_those_from_pretrained_keeps(tmp_path):
    """T5 keeps ``wo`` in float32 when loaded in float16 (``_keep_in_fp32_modules``), not in bfloat16: a real
    ``from_pretrained`` of a tiny T5 agrees with :func:`kept_in_float32` tensor for tensor."""
    from allocator.model.checkpoint import kept_in_float32

    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    for dtype in (torch.float16, torch.bfloat16):
        loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "t5", dtype=dtype)
        float32 = {n for n, p in loaded.named_parameters() if p.dtype == torch.float32}
        kept, patterns = kept_in_float32(loaded, dtype)
        assert float32 == {n for n in kept if n in dict(loaded.named_parameters())}
        assert (patterns, bool(float32)) == ((["wo"], True) if dtype == torch.float16 else ([], False))


def test_cli_says_which_tensors_stay_float32(capsys):
    assert cli.main(["plan", "t5-base", "--dtype", "float16", "--max-memory", "0=1GiB,cpu=8GiB"]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.endswith("; 24 tensors kept in float32, as from_pretrained keeps wo")
