"""allocator.model.blocks: no-split classes, inferred blocks, stacks and unwrapping, on real architectures
(meta-device zoo) and on custom modules for the edge cases."""

import functools
import logging
import socket

import pytest
import torch
from torch import nn

from allocator import model as graph
from allocator.model import zoo
from allocator.errors import InvalidModel
from allocator.model.blocks import find_layers, infer_blocks, no_split_classes
from allocator.model.unwrap import unwrap
from models import assert_same_output


@functools.cache
def _zoo(name):
    """One shared meta-device build per name; tests only read these."""
    return zoo.build(name)


def _snapshot(model):
    """Everything unwrap must leave alone: each module's identity, class, children dict, and tensors."""
    return [
        (name, id(m), type(m), id(m._modules), dict(m._modules), id(m._parameters), dict(m._parameters),
         dict(m._buffers), dict(vars(m)))
        for name, m in model.named_modules(remove_duplicate=False)
    ]


def _names(model):
    return {type(m).__name__ for m in model.modules()}


def _stack(prefix, n, start=0):
    """``(prefix, [prefix.start, ..., prefix.<n-1>])``: one entry of find_layers."""
    return prefix, [f"{prefix}.{i}" for i in range(start, n)]


class Block(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.attn = nn.Linear(n, n)
        self.act = nn.GELU()
        self.mlp = nn.Linear(n, n)

    def forward(self, x):
        return self.mlp(self.act(self.attn(x)))


class MoEBlock(nn.Module):
    def __init__(self, n=8, experts=4):
        super().__init__()
        self.router = nn.Linear(n, experts)
        self.experts = nn.ModuleList(nn.Linear(n, n) for _ in range(experts))


class Net(nn.Module):
    """embed -> Sequential(Block x 2) -> head: a small model for unwrap tests, with a real forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(self.embed(x)))


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group on a free localhost port, destroyed after the module's tests."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ no_split_classes
def test_no_split_classes_is_one_function_read_by_the_graph():
    assert no_split_classes is graph.no_split_classes


@pytest.mark.parametrize(
    "name, expected",
    [
        # the LLM's decoder layer and the CLIP vision tower's encoder layer (plus CLIP's embeddings)
        ("llava-1.5-7b", {"CLIPEncoderLayer", "CLIPTextEmbeddings", "CLIPVisionEmbeddings", "LlamaDecoderLayer"}),
        ("gemma3-4b", {"Gemma3DecoderLayer", "SiglipEncoderLayer", "SiglipMultiheadAttentionPoolingHead",
                       "SiglipTextEmbeddings", "SiglipVisionEmbeddings"}),
        ("t5-base", {"T5Block"}),
        ("whisper-small", {"WhisperEncoderLayer", "WhisperDecoderLayer"}),
        ("wav2vec2-base", set()),  # declares none: infer_blocks is for this case
    ],
)
def test_no_split_classes_unites_sub_models(name, expected):
    assert no_split_classes(_zoo(name)) == expected


def test_no_split_classes_custom_nesting():
    class Inner(nn.Module):
        _no_split_modules = ["A", "B"]

    class Outer(nn.Module):
        _no_split_modules = ["C"]

        def __init__(self):
            super().__init__()
            self.towers = nn.ModuleList([Inner(), nn.Sequential(Inner())])

    assert no_split_classes(Outer()) == {"A", "B", "C"}
    assert no_split_classes(nn.Linear(2, 2)) == set()


# ---------------------------------------------------------------------------------------------- infer_blocks
@pytest.mark.parametrize(
    "name, expected",
    [
        # the encoder layers, and the 6 identical-class conv layers of the feature extractor (4 share kernel 3,
        # 2 share kernel 2; the first conv layer is another class, with a group norm)
        ("wav2vec2-base", {"Wav2Vec2EncoderLayer", "Wav2Vec2NoLayerNormConvLayer"}),
        # Swin stages differ in width, so the search goes inside each: its blocks repeat
        ("mask2former-swin-tiny", {"SwinLayer", "Mask2FormerPixelDecoderEncoderLayer",
                                   "Mask2FormerMaskedAttentionDecoderLayer"}),
        ("bert-base", {"BertLayer"}),
        ("t5-base", {"T5Block"}),  # block 0 owns the relative-attention table: its siblings still repeat
        ("mamba-130m", {"MambaBlock"}),  # not MambaMixer, which sits inside the block
        ("llava-1.5-7b", {"CLIPEncoderLayer", "LlamaDecoderLayer"}),
        ("whisper-small", {"WhisperEncoderLayer", "WhisperDecoderLayer"}),
        ("gemma3-4b", {"SiglipEncoderLayer", "Gemma3DecoderLayer"}),
    ],
)
def test_infer_blocks_on_real_architectures(name, expected):
    assert infer_blocks(_zoo(name)) == expected


def test_infer_blocks_sequential_of_custom_blocks_is_outermost():
    model = nn.Sequential(nn.Embedding(10, 8), *[Block() for _ in range(4)], nn.LayerNorm(8), nn.Linear(8, 10))
    assert infer_blocks(model) == {"Block"}  # not the two Linears repeated inside each Block


def test_infer_blocks_does_not_enter_blocks():
    # the experts ModuleList inside each MoE block repeats too, but it is inside an already-found block
    model = nn.ModuleDict({"a": MoEBlock(), "b": MoEBlock()})
    assert infer_blocks(model) == {"MoEBlock"}
    # a single MoE block: no block repeats at the outer level, so the experts are the blocks
    assert infer_blocks(nn.Sequential(MoEBlock(), nn.Linear(8, 8))) == {"Linear"}


def test_infer_blocks_needs_same_shapes_and_two_members():
    assert infer_blocks(nn.Sequential(Block(4), Block(8))) == set()
    assert infer_blocks(nn.ModuleList([Block()])) == set()
    assert infer_blocks(Block()) == set()  # two equal Linears, but not in a container


def test_infer_blocks_ignores_parameter_free_repeats_and_plain_containers():
    assert infer_blocks(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(), nn.ReLU(), nn.Linear(4, 5))) == set()
    # a Sequential of identical Sequentials: the search goes inside instead of reporting "Sequential"
    stages = nn.Sequential(nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block()))
    assert infer_blocks(stages) == {"Block"}


def test_infer_blocks_stages_of_different_widths():
    class Stage(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.blocks = nn.ModuleList(Block(n) for _ in range(2))
            self.down = nn.Linear(n, 2 * n)

    assert infer_blocks(nn.ModuleList([Stage(4), Stage(8), Stage(16)])) == {"Block"}


def test_infer_blocks_rejects_non_modules():
    with pytest.raises(InvalidModel, match="torch.nn.Module"):
        infer_blocks({"layers": []})


# ----------------------------------------------------------------------------------------------- find_layers
def test_find_layers_llama():
    assert find_layers(zoo.build("llama-3.2-1b")) == [_stack("model.layers", 16)]


def test_find_layers_mamba():
    assert find_layers(_zoo("mamba-130m")) == [_stack("backbone.layers", 24)]


def test_find_layers_t5_two_stacks_with_their_first_block():
    assert find_layers(_zoo("t5-base")) == [
        _stack("encoder.block", 12),
        _stack("decoder.block", 12),
    ]


def _small_t5(encoder_blocks, decoder_blocks):
    from transformers import T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
        return T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=4, vocab_size=100,
                                                   num_layers=encoder_blocks, num_decoder_layers=decoder_blocks))


@pytest.mark.parametrize("encoder_blocks, decoder_blocks", [(2, 3), (2, 2), (3, 2), (4, 4)])
def test_find_layers_t5_finds_both_stacks_even_of_two_blocks(encoder_blocks, decoder_blocks):
    """The first block of each T5 stack owns the relative-attention table, so a stack of two has no two equal
    blocks: the encoder of a 2-encoder, 3-decoder T5 used to be missed (only the decoder stack came back)."""
    model = _small_t5(encoder_blocks, decoder_blocks)
    assert find_layers(model) == [_stack("encoder.block", encoder_blocks), _stack("decoder.block", decoder_blocks)]
    assert infer_blocks(model) == {"T5Block"}


def test_find_layers_two_blocks_one_within_the_other_in_either_order():
    class Extra(Block):
        def __init__(self, extra):
            super().__init__()
            if extra:
                self.table = nn.Embedding(4, 8)

    for first, second in ((True, False), (False, True)):
        assert find_layers(nn.ModuleList([Extra(first), Extra(second)])) == [("", ["0", "1"])]


def test_find_layers_two_blocks_that_differ_otherwise_are_no_stack():
    assert find_layers(nn.ModuleList([Block(8), Block(16)])) == []  # other shapes
    # neither within the other (the router's shapes differ): no stack of MoEBlocks, so the search goes on inside them
    assert find_layers(nn.ModuleList([MoEBlock(experts=2), MoEBlock(experts=3)])) == [
        _stack("0.experts", 2), _stack("1.experts", 3)]
    assert find_layers(nn.ModuleList([nn.GELU(), nn.GELU()])) == []  # no parameters


def test_find_layers_llava_vision_tower_then_llm():
    assert find_layers(_zoo("llava-1.5-7b")) == [
        _stack("model.vision_tower.encoder.layers", 24),
        _stack("model.language_model.layers", 32),
    ]


def test_find_layers_gemma3():
    assert find_layers(_zoo("gemma3-4b")) == [
        _stack("model.vision_tower.encoder.layers", 27),
        _stack("model.language_model.layers", 34),
    ]


def test_find_layers_whisper():
    assert find_layers(_zoo("whisper-small")) == [
        _stack("model.encoder.layers", 12),
        _stack("model.decoder.layers", 12),
    ]


def test_find_layers_wav2vec2_skips_the_first_conv_of_another_class():
    assert find_layers(_zoo("wav2vec2-base")) == [
        _stack("wav2vec2.feature_extractor.conv_layers", 7, start=1),
        _stack("wav2vec2.encoder.layers", 12),
    ]


def test_find_layers_every_stack_of_mask2former():
    swin = "model.pixel_level_module.encoder.swin.encoder.layers"
    depths = [2, 2, 6, 2]
    assert find_layers(_zoo("mask2former-swin-tiny")) == [
        *[_stack(f"{swin}.{i}.blocks", d) for i, d in enumerate(depths)],
        _stack("model.pixel_level_module.decoder.encoder.layers", 6),
        _stack("model.transformer_module.decoder.layers", 9),
    ]


_SWIN_T = [2, 2, 6, 2]  # Swin-T stage depths
_RESNET50 = [3, 4, 6, 3]  # bottlenecks per ResNet-50 stage

#: zoo name -> exact stacks, as (container, number of blocks, block class); every stack starts at block 0.
#: Counts are the checkpoints' published depths (llama-3-8b 32 layers, Qwen2-VL-2B a 32-block ViT and a 28-layer
#: LLM, ...). With the tests above, find_layers is checked exactly on 34 zoo entries, 31 distinct model classes.
FIND_LAYERS_EXPECTED = {
    # dense decoder-only LLMs
    "llama-8b": [("model.layers", 32, "LlamaDecoderLayer")],
    "llama-70b": [("model.layers", 80, "LlamaDecoderLayer")],
    "mistral-7b": [("model.layers", 32, "MistralDecoderLayer")],
    "gpt2": [("transformer.h", 12, "GPT2Block")],
    "falcon-7b": [("transformer.h", 32, "FalconDecoderLayer")],
    "opt-1.3b": [("model.decoder.layers", 24, "OPTDecoderLayer")],
    "bloom-560m": [("transformer.h", 24, "BloomBlock")],
    "phi-3-mini": [("model.layers", 32, "Phi3DecoderLayer")],
    "gemma2-2b": [("model.layers", 26, "Gemma2DecoderLayer")],
    # MoE: the experts ModuleList inside each layer repeats too, but the search does not enter blocks
    "mixtral-8x7b": [("model.layers", 32, "MixtralDecoderLayer")],
    "qwen3-moe-30b-a3b": [("model.layers", 48, "Qwen3MoeDecoderLayer")],
    # DeepSeek-V2-Lite's layer 0 has a dense MLP (other parameters than its MoE siblings): still in the stack
    "deepseek-v2-lite": [("model.layers", 27, "DeepseekV2DecoderLayer")],
    # encoders and encoder-decoders
    "bert-base": [("bert.encoder.layer", 12, "BertLayer")],
    "bart-large": [("model.encoder.layers", 12, "BartEncoderLayer"), ("model.decoder.layers", 12, "BartDecoderLayer")],
    "flan-t5-large": [("encoder.block", 24, "T5Block"), ("decoder.block", 24, "T5Block")],
    # one block class in two towers: two stacks, text first as CLIPModel defines it
    "clip-vit-base": [("text_model.encoder.layers", 12, "CLIPEncoderLayer"),
                      ("vision_model.encoder.layers", 12, "CLIPEncoderLayer")],
    # vision
    "vit-base": [("vit.layers", 12, "ViTLayer")],
    "dinov2-base": [("encoder.layer", 12, "Dinov2Layer")],
    "swin-tiny": [(f"swin.encoder.layers.{i}.blocks", d, "SwinLayer") for i, d in enumerate(_SWIN_T)],
    "convnext-tiny": [(f"convnext.encoder.stages.{i}.layers", d, "ConvNextLayer")
                      for i, d in enumerate([3, 3, 9, 3])],
    "segformer-b0": [(f"segformer.stages.{i}.blocks", 2, "SegformerLayer") for i in range(4)],
    # ResNet-50 bottlenecks per stage, the DETR transformer, and the 3 Linears of the box MLP
    "detr-resnet-50": [
        *[(f"model.backbone.model.encoder.stages.{i}.layers", d, "ResNetBottleNeckLayer")
          for i, d in enumerate(_RESNET50)],
        ("model.encoder.layers", 6, "DetrEncoderLayer"),
        ("model.decoder.layers", 6, "DetrDecoderLayer"),
        ("bbox_predictor.layers", 3, "Linear"),
    ],
    # the ViT-B image encoder, the 4 point embeddings, the two-way transformer, the 4 hypernetwork MLPs
    "sam-vit-base": [
        ("vision_encoder.layers", 12, "SamVisionLayer"),
        ("prompt_encoder.point_embed", 4, "Embedding"),
        ("mask_decoder.transformer.layers", 2, "SamTwoWayAttentionBlock"),
        ("mask_decoder.output_hypernetworks_mlps", 4, "SamFeedForward"),
    ],
    # VLMs: the vision tower's stack, then the language model's
    "qwen2-vl-2b": [("model.visual.blocks", 32, "Qwen2VLVisionBlock"),
                    ("model.language_model.layers", 28, "Qwen2VLDecoderLayer")],
    "paligemma-3b": [("model.vision_tower.encoder.layers", 27, "SiglipEncoderLayer"),
                     ("model.language_model.layers", 18, "GemmaDecoderLayer")],
    # state-space models
    "mamba2-130m": [("backbone.layers", 24, "Mamba2Block")],
}


@pytest.mark.parametrize("name", sorted(FIND_LAYERS_EXPECTED))
def test_find_layers_exact_stacks_on_the_zoo(name):
    model = _zoo(name)
    expected = FIND_LAYERS_EXPECTED[name]
    stacks = find_layers(model)
    assert stacks == [_stack(container, n) for container, n, _ in expected]
    # each stack holds blocks of the one expected class, and the classes are exactly infer_blocks' answer
    for (_, blocks), (_, _, cls) in zip(stacks, expected, strict=True):
        assert {type(model.get_submodule(b)).__name__ for b in blocks} == {cls}
    assert infer_blocks(model) == {cls for _, _, cls in expected}


def test_find_layers_covers_ten_architectures_of_the_zoo():
    """The exact-stack tests of this file span at least ten distinct zoo architectures (model classes)."""
    here = {"llama-3.2-1b", "mamba-130m", "t5-base", "llava-1.5-7b", "gemma3-4b", "whisper-small", "wav2vec2-base",
            "mask2former-swin-tiny"} | set(FIND_LAYERS_EXPECTED)
    assert here <= set(zoo.names())
    classes = {zoo.ZOO[name].description.rpartition("[")[2].rstrip("]") for name in here}
    assert len(classes) >= 10, classes  # 31 at present
    assert {"MambaForCausalLM", "T5ForConditionalGeneration", "LlavaForConditionalGeneration"} <= classes


def test_find_layers_custom_root_sequential_and_module_dict():
    model = nn.Sequential(Block(), Block(), Block(), nn.Linear(8, 2))
    assert find_layers(model) == [("", ["0", "1", "2"])]
    tower = nn.ModuleDict({"x": Block(), "y": Block(), "norm": nn.LayerNorm(8)})
    assert find_layers(tower) == [("", ["x", "y"])]


def test_find_layers_shared_stack_reported_once():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.ModuleList([Block(), Block()])
            self.second = self.first

    assert find_layers(Twice()) == [("first", ["first.0", "first.1"])]


def test_find_layers_two_classes_in_one_container_in_definition_order():
    model = nn.ModuleList([Block(), MoEBlock(), Block(), MoEBlock()])
    assert find_layers(model) == [("", ["0", "2"]), ("", ["1", "3"])]


def test_find_layers_of_unwrapped_model_matches_plain():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = Net()
    wrapped = Net()
    wrapped.body = nn.Sequential(*[checkpoint_wrapper(b) for b in wrapped.body])
    assert find_layers(wrapped) == [("body", ["body.0", "body.1"])]
    assert infer_blocks(wrapped) == {"CheckpointWrapper"}  # why callers unwrap first
    assert find_layers(unwrap(wrapped)) == find_layers(plain)
    assert infer_blocks(unwrap(wrapped)) == {"Block"}


# ---------------------------------------------------------------------------------------------------- unwrap
def _assert_shares_weights(result, reference):
    """Same keys as ``reference`` and the very same tensors (no copies)."""
    got, want = result.state_dict(keep_vars=True), reference.state_dict(keep_vars=True)
    assert list(got) == list(want)
    for key in want:
        assert got[key] is want[key], key
        if want[key].device.type != "meta":
            assert got[key].data_ptr() == want[key].data_ptr(), key


def test_unwrap_returns_plain_models_themselves():
    net = Net()
    before = _snapshot(net)
    assert unwrap(net) is net
    assert _snapshot(net) == before


def test_unwrap_data_parallel_on_cpu():
    net = Net()
    dp = nn.DataParallel(net)  # constructs on a host without GPUs: device_ids == []
    assert dp.device_ids == []
    assert unwrap(dp) is net


def test_unwrap_torch_compile_without_compiling():
    net = Net()
    compiled = torch.compile(net, backend="eager")
    assert type(compiled).__name__ == "OptimizedModule"
    assert unwrap(compiled) is net


def test_unwrap_ddp(process_group):
    net = Net()
    ddp = nn.parallel.DistributedDataParallel(net)
    assert unwrap(ddp) is net
    outer = Net()
    outer.body = nn.parallel.DistributedDataParallel(nn.Sequential(Block(), Block()))
    before = _snapshot(outer)
    result = unwrap(outer)
    assert list(result.state_dict()) == list(Net().state_dict())
    assert result.body is outer.body.module
    assert _snapshot(outer) == before


def test_unwrap_fsdp1_on_cpu(process_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    def policy(module, recurse, nonwrapped_numel):
        return recurse or isinstance(module, Block)

    # real FSDP1 on CPU/gloo, nested: one FSDP per Block and one around the model (NO_SHARD at world size 1)
    fsdp = FullyShardedDataParallel(Net(), device_id=torch.device("cpu"), use_orig_params=True,
                                    auto_wrap_policy=policy)
    assert "_fsdp_wrapped_module" in " ".join(n for n, _ in fsdp.named_parameters())
    before = _snapshot(fsdp)
    result = unwrap(fsdp)
    assert "FullyShardedDataParallel" not in _names(result)
    assert list(result.state_dict()) == list(Net().state_dict())
    for (name, got), (wrapped_name, want) in zip(result.named_parameters(), fsdp.named_parameters(), strict=True):
        assert wrapped_name.replace("_fsdp_wrapped_module.", "") == name
        assert got is want, name  # FSDP's own parameters (views of its flat buffer), not copies of them
    assert _snapshot(fsdp) == before


def test_unwrap_fsdp_flat_param_warns(caplog):
    class FullyShardedDataParallel(nn.Module):  # FSDP1 with use_orig_params=False, as it lays out modules
        def __init__(self, module):
            super().__init__()
            self._fsdp_wrapped_module = module
            flat = torch.cat([p.detach().flatten() for p in module.parameters()])
            for name in [n for n, _ in module.named_parameters()]:
                module.get_submodule(name.rpartition(".")[0])._parameters.pop(name.rpartition(".")[2])
            module._flat_param = nn.Parameter(flat)

    with caplog.at_level(logging.WARNING, logger="allocator.model.unwrap"):
        unwrap(FullyShardedDataParallel(Block()))
    assert "use_orig_params=True" in caplog.text


def test_unwrap_checkpoint_wrappers_inside_a_real_model_under_compile():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    reference = zoo.build("bert-base")
    model = zoo.build("bert-base")
    layers = model.bert.encoder.layer
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    wrapped = torch.compile(model, backend="eager")
    before = _snapshot(wrapped)
    result = unwrap(wrapped)
    assert "CheckpointWrapper" not in _names(result)
    assert list(result.state_dict()) == list(reference.state_dict())  # no _checkpoint_wrapped_module. segment
    _assert_shares_weights(result, model)  # CheckpointWrapper's state_dict hook strips its prefix
    assert result is not model and result.bert is not model.bert and result.bert.encoder.layer is not layers
    assert result.bert.embeddings is model.bert.embeddings  # untouched branch: the input's own object
    assert result.bert.encoder.layer[3] is layers[3]._checkpoint_wrapped_module
    assert _snapshot(wrapped) == before
    assert find_layers(result) == find_layers(reference)


def test_unwrap_stacked_wrappers_and_data_ptrs(process_group):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = Net()
    net.body[1] = nn.DataParallel(checkpoint_wrapper(net.body[1]))
    inner_block = net.body[1].module._checkpoint_wrapped_module
    wrapped = torch.compile(nn.parallel.DistributedDataParallel(nn.DataParallel(net)), backend="eager")
    before = _snapshot(wrapped)
    result = unwrap(wrapped)
    assert _names(result) == {"Net", "Linear", "Sequential", "Block", "GELU"}
    assert result.body[1] is inner_block
    assert list(result.state_dict()) == list(Net().state_dict())
    for (name, got), (_, want) in zip(result.named_parameters(), wrapped.named_parameters(), strict=True):
        assert got is want and got.data_ptr() == want.data_ptr(), name
    assert _snapshot(wrapped) == before
    # the copies do not alias the input's registries: registering on the result leaves the input alone
    result.register_buffer("extra", torch.zeros(1))
    result.body.register_forward_hook(lambda *a: None)
    assert "extra" not in net._buffers and not net.body._forward_hooks
    x = torch.randn(3, 4)
    torch.testing.assert_close(result(x), net(x))  # net, not wrapped: calling the OptimizedModule would trace


def test_unwrap_xla_spmd_style_and_flatten_params_wrappers():
    class SpmdFullyShardedDataParallel(nn.Module):  # torch_xla's SPMD FSDP keeps the module as _orig_module
        def __init__(self, module):
            super().__init__()
            self._orig_module = module

    class FlattenParamsWrapper(nn.Module):  # fairscale / torch < 1.13 FSDP
        def __init__(self, module):
            super().__init__()
            self._fpw_module = module

    net = Net()
    net.body[0] = FlattenParamsWrapper(net.body[0])
    wrapped = SpmdFullyShardedDataParallel(net)
    before = _snapshot(wrapped)
    result = unwrap(wrapped)
    assert list(result.state_dict()) == list(Net().state_dict())
    for got, want in zip(result.parameters(), wrapped.parameters(), strict=True):
        assert got is want
    assert result.body[0] is net.body[0]._fpw_module and result.head is net.head
    assert _snapshot(wrapped) == before


class BaseTuner(nn.Module):  # peft's tuner base class (LoraModel derives from it): holds the model as .model
    def __init__(self, model):
        super().__init__()
        self.model = model


class PeftModel(nn.Module):  # peft's PeftModel: holds the tuner as .base_model
    def __init__(self, model, prompt=False):
        super().__init__()
        self.base_model = type("LoraModel", (BaseTuner,), {})(model)
        if prompt:  # prompt learning: the wrapper owns parameters of its own
            self.prompt_encoder = nn.Embedding(4, 8)


def test_unwrap_peft_shaped_fake():
    net = Net()
    assert unwrap(PeftModel(net)) is net

    class Holder(nn.Module):  # ".model" alone does not make a wrapper: only a BaseTuner's
        def __init__(self, model):
            super().__init__()
            self.model = model

    holder = Holder(net)
    assert unwrap(holder) is holder


def test_unwrap_real_peft():
    peft = pytest.importorskip("peft")
    net = Net()
    config = peft.LoraConfig(r=2, target_modules=["attn"])
    model = peft.get_peft_model(net, config)
    assert list(model.state_dict())[0].startswith("base_model.model.")
    result = unwrap(nn.DataParallel(model))
    assert result is model.get_base_model() is net  # LoRA layers were injected in place by peft
    assert list(result.state_dict()) == list(net.state_dict())
    assert "base_layer" in " ".join(result.state_dict())  # adapters are part of the model: kept


def test_unwrap_peft_prompt_owned_parameters_warn(caplog):
    net = Net()
    with caplog.at_level(logging.WARNING, logger="allocator.model.unwrap"):
        assert unwrap(PeftModel(net, prompt=True)) is net
    assert "prompt_encoder.weight" in caplog.text


def test_unwrap_strips_accelerate_hooks_on_copies_only():
    from accelerate import dispatch_model
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    net = Net()
    x = torch.randn(3, 4)
    expected = net(x)
    dispatch_model(net, {"": "cpu"}, force_hooks=True)  # root hook, and dispatch_model's to()/cuda() guards
    add_hook_to_module(net.body[0], Counting())
    add_hook_to_module(net.head, Counting())
    hooked = {name for name, m in net.named_modules() if hasattr(m, "_hf_hook")}
    assert {"", "body.0", "head"} <= hooked and "body.1.act" not in hooked
    before = _snapshot(net)
    result = unwrap(net)
    for name, module in result.named_modules():
        assert not hasattr(module, "_hf_hook") and not hasattr(module, "_old_forward"), name
        assert "forward" not in vars(module) and "to" not in vars(module) and "cuda" not in vars(module), name
    for name, module in net.named_modules():  # hooked modules are copied, the others are the input's own
        assert (result.get_submodule(name) is module) == (name not in hooked), name
    assert result.body[1].act is net.body[1].act  # accelerate leaves parameter-free modules unhooked
    _assert_shares_weights(result, net)
    assert _snapshot(net) == before
    assert {name for name, m in net.named_modules() if hasattr(m, "_hf_hook")} == hooked
    calls = Counting.calls
    torch.testing.assert_close(result(x), expected)
    assert Counting.calls == calls  # the copies run their own forward, not the hooked one
    net(x)
    assert Counting.calls == calls + 2  # the input still runs its hooks


def test_unwrap_in_place_compile_and_bound_forward():
    net = Net()
    net.body[0].compile(backend="eager")  # nn.Module.compile: _compiled_call_impl bound to the original
    result = unwrap(net)
    assert result.body[0] is not net.body[0] and result.body[0]._compiled_call_impl is None
    assert net.body[0]._compiled_call_impl is not None
    _assert_shares_weights(result, net)


def test_unwrap_keeps_shared_modules_shared():
    shared = nn.Sequential(nn.DataParallel(nn.Linear(4, 4)))
    model = nn.ModuleDict({"a": shared, "b": shared, "c": nn.Linear(4, 4)})
    result = unwrap(model)
    assert result["a"] is result["b"] and result["a"] is not shared
    assert result["a"][0] is shared[0].module and result["c"] is model["c"]
    assert isinstance(shared[0], nn.DataParallel)


def test_unwrap_meta_model_wrapped_everywhere():
    model = zoo.build("t5-base")
    model.encoder = nn.DataParallel(model.encoder)
    result = unwrap(torch.compile(model, backend="eager"))
    assert list(result.state_dict()) == list(_zoo("t5-base").state_dict())
    assert result.encoder is model.encoder.module
    assert find_layers(result) == find_layers(_zoo("t5-base"))


def test_unwrap_rejects_cycles_and_non_modules():
    loop = nn.Sequential(nn.Linear(2, 2))
    loop._modules["again"] = nn.DataParallel(loop)
    with pytest.raises(InvalidModel, match="cycle"):
        unwrap(loop)
    with pytest.raises(InvalidModel, match="torch.nn.Module"):
        unwrap(object())


# --------------------------------------------------------------------------- unwrap: a real llama, real wrappers
_WRAPPER_SEGMENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _tiny_llama():
    """LlamaForCausalLM from a tiny config with real (seeded, CPU) weights; equal weights at every call."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=32, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _fsdp(module, **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 on CPU over gloo (NO_SHARD at world size 1); use_orig_params keeps the original parameter names
    return FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True, **kwargs)


def _ddp_around_ddp_layers(model):
    # nested DDP: DDP around each decoder layer, then DDP around the model (it constructs on CPU/gloo)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = nn.parallel.DistributedDataParallel(layers[i])
    return nn.parallel.DistributedDataParallel(model)


def _ddp_around_mixed_layers(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # DDP around the model; layer 0 in a CheckpointWrapper, layer 1 torch.compile'd, layer 2 in FSDP1
    layers = model.model.layers
    layers[0] = checkpoint_wrapper(layers[0])
    layers[1] = torch.compile(layers[1], backend="eager")
    layers[2] = _fsdp(layers[2])
    return nn.parallel.DistributedDataParallel(model)


def _compile_around_compiled_layers(model):
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i], backend="eager")
    return torch.compile(model, backend="eager")


def _fsdp_around_fsdp_layers(model):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def policy(module, recurse, nonwrapped_numel):
        return recurse or isinstance(module, LlamaDecoderLayer)

    return _fsdp(model, auto_wrap_policy=policy)  # one FSDP per decoder layer, one around the model


def _compile_around_ddp_around_checkpointed_layers(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    return torch.compile(nn.parallel.DistributedDataParallel(model), backend="eager")


#: (top wrapper / per-layer wrapper) -> wrap(model) -> wrapped model; all of them run here (CPU, gloo, world 1).
LLAMA_WRAPPINGS = {
    "ddp/ddp": _ddp_around_ddp_layers,
    "ddp/checkpoint+compile+fsdp": _ddp_around_mixed_layers,
    "compile/compile": _compile_around_compiled_layers,
    "fsdp/fsdp": _fsdp_around_fsdp_layers,
    "compile(ddp)/checkpoint": _compile_around_ddp_around_checkpointed_layers,
}


@pytest.mark.parametrize("wrapping", list(LLAMA_WRAPPINGS))
def test_unwrap_real_llama_wrapped_at_the_top_and_per_layer(process_group, wrapping):
    reference = _tiny_llama()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits

    model = _tiny_llama()
    original = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    wrapped = LLAMA_WRAPPINGS[wrapping](model)
    wrapped_names = [n for n, _ in wrapped.named_parameters()]
    assert all(any(f".{s}." in f".{n}" for s in _WRAPPER_SEGMENTS) for n in wrapped_names), wrapped_names[:3]
    before = _snapshot(wrapped)

    result = unwrap(wrapped)

    assert type(result) is type(reference)
    assert not _names(result) & {"DistributedDataParallel", "OptimizedModule", "FullyShardedDataParallel",
                                 "CheckpointWrapper"}
    assert list(result.state_dict()) == list(reference.state_dict())
    # every tensor is the wrapped model's own tensor (same object, same storage), named without wrapper segments
    mine = {".".join(s for s in name.split(".") if s not in _WRAPPER_SEGMENTS): t
            for name, t in [*wrapped.named_parameters(), *wrapped.named_buffers()]}
    got = dict([*result.named_parameters(), *result.named_buffers()])
    assert got.keys() == mine.keys()
    for name, tensor in result.state_dict(keep_vars=True).items():
        assert tensor is mine[name] and tensor.data_ptr() == mine[name].data_ptr(), name
    for name, (param, ptr) in original.items():
        assert got[name] is param, name  # the llama's own Parameter objects (FSDP keeps them with use_orig_params)
        if "fsdp" not in wrapping:  # FSDP moved their data into its flat parameter; the others left it in place
            assert got[name].data_ptr() == ptr, name
    assert _snapshot(wrapped) == before  # the input is not mutated

    with torch.no_grad():
        assert_same_output(result(input_ids=ids).logits, expected)
    assert _snapshot(wrapped) == before  # running the result leaves the input alone too
    if wrapping in ("ddp/ddp", "fsdp/fsdp"):  # and the wrapped model itself still runs, and agrees
        with torch.no_grad():
            assert_same_output(wrapped(input_ids=ids).logits, expected)


def test_llava_next_no_split_includes_the_clip_tower_layer():
    """The case behind transformers PR #38141 / peft PR #2570: the CLIP tower declares its own layer class."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    with torch.device("meta"):
        model = LlavaNextForConditionalGeneration(LlavaNextConfig())
    found = no_split_classes(model)
    assert {"CLIPEncoderLayer", "LlamaDecoderLayer"} <= found
    assert "CLIPEncoderLayer" not in set(getattr(model.model.language_model, "_no_split_modules", None) or ())
