"""Small real mixture-of-experts models built from configs, shared by the discovery and runtime tests.

``SMALL`` holds, per family, the config fields that make it small and top-2; ``small_model`` builds one on the CPU
with seeded weights (no download).
"""

from __future__ import annotations

import torch

SMALL = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_key_value_heads=4),
}


def small_config(family: str, layers: int = 2, **extra):
    """The small config of ``family`` (``SMALL``): hidden 64, vocab 128, top-2, ``layers`` layers."""
    from transformers import AutoConfig

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, head_dim=16)
    base.update(SMALL[family])
    if family == "gpt_oss":
        base["layer_types"] = ["full_attention"] * layers
    base.update(extra)
    return AutoConfig.for_model(family, **base)


def small_model(family: str, layers: int = 2, **extra):
    """A real model of ``family`` from a small config, built on the CPU (seeded)."""
    from transformers import AutoModelForCausalLM

    config = small_config(family, layers, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def save_tokenizer(folder, vocab_size: int = 128) -> None:
    """A word-level tokenizer of ``vocab_size`` words (``w0`` ... and ``[UNK]`` as id 0) saved in ``folder``: what
    ``AutoTokenizer.from_pretrained(folder)`` reads, made without a download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(folder)
