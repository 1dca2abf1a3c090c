"""A model read from a folder or a config.json says what it is (:func:`allocator.model.load.shape_of`), and a field
that sets its size but is missing from config.json gets one warning naming the default transformers used
(issue 37: a Llama without ``num_hidden_layers`` planned at 32 layers, silently)."""

from __future__ import annotations

import json
import warnings

import pytest

from allocator.model.load import load_model, missing_size_fields

transformers = pytest.importorskip("transformers")

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)


def folder_without(path, config, *fields):
    config.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    for name in fields:
        data.pop(name)
    (path / "config.json").write_text(json.dumps(data))
    return path


def loaded(source):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = load_model(str(source))
    return found, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_missing_layer_count_warns_once_naming_the_default(tmp_path):
    path = folder_without(tmp_path / "llama", transformers.LlamaConfig(**LLAMA), "num_hidden_layers")
    found, said = loaded(path)
    assert found.missing == (("num_hidden_layers", 32),)
    assert len(said) == 1 and "num_hidden_layers" in said[0] and "default 32" in said[0], said
    assert found.shape.startswith("32 layers, hidden 64, 4/2 heads, vocab 1000, ")


def test_a_complete_config_does_not_warn_and_says_its_shape(tmp_path):
    path = folder_without(tmp_path / "llama", transformers.LlamaConfig(**LLAMA))
    found, said = loaded(path / "config.json")
    assert said == [] and found.missing == ()
    parameters = sum(p.numel() for p in found.model.parameters())
    assert found.shape == f"2 layers, hidden 64, 4/2 heads, vocab 1000, {parameters:,} parameters"


@pytest.mark.parametrize("config, dropped, named", [
    (transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100), ["n_layer", "vocab_size"],
     ["n_layer", "vocab_size"]),   # the model type's own names (attribute_map)
    (transformers.MixtralConfig(**LLAMA, num_local_experts=4), ["num_local_experts", "intermediate_size"],
     ["intermediate_size", "num_local_experts"]),
    (transformers.OlmoeConfig(**LLAMA, num_experts=4), ["num_experts"], ["num_experts"]),
])
def test_each_size_field_under_the_model_types_own_name(tmp_path, config, dropped, named):
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    full = missing_size_fields(type(config).from_pretrained(tmp_path), data)
    for name in dropped:
        data.pop(name)
    assert full == [] and [name for name, _ in missing_size_fields(config, data)] == named


def test_a_sub_config_is_read_from_its_own_object(tmp_path):
    config = transformers.LlavaConfig(text_config=transformers.LlamaConfig(**LLAMA).to_dict())
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert [n for n, _ in missing_size_fields(config, data) if n.startswith("text_config.")] == []
    del data["text_config"]["num_hidden_layers"]
    assert ("text_config.num_hidden_layers", 2) in missing_size_fields(config, data)


def test_transformers_error_on_a_config_is_named_in_one_sentence_and_kept_as_the_cause(tmp_path):
    """Issue #48: transformers' error for an unknown model type runs over several sentences (how to upgrade, how to
    install from source); ours names its first sentence and the fix, and keeps the whole as ``__cause__``."""
    from allocator.errors import InvalidModel

    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(InvalidModel) as raised:
        load_model(str(tmp_path))
    message, cause = str(raised.value), raised.value.__cause__
    assert message == (f"transformers cannot read the config {tmp_path}: ValueError: The checkpoint you are trying to "
                       "load has model type `no-such-architecture` but Transformers does not recognize this "
                       "architecture; fix its config.json where that names a field, or give the folder of a model "
                       "transformers knows.")
    assert isinstance(cause, ValueError) and "pip install" in str(cause) and "pip install" not in message


def test_a_config_transformers_cannot_build_keeps_its_error_as_the_cause(tmp_path):
    from allocator.errors import InvalidModel

    transformers.LlamaConfig(**{**LLAMA, "hidden_act": "no-such-activation"}).save_pretrained(tmp_path)
    with pytest.raises(InvalidModel, match=r"transformers cannot build .* from .*: KeyError: .*; fix "
                                           r"the config's fields it names\.$") as raised:
        load_model(str(tmp_path))
    assert isinstance(raised.value.__cause__, KeyError)
