"""The lower-case "b" (bits) warning reaches ``from_pretrained`` users under :func:`allocator.patch`: transformers'
``get_max_memory`` converts ``"100Mb"`` to 12,500,000 bytes without a word, so the hook reads the caller's strings
first."""

from __future__ import annotations

import warnings

import pytest

import allocator

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def loaded_warnings(folder, max_memory):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with allocator.patch():
            transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=max_memory)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_bits_warning_reaches_from_pretrained(folder):
    budget = {"cpu": "100Mb"}
    found = [m for m in loaded_warnings(folder, budget) if "lower-case 'b' (bits)" in m]
    assert found == ["max_memory['cpu'] '100Mb' is read as 100 Mbit = 12500000 bytes (12.5 MB), as accelerate reads "
                     "a lower-case 'b' (bits); write '100MB' for 100 MB."]
    assert budget == {"cpu": "100Mb"}  # the caller's dict is not converted in place


def test_bytes_give_no_bits_warning(folder):
    assert not [m for m in loaded_warnings(folder, {"cpu": "100MB"}) if "bits" in m]


def test_a_fractional_float_warns_once_and_transformers_own_float_not_at_all(folder):
    """transformers' get_max_memory passes a user's float through, and without max_memory makes RAM's budget 90 % of
    the free memory, a float: the user's is said once (with the bytes it became), transformers' never."""
    found = [m for m in loaded_warnings(folder, {"cpu": 5e8 + 0.5}) if "whole number of bytes" in m]
    assert found == ["max_memory['cpu'] = 500000000.5 is not a whole number of bytes; it is read as 500000000 bytes, "
                     "as accelerate compares it with whole byte counts; give the int 500000000."]
    assert not [m for m in loaded_warnings(folder, None) if "whole number of bytes" in m]
