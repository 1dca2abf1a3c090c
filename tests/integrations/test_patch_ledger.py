"""Loads in one ``allocator.patch()`` block share the machine (issue #47): a ``from_pretrained(device_map="auto")``
without ``max_memory`` plans in what the earlier loads of the block left — the machine's free memory, less what they
will still need (KV cache, reserves, activations) — and says so; one with ``max_memory`` plans it as given. A tiny
target and draft loaded that way generate with ``assistant_model=`` the tokens the pair gives in RAM."""

from __future__ import annotations

import logging

import pytest
import torch

import allocator
from allocator.integrations.ledger import LOADED

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=128, tie_word_embeddings=False)
GEN = allocator.GenerationBudget(1, 64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ledger")
    torch.manual_seed(0)
    out = {}
    for name, layers in (("target", 4), ("draft", 1)):
        AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=layers, **CONFIG)).save_pretrained(root / name)
        out[name] = root / name
    return out


def _owed(plan) -> dict:
    return {d: sum(v for k, v in parts.items() if k not in LOADED) for d, parts in plan.parts.items()}


def test_a_second_load_without_max_memory_plans_in_what_the_first_left(folders, caplog):
    with caplog.at_level(logging.INFO, logger="allocator.integrations"):
        with allocator.patch(generation=GEN):
            target = AutoModelForCausalLM.from_pretrained(folders["target"], device_map="auto").eval()
            assert "planned in what the earlier loads" not in caplog.text   # the first load has the machine
            draft = AutoModelForCausalLM.from_pretrained(folders["draft"], device_map="auto").eval()
    said = [r.getMessage() for r in caplog.records if "planned in what the earlier loads" in r.getMessage()]
    assert len(said) == 1 and "LlamaForCausalLM still need" in said[0], said
    owed = _owed(allocator.plan_of(target))
    assert owed.get("cpu", 0) > 0   # its KV cache, logits and activations for generate, not yet allocated
    ram = {n: AutoModelForCausalLM.from_pretrained(f).eval() for n, f in folders.items()}
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = ram["target"].generate(prompt, assistant_model=ram["draft"], **kwargs)
    assert torch.equal(target.generate(prompt, assistant_model=draft, **kwargs), want)


def test_a_max_memory_the_caller_gives_is_planned_as_given(folders, caplog):
    budget = {"cpu": "64MiB"}
    with caplog.at_level(logging.INFO, logger="allocator.integrations"):
        with allocator.patch(generation=GEN):
            AutoModelForCausalLM.from_pretrained(folders["target"], device_map="auto", max_memory=dict(budget))
            draft = AutoModelForCausalLM.from_pretrained(folders["draft"], device_map="auto", max_memory=dict(budget))
    assert "planned in what the earlier loads" not in caplog.text
    assert allocator.plan_of(draft).problem.budgets.limit("cpu") == 64 * 2 ** 20


def test_the_ledger_takes_off_only_what_the_earlier_loads_still_need():
    from allocator.integrations.ledger import Ledger

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    plan = allocator.plan(model, {0: 10 ** 6, "cpu": 10 ** 6}, runtime="allocator")
    ledger = Ledger()
    ledger.add(plan, "Sequential")
    owed = _owed(plan)
    left = ledger.left({0: 10 ** 6, "cpu": 10 ** 6}, shared=True)
    assert left == {d: 10 ** 6 - owed.get(d, 0) for d in (0, "cpu")}
    assert ledger.left({0: 10 ** 6}, shared=False) == {0: 10 ** 6}
