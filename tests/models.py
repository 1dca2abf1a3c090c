"""Small random transformers models saved to disk, shared by the end-to-end tests (no download: built from configs).

``SavedModel`` saves one model with random weights (and, on request, persistent buffers that differ from their
``__init__`` values), keeps a meta-device twin, a RAM budget of a share of its size,
seeded inputs and the reference output of the model fully in RAM; ``quiet_hf`` silences transformers' progress
bars and accelerate's warnings while the tests load models, and restores them after; ``StreamMeter`` measures the
offloaded weights accelerate's hooks hold at once during a forward; ``assert_same_output`` compares the outputs of
two code paths within the tolerances stated for their dtype (:data:`TOLERANCE`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

import allocator
from allocator.evaluate.memory import tensor_devices

SEED = 0
DTYPE = torch.float32

# The tolerances two code paths computing the same thing (the runtime against eager, an offloaded model against the
# model in RAM, FSDP against one process) are held to, per dtype: torch.testing.assert_close's own defaults, stated.
# GEMMs of other shapes, strides or thread splits round differently on different CPUs, so such outputs are equal
# within float tolerance, not bitwise; greedy tokens are compared exactly.
TOLERANCE = {
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
}


def assert_same_output(got: torch.Tensor, expected: torch.Tensor, msg=None) -> None:
    """``got`` equals ``expected`` within :data:`TOLERANCE` for ``expected``'s dtype (same dtype and shape)."""
    torch.testing.assert_close(got, expected, **TOLERANCE[expected.dtype], msg=msg)


def tiny_specs() -> dict:
    """Name -> (model class, config, ``make_inputs(generator) -> dict``) for five tiny architectures."""
    from transformers import (
        GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, SegformerConfig, SegformerForSemanticSegmentation,
        T5Config, T5ForConditionalGeneration, ViTConfig, ViTForImageClassification,
    )

    def tokens(gen, *, decoder=False):
        out = {"input_ids": torch.randint(0, 1000, (2, 8), generator=gen)}
        if decoder:
            out["decoder_input_ids"] = torch.randint(0, 1000, (2, 5), generator=gen)
        return out

    def pixels(gen):
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}

    return {
        "llama": (LlamaForCausalLM, LlamaConfig(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            vocab_size=1000, max_position_embeddings=64, tie_word_embeddings=False), tokens),
        "gpt2": (GPT2LMHeadModel, GPT2Config(
            n_embd=64, n_layer=3, n_head=4, vocab_size=1000, n_positions=64, tie_word_embeddings=True), tokens),
        "t5": (T5ForConditionalGeneration, T5Config(
            d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=1000),
            lambda gen: tokens(gen, decoder=True)),
        "vit": (ViTForImageClassification, ViTConfig(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=8, num_labels=10), pixels),
        "segformer": (SegformerForSemanticSegmentation, SegformerConfig(
            num_encoder_blocks=4, depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], decoder_hidden_size=64,
            num_attention_heads=[1, 2, 4, 8], num_labels=3, image_size=32), pixels),
    }


class SavedModel:
    """One saved model with its meta twin, a RAM budget of ``budget_share`` of its size, inputs and reference logits
    (computed fully in RAM, without a device map)."""

    def __init__(self, name, cls, config, make_inputs, root, *, budget_share: float = 0.5,
                 perturb_buffers: bool = False):
        self.name, self.cls, self.config = name, cls, config
        self.path = str(root / name)
        torch.manual_seed(SEED)
        model = cls(config).to(DTYPE).eval()
        if perturb_buffers:   # saved buffer values differ from __init__'s, so a loader that never reads them shows
            with torch.no_grad():
                for _, buffer in model.named_buffers():
                    if buffer.is_floating_point():
                        buffer.add_(torch.rand_like(buffer))
        model.save_pretrained(self.path)
        with torch.device("meta"):
            self.meta = cls(config)
        self.total = allocator.build_problem(self.meta, {"cpu": 0}).graph.total
        self.budget = int(budget_share * self.total)
        self.max_memory = {"cpu": self.budget}
        self.problem = allocator.build_problem(self.meta, dict(self.max_memory))
        self.inputs = make_inputs(torch.Generator().manual_seed(SEED))
        self.reference = self.logits(cls.from_pretrained(self.path, dtype=DTYPE))

    def load(self, device_map, offload_folder):
        return self.cls.from_pretrained(
            self.path, dtype=DTYPE, device_map=device_map, max_memory=dict(self.max_memory),
            offload_folder=str(offload_folder),
        )

    def logits(self, model):
        model.eval()
        with torch.no_grad():
            return model(**self.inputs).logits

    def ram_resident(self, device_map) -> int:
        """Counted bytes ``device_map`` keeps in RAM, by the graph's tensor names alone (no planner involved)."""
        g = self.problem.graph
        return sum(t.counted for t, d in zip(g.tensors, tensor_devices(g, device_map)) if d == "cpu")

    def disk_tensors(self, device_map) -> int:
        """Parameters ``device_map`` leaves on disk: each is read (one ``safe_open``) at every forward."""
        g = self.problem.graph
        return sum(t.is_param for t, d in zip(g.tensors, tensor_devices(g, device_map)) if d == "disk")


@contextlib.contextmanager
def quiet_hf():
    """Silence transformers' progress bars and info logs and accelerate's warnings; restore them after."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    loggers = [logging.getLogger(n) for n in ("accelerate", "accelerate.big_modeling", "accelerate.utils.modeling")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


class StreamMeter:
    """Wraps ``AlignDevicesHook.pre_forward`` / ``post_forward`` to measure offloaded weights held in memory.

    After an offloading hook's ``pre_forward`` the module's direct tensors (those the hook streams) are
    materialised on the execution device; ``post_forward`` sends them back to meta. The meter adds their bytes
    when they appear and removes them when they go, counting one storage once (tied weights reuse the copy
    already materialised), and records the maximum held at once and which modules held it.
    """

    def __init__(self, monkeypatch):
        self.live: dict[int, list] = {}      # id(module) -> [(data_ptr, nbytes)]
        self.refs: dict[int, list] = {}      # data_ptr -> [nbytes, refcount]
        self.current = self.max = 0
        self.at_max: tuple[str, ...] = ()
        self.names: dict[int, str] = {}
        from accelerate.hooks import AlignDevicesHook as cls
        pre, post = cls.pre_forward, cls.post_forward
        meter = self

        def pre_forward(hook, module, *args, **kwargs):
            out = pre(hook, module, *args, **kwargs)
            if hook.offload:
                meter._load(module, hook)
            return out

        def post_forward(hook, module, output):
            if hook.offload:
                meter._drop(module)
            return post(hook, module, output)

        monkeypatch.setattr(cls, "pre_forward", pre_forward)
        monkeypatch.setattr(cls, "post_forward", post_forward)

    def name_modules(self, model):
        self.names = {id(m): n for n, m in model.named_modules()}

    def reset(self):
        assert not self.live, f"hooks left weights materialised: {self.live}"
        self.current = self.max = 0
        self.at_max = ()

    def _load(self, module, hook):
        from accelerate.utils import named_module_tensors

        held = [
            (t.data_ptr(), t.nbytes)
            for _, t in named_module_tensors(
                module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules, remove_non_persistent=True
            )
            if t.device.type != "meta"
        ]
        self.live[id(module)] = held
        for ptr, nbytes in held:
            entry = self.refs.setdefault(ptr, [nbytes, 0])
            if entry[1] == 0:
                self.current += nbytes
            entry[1] += 1
        if self.current > self.max:
            self.max = self.current
            self.at_max = tuple(self.names.get(k, "?") for k, v in self.live.items() if v)

    def _drop(self, module):
        for ptr, nbytes in self.live.pop(id(module), []):
            entry = self.refs[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= nbytes
                del self.refs[ptr]
