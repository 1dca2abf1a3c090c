"""The zoo's catalogue as data: one row per real ``transformers`` architecture (:data:`SPECS`), with the published
sizes of a well-known checkpoint written out as config keyword arguments, and the families rows are filed under
(:data:`FAMILIES`). No code of its own per row: :mod:`allocator.model.zoo` builds any row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONFIG_KEY", "FAMILIES", "SPECS", "ZooSpec", "nested"]

#: The families an entry may belong to, in catalogue order.
FAMILIES: tuple[str, ...] = (
    "dense-llm",
    "moe-llm",
    "encoder-decoder",
    "encoder",
    "vision",
    "vlm",
    "speech",
    "ssm",
)

#: The key of a nested dict that names its config class (see :func:`nested`).
CONFIG_KEY = "__config__"


def nested(config_class: str, **kwargs: Any) -> dict[str, Any]:
    """A sub-config as data: ``{"__config__": config_class, **kwargs}``, built by :func:`allocator.model.zoo.build`
    as ``transformers.<config_class>(**kwargs)``. A nested dict without the key stays a dict (CLIP takes dicts)."""
    return {CONFIG_KEY: config_class, **kwargs}


@dataclass(frozen=True, slots=True)
class ZooSpec:
    """One row of the catalogue: everything :func:`allocator.model.zoo.build` needs, as data (no entry needs code of
    its own)."""

    name: str
    family: str
    model: str  # the model class in the ``transformers`` namespace
    config: str  # the config class in the ``transformers`` namespace
    dtype: str  # the published checkpoint's dtype (:attr:`ZooEntry.dtype`)
    description: str  # without the model class, which the zoo appends
    kwargs: dict[str, Any] = field(default_factory=dict)  # the config's keyword arguments; see :func:`nested`
    # a module whose training-only scipy requirement is lifted during the build
    no_scipy_check: str | None = None


SPECS: tuple[ZooSpec, ...] = (
    # -- dense decoder-only LLMs
    ZooSpec("llama-8b", "dense-llm", "LlamaForCausalLM", "LlamaConfig", "bfloat16",
            "Meta-Llama-3-8B: 32 layers, hidden 4096, GQA 32/8 heads, vocab 128256, untied head",
            dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)),
    ZooSpec("llama-70b", "dense-llm", "LlamaForCausalLM", "LlamaConfig", "bfloat16",
            "Meta-Llama-3-70B: 80 layers, hidden 8192, GQA 64/8 heads, vocab 128256, untied head",
            dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)),
    ZooSpec("llama-3.2-1b", "dense-llm", "LlamaForCausalLM", "LlamaConfig", "bfloat16",
            "Llama-3.2-1B: 16 layers, hidden 2048, GQA 32/8 heads, vocab 128256, tied embeddings",
            dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                 rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=True)),
    ZooSpec("mistral-7b", "dense-llm", "MistralForCausalLM", "MistralConfig", "bfloat16",
            "Mistral-7B-v0.1: 32 layers, hidden 4096, GQA 32/8 heads, vocab 32000, untied head",
            dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)),
    ZooSpec("qwen2-0.5b", "dense-llm", "Qwen2ForCausalLM", "Qwen2Config", "bfloat16",
            "Qwen2-0.5B: 24 layers, hidden 896, GQA 14/2 heads, vocab 151936, tied embeddings (embedding is ~27% of the"
            " model)",
            dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)),
    ZooSpec("qwen3-0.6b", "dense-llm", "Qwen3ForCausalLM", "Qwen3Config", "bfloat16",
            "Qwen3-0.6B: 28 layers, hidden 1024, GQA 16/8 heads of dim 128, vocab 151936, tied embeddings",
            dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)),
    ZooSpec("gemma4-e4b", "dense-llm", "Gemma4ForCausalLM", "Gemma4TextConfig", "bfloat16",
            "gemma-4-E4B's text model, as published model cards describe it (no checkpoint read): 42 layers, 5 "
            "sliding (window 512) to 1 full, hidden 2560, GQA 8/2 heads of dim 256 (512 on full layers), the last 18 "
            "layers reuse earlier layers' keys and values (no cache of their own), per-layer embeddings of 256 per "
            "layer, vocab 262144, tied embeddings",
            dict(vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
                 num_kv_shared_layers=18, sliding_window=512, max_position_embeddings=131072,
                 vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)),
    ZooSpec("gemma-2b", "dense-llm", "GemmaForCausalLM", "GemmaConfig", "bfloat16",
            "gemma-2b: 18 layers, hidden 2048, MQA 8/1 heads of dim 256, vocab 256000, tied embeddings (embedding is "
            "~21% of the model)",
            dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                 num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)),
    ZooSpec("gemma2-2b", "dense-llm", "Gemma2ForCausalLM", "Gemma2Config", "float32",
            "gemma-2-2b: 26 layers, hidden 2304, GQA 8/4 heads of dim 256, vocab 256000, tied embeddings",
            dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                 sliding_window=4096, query_pre_attn_scalar=256, final_logit_softcapping=30.0,
                 attn_logit_softcapping=50.0, tie_word_embeddings=True)),
    ZooSpec("phi-3-mini", "dense-llm", "Phi3ForCausalLM", "Phi3Config", "bfloat16",
            "Phi-3-mini-4k-instruct: 32 layers, hidden 3072, 32 heads (no GQA), fused qkv and gate_up projections, "
            "vocab 32064, untied head",
            dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 original_max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=32000, bos_token_id=1,
                 eos_token_id=32000, tie_word_embeddings=False)),
    ZooSpec("gpt2", "dense-llm", "GPT2LMHeadModel", "GPT2Config", "float32",
            "gpt2 (124M): 12 layers, hidden 768, Conv1D projections, vocab 50257, tied embeddings",
            dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, tie_word_embeddings=True)),
    ZooSpec("opt-1.3b", "dense-llm", "OPTForCausalLM", "OPTConfig", "float16",
            "facebook/opt-1.3b: 24 layers, hidden 2048, ffn 8192, 32 heads, vocab 50272, learned positions, tied "
            "embeddings",
            dict(vocab_size=50272, hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
                 max_position_embeddings=2048, word_embed_proj_dim=2048, do_layer_norm_before=True, enable_bias=True,
                 tie_word_embeddings=True)),
    ZooSpec("bloom-560m", "dense-llm", "BloomForCausalLM", "BloomConfig", "float16",
            "bigscience/bloom-560m: 24 layers, hidden 1024, 16 heads, ALiBi, vocab 250880, tied embeddings (embedding "
            "is ~46% of the model)",
            dict(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16, tie_word_embeddings=True)),
    ZooSpec("falcon-7b", "dense-llm", "FalconForCausalLM", "FalconConfig", "bfloat16",
            "tiiuae/falcon-7b: 32 layers, hidden 4544, 71 heads with multi-query attention, parallel attention/MLP, "
            "vocab 65024, tied embeddings",
            dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
                 parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False,
                 max_position_embeddings=2048, bos_token_id=11, eos_token_id=11, tie_word_embeddings=True)),
    # -- mixture-of-experts LLMs
    ZooSpec("mixtral-8x7b", "moe-llm", "MixtralForCausalLM", "MixtralConfig", "bfloat16",
            "Mixtral-8x7B-v0.1: 32 layers, hidden 4096, 8 experts (top-2) of size 14336, GQA 32/8 heads, vocab 32000, "
            "untied head",
            dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    ZooSpec("qwen2-moe-a2.7b", "moe-llm", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "bfloat16",
            "Qwen1.5-MoE-A2.7B: 24 layers, hidden 2048, 60 experts (top-4) of size 1408 plus a shared expert of size "
            "5632, vocab 151936, untied head",
            dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                 moe_intermediate_size=1408, shared_expert_intermediate_size=5632, decoder_sparse_step=1,
                 max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    ZooSpec("qwen3-moe-30b-a3b", "moe-llm", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "bfloat16",
            "Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts (top-8) of size 768, GQA 32/4 heads of dim 128, vocab "
            "151936, untied head",
            dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=768, decoder_sparse_step=1, max_position_embeddings=40960, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)),
    ZooSpec("deepseek-v2-lite", "moe-llm", "DeepseekV2ForCausalLM", "DeepseekV2Config", "bfloat16",
            "DeepSeek-V2-Lite: 27 layers (first dense), hidden 2048, MLA (kv_lora_rank 512), 64 routed experts (top-6) "
            "+ 2 shared of size 1408, vocab 102400, untied head",
            dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                 num_attention_heads=16, num_key_value_heads=16, first_k_dense_replace=1, kv_lora_rank=512,
                 q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                 n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408, routed_scaling_factor=1.0,
                 topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, max_position_embeddings=163840,
                 rms_norm_eps=1e-6, bos_token_id=100000, eos_token_id=100001, tie_word_embeddings=False)),
    ZooSpec("olmoe-1b-7b", "moe-llm", "OlmoeForCausalLM", "OlmoeConfig", "bfloat16",
            "OLMoE-1B-7B-0924: 16 layers, hidden 2048, 64 experts (top-8) of size 1024, vocab 50304, untied head",
            dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                 max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=1, bos_token_id=None, eos_token_id=50279,
                 tie_word_embeddings=False)),
    # -- encoder-decoder
    ZooSpec("t5-base", "encoder-decoder", "T5ForConditionalGeneration", "T5Config", "float32",
            "google-t5/t5-base: 12+12 layers, d_model 768, ReLU FFN 3072, vocab 32128, shared embedding tied to "
            "encoder, decoder and lm_head",
            dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12,
                 relative_attention_num_buckets=32, feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0,
                 eos_token_id=1, decoder_start_token_id=0)),
    ZooSpec("flan-t5-large", "encoder-decoder", "T5ForConditionalGeneration", "T5Config", "float32",
            "google/flan-t5-large: 24+24 layers, d_model 1024, gated-GELU FFN 2816, vocab 32128; the checkpoint's "
            "lm_head is untied (783M params), but transformers 5 forces T5Config.tie_word_embeddings=True, so lm_head "
            "is tied to shared here (750M)",
            dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_decoder_layers=24, num_heads=16,
                 relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
    ZooSpec("bart-large", "encoder-decoder", "BartForConditionalGeneration", "BartConfig", "float32",
            "facebook/bart-large: 12+12 layers, d_model 1024, 16 heads, FFN 4096, vocab 50265, shared embedding tied to"
            " the lm_head",
            dict(vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                 decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=1024,
                 scale_embedding=False, tie_word_embeddings=True)),
    # -- encoders
    ZooSpec("bert-base", "encoder", "BertForMaskedLM", "BertConfig", "float32",
            "google-bert/bert-base-uncased: 12 layers, hidden 768, vocab 30522, MLM head tied to the word embeddings",
            dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2, tie_word_embeddings=True)),
    ZooSpec("roberta-base", "encoder", "RobertaForMaskedLM", "RobertaConfig", "float32",
            "FacebookAI/roberta-base: 12 layers, hidden 768, vocab 50265, 514 positions, MLM head tied to the word "
            "embeddings",
            dict(vocab_size=50265, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                 pad_token_id=1, bos_token_id=0, eos_token_id=2, tie_word_embeddings=True)),
    ZooSpec("clip-vit-base", "encoder", "CLIPModel", "CLIPConfig", "float32",
            "openai/clip-vit-base-patch32 (multimodal dual encoder): text 12 layers x 512, vision ViT-B/32 12 layers x "
            "768, projection 512",
            dict(text_config=dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                                  num_attention_heads=8, max_position_embeddings=77, projection_dim=512),
                 vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                    num_attention_heads=12, image_size=224, patch_size=32, projection_dim=512),
                 projection_dim=512)),
    # -- vision
    ZooSpec("vit-base", "vision", "ViTForImageClassification", "ViTConfig", "float32",
            "google/vit-base-patch16-224: 12 layers, hidden 768, patch 16 at 224px, 1000 classes",
            dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, image_size=224,
                 patch_size=16, num_labels=1000)),
    ZooSpec("swin-tiny", "vision", "SwinForImageClassification", "SwinConfig", "float32",
            "microsoft/swin-tiny-patch4-window7-224: embed 96, depths 2-2-6-2, window 7, 1000 classes",
            dict(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                 window_size=7, mlp_ratio=4.0, drop_path_rate=0.1, num_labels=1000)),
    ZooSpec("convnext-tiny", "vision", "ConvNextForImageClassification", "ConvNextConfig", "float32",
            "facebook/convnext-tiny-224: widths 96-192-384-768, depths 3-3-9-3, 1000 classes",
            dict(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3], drop_path_rate=0.0, num_labels=1000)),
    ZooSpec("segformer-b0", "vision", "SegformerForSemanticSegmentation", "SegformerConfig", "float32",
            "nvidia/segformer-b0-finetuned-ade-512-512: MiT-b0 encoder (32-64-160-256), all-MLP decoder 256, 150 "
            "classes",
            dict(num_channels=3, num_encoder_blocks=4, depths=[2, 2, 2, 2], sr_ratios=[8, 4, 2, 1],
                 hidden_sizes=[32, 64, 160, 256], patch_sizes=[7, 3, 3, 3], strides=[4, 2, 2, 2],
                 num_attention_heads=[1, 2, 5, 8], mlp_ratios=[4, 4, 4, 4], decoder_hidden_size=256, num_labels=150)),
    ZooSpec("dinov2-base", "vision", "Dinov2Model", "Dinov2Config", "float32",
            "facebook/dinov2-base: ViT-B/14 at 518px, 12 layers, hidden 768, layer scale",
            dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, mlp_ratio=4, image_size=518,
                 patch_size=14, layerscale_value=1.0)),
    ZooSpec("detr-resnet-50", "vision", "DetrForObjectDetection", "DetrConfig", "float32",
            "facebook/detr-resnet-50 sizes (6+6 layer transformer, d_model 256, 100 queries, 91 classes) with the "
            "native transformers ResNet-50 backbone instead of timm's",
            dict(backbone_config=nested(  # ResNet-50 as a native transformers backbone (no timm, nothing pretrained)
                     "ResNetConfig", num_channels=3, embedding_size=64, hidden_sizes=[256, 512, 1024, 2048],
                     depths=[3, 4, 6, 3], layer_type="bottleneck", hidden_act="relu", downsample_in_first_stage=False,
                     out_features=["stage4"]),
                 num_queries=100, d_model=256, encoder_layers=6, decoder_layers=6, encoder_ffn_dim=2048,
                 decoder_ffn_dim=2048, encoder_attention_heads=8, decoder_attention_heads=8, num_labels=91)),
    ZooSpec("mask2former-swin-tiny", "vision", "Mask2FormerForUniversalSegmentation", "Mask2FormerConfig", "float32",
            "facebook/mask2former-swin-tiny-coco-instance: Swin-T backbone (native SwinConfig, nothing pretrained), "
            "6-layer pixel decoder, 10-layer masked-attention decoder, 100 queries, 80 classes; scipy, needed only by "
            "the training loss, is not required to build",
            dict(backbone_config=nested(
                     "SwinConfig", image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2],
                     num_heads=[3, 6, 12, 24], window_size=7, drop_path_rate=0.3,
                     out_features=["stage1", "stage2", "stage3", "stage4"]),
                 feature_size=256, mask_feature_size=256, hidden_dim=256, encoder_feedforward_dim=1024,
                 encoder_layers=6, decoder_layers=10, num_attention_heads=8, dim_feedforward=2048, num_queries=100,
                 num_labels=80),
            no_scipy_check="transformers.models.mask2former.modeling_mask2former"),
    ZooSpec("sam-vit-base", "vision", "SamModel", "SamConfig", "float32",
            "facebook/sam-vit-base (promptable segmentation, multimodal encoder): ViT-B image encoder at 1024px with "
            "windowed attention, prompt encoder, two-way mask decoder",
            dict(vision_config=nested(
                     "SamVisionConfig", hidden_size=768, output_channels=256, num_hidden_layers=12,
                     num_attention_heads=12, image_size=1024, patch_size=16, window_size=14,
                     global_attn_indexes=[2, 5, 8, 11], mlp_dim=3072, use_abs_pos=True, use_rel_pos=True))),
    # -- vision-language models
    ZooSpec("llava-1.5-7b", "vlm", "LlavaForConditionalGeneration", "LlavaConfig", "float16",
            "llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14-336 vision tower (24 layers x 1024), 2-layer MLP projector, "
            "Vicuna/Llama-2-7B text model (32 layers x 4096, vocab 32064)",
            dict(vision_config=nested(
                     "CLIPVisionConfig", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768,
                     hidden_act="quick_gelu"),
                 text_config=nested(
                     "LlamaConfig", vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                     pad_token_id=32001, tie_word_embeddings=False),
                 image_token_index=32000, image_seq_length=576, projector_hidden_act="gelu",
                 vision_feature_select_strategy="default", vision_feature_layer=-2, tie_word_embeddings=False)),
    ZooSpec("gemma3-4b", "vlm", "Gemma3ForConditionalGeneration", "Gemma3Config", "bfloat16",
            "google/gemma-3-4b-it: SigLIP-So400m vision tower at 896px (27 layers x 1152), Gemma-3 text model (34 "
            "layers x 2560, GQA 8/4, vocab 262208), tied embeddings",
            dict(text_config=nested(
                     "Gemma3TextConfig", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                     num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                     max_position_embeddings=131072, sliding_window=1024, query_pre_attn_scalar=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=True),
                 vision_config=nested(
                     "SiglipVisionConfig", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                     num_attention_heads=16, image_size=896, patch_size=14, layer_norm_eps=1e-6,
                     vision_use_head=False),
                 mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144,
                 tie_word_embeddings=True)),
    ZooSpec("paligemma-3b", "vlm", "PaliGemmaForConditionalGeneration", "PaliGemmaConfig", "float32",
            "google/paligemma-3b-pt-224: SigLIP-So400m vision tower at 224px (27 layers x 1152), Gemma-2B text model "
            "(18 layers x 2048, vocab 257216), tied embeddings",
            dict(text_config=nested(
                     "GemmaConfig", vocab_size=257216, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                     num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192,
                     tie_word_embeddings=True),
                 vision_config=nested(
                     "SiglipVisionConfig", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                     num_attention_heads=16, image_size=224, patch_size=14, vision_use_head=False),
                 image_token_index=257152, vocab_size=257216, projection_dim=2048, hidden_size=2048,
                 tie_word_embeddings=True)),
    ZooSpec("qwen2-vl-2b", "vlm", "Qwen2VLForConditionalGeneration", "Qwen2VLConfig", "bfloat16",
            "Qwen/Qwen2-VL-2B-Instruct: 32-layer ViT (1280) with 2x2 patch merger, Qwen2-1.5B text model (28 layers x "
            "1536, GQA 12/2, vocab 151936), tied embeddings",
            dict(text_config=nested(
                     "Qwen2VLTextConfig", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                     num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     max_position_embeddings=32768, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
                 vision_config=nested(
                     "Qwen2VLVisionConfig", depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16,
                     in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                 tie_word_embeddings=True)),
    # -- speech
    ZooSpec("wav2vec2-base", "speech", "Wav2Vec2ForCTC", "Wav2Vec2Config", "float32",
            "facebook/wav2vec2-base-960h: 7-layer conv feature encoder, 12 transformer layers x 768, weight-normed "
            "positional conv, CTC head over 32 tokens (masked_spec_embed, created on CPU by transformers, is moved to "
            "meta)",
            dict(vocab_size=32, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 feat_extract_norm="group", feat_extract_activation="gelu", conv_dim=[512] * 7,
                 conv_stride=[5, 2, 2, 2, 2, 2, 2], conv_kernel=[10, 3, 3, 3, 3, 2, 2], conv_bias=False,
                 num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16, do_stable_layer_norm=False)),
    ZooSpec("whisper-small", "speech", "WhisperForConditionalGeneration", "WhisperConfig", "float32",
            "openai/whisper-small (encoder-decoder): 12+12 layers, d_model 768, 80 mel bins, vocab 51865, decoder "
            "embedding tied to proj_out",
            dict(vocab_size=51865, num_mel_bins=80, d_model=768, encoder_layers=12, decoder_layers=12,
                 encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                 max_source_positions=1500, max_target_positions=448, tie_word_embeddings=True)),
    ZooSpec("whisper-large-v3", "speech", "WhisperForConditionalGeneration", "WhisperConfig", "float16",
            "openai/whisper-large-v3 (encoder-decoder): 32+32 layers, d_model 1280, 128 mel bins, vocab 51866, decoder "
            "embedding tied to proj_out",
            dict(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32, decoder_layers=32,
                 encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
                 max_source_positions=1500, max_target_positions=448, tie_word_embeddings=True)),
    # -- state-space models
    ZooSpec("mamba-130m", "ssm", "MambaForCausalLM", "MambaConfig", "float32",
            "state-spaces/mamba-130m-hf: 24 Mamba blocks, hidden 768, state 16, expand 2, vocab 50280, tied embeddings",
            dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24, expand=2, conv_kernel=4,
                 use_bias=False, use_conv_bias=True, tie_word_embeddings=True)),
    ZooSpec("mamba2-130m", "ssm", "Mamba2ForCausalLM", "Mamba2Config", "float32",
            "state-spaces/mamba2-130m sizes: 24 Mamba-2 blocks, hidden 768, 24 heads of dim 64, state 128, 1 group, "
            "vocab 50288, tied embeddings",
            dict(vocab_size=50288, hidden_size=768, state_size=128, num_hidden_layers=24, expand=2, head_dim=64,
                 num_heads=24, n_groups=1, conv_kernel=4, use_bias=False, use_conv_bias=True, chunk_size=256,
                 tie_word_embeddings=True)),
)

