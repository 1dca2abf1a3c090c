"""Sizes of quantized weights as transformers 5 holds them, from a config's ``quantization_config``.

A model built from a quantized checkpoint's config (on the meta device, with plain ``nn.Linear`` layers) is sized here
as ``from_pretrained`` would hold it once loaded: every layer the method replaces at the bytes of the tensors its
replacement stores, every other tensor (embeddings, norms, ``lm_head``, biases, what ``modules_to_not_convert`` /
``llm_int8_skip_modules`` name) unquantized, in the load dtype.

Which layers are replaced follows transformers' own code, imported from it where it needs no backend: the config
classes (``AutoQuantizationConfig.from_dict``, with their defaults), ``HfQuantizer.get_modules_to_not_convert`` and
``should_convert_module``; the layer types each ``replace_with_*`` function converts. transformers' quantizers size a
weight with ``param_element_size``, which imports the backend (``bitsandbytes``, ``gptqmodel``) to recognise layers
that are already replaced, and counts 4-bit weights at half a byte without their scales; the layouts below are the
stored tensors instead. Where transformers' quantizer can be made without its backend, its ``adjust_max_memory``
applies as in ``from_pretrained`` (bitsandbytes keeps 10 % of every budget free).

Layouts, for a layer of ``out`` outputs and ``in`` inputs (``n = out * in``), ``g`` the group size (``in`` when -1):

==================  ================================================================================================
bitsandbytes 4-bit  weight packed two per byte (``ceil(n / 2)``), float32 ``absmax`` per block of 64 and a 16-entry
                    float32 quant map; with double quant ``absmax`` is uint8, plus float32 ``absmax`` per 256 blocks,
                    a 256-entry float32 code and a float32 offset (``Params4bit`` / ``QuantState``)
bitsandbytes 8-bit  int8 weight and a float32 scale per output row (``Int8Params``, ``SCB``)
gptq                ``qweight`` int32 ``ceil(in * bits / 32) x out``, ``qzeros`` int32 ``ceil(in / g) x ceil(out * bits
                    / 32)``, ``scales`` float16 ``ceil(in / g) x out``, ``g_idx`` int32 per input; the linear layers of
                    the repeated blocks only (optimum's ``block_name_to_quantize``), lm_head and embeddings never
awq (gemm)          ``qweight`` int32 ``in x ceil(out * bits / 32)``, ``qzeros`` int32 ``ceil(in / g) x ceil(out * bits
                    / 32)``, ``scales`` float16 ``ceil(in / g) x out``
fp8                 float8 weight, ``weight_scale_inv`` float32 per ``weight_block_size`` block (one per tensor without
                    it), ``activation_scale`` float32 when static; fused experts the same per expert (``FP8Linear``,
                    ``FP8Experts``)
fbgemm_fp8          float8 weight, float32 scale per output row, float32 ``input_scale_ub``; bias float32
==================  ================================================================================================

Other methods raise :class:`~allocator.errors.InvalidOption` naming them: a plan at full size would be wrong.

fp8 is sized as it loads on a GPU of compute capability 8.9 or more; elsewhere (CPU only, older GPUs) transformers'
``FineGrainedFP8HfQuantizer.validate_environment`` sets ``dequantize=True`` and the model loads in bfloat16, which a
config with ``"dequantize": true`` plans.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ..errors import InvalidOption, cause_line

__all__ = ["METHODS", "QuantizedSizes", "quantized_sizes"]

METHODS = ("bitsandbytes_4bit", "bitsandbytes_8bit", "gptq", "awq", "fp8", "fbgemm_fp8")
"""The ``quant_method`` values sized here (bitsandbytes as transformers names its 4-bit and 8-bit quantizers)."""

BNB_4BIT_BLOCK = 64
"""Elements per ``absmax`` of bitsandbytes 4-bit (``Params4bit(blocksize=None)``)."""
BNB_NESTED_BLOCK = 256
"""``absmax`` values per second-level scale under double quant (``quantize_blockwise(absmax, blocksize=256)``)."""
GPTQ_BLOCKS = ("transformer.h", "model.decoder.layers", "gpt_neox.layers", "model.layers",
               "model.language_model.layers")
"""Where optimum looks for the repeated blocks GPTQ quantizes (``optimum.gptq.constants.BLOCK_PATTERNS``), in order."""


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedSizes:
    """What a quantization config does to a model's sizes; pass :meth:`size_fn` to :func:`allocator.plan`."""

    method: str
    """The method and its options, for reports: ``"bitsandbytes 4-bit (nf4, double quant)"``."""
    sizes: Mapping[str, int]
    """Full tensor name -> bytes as stored, for every tensor the method changes (a quantized weight counts its
    scales and zeros too); other tensors keep the dtype rule."""
    quantized_elements: int
    """Weights quantized (elements of the layers replaced)."""
    not_converted: tuple[str, ...]
    """What the method leaves unquantized besides layers it never converts: the modules_to_not_convert it applies
    (configured, and transformers' defaults such as ``lm_head``); for GPTQ, everything outside its blocks."""
    hf_quantizer: object = None
    """transformers' quantizer for the config when it can be made without its backend (its ``adjust_max_memory``
    applies in :func:`allocator.plan`), else ``None``."""

    def size_fn(self, name: str, tensor) -> int | None:
        """``size_fn(name, tensor)`` for :func:`allocator.plan`: the stored bytes, or ``None`` for the dtype rule."""
        return self.sizes.get(name)


def quantized_sizes(model, quantization_config) -> QuantizedSizes:
    """How ``model`` is stored under ``quantization_config`` (a dict as in config.json, or a transformers config).

    ``model`` is the unquantized model (plain ``nn.Linear`` layers, e.g. built from the config on the meta device);
    it is not modified. Plan it as loaded with ``allocator.plan(model, max_memory, dtype=LOAD_DTYPE,
    size_fn=q.size_fn, hf_quantizer=q.hf_quantizer)`` (the quantizer, where there is one, only adjusts budgets).

    Raises
    ------
    InvalidOption
        A method transformers does not know, one whose storage is not modelled here (:data:`METHODS` are), or a
        config transformers rejects.

    Examples
    --------
    >>> import torch.nn as nn
    >>> q = quantized_sizes(nn.Sequential(nn.Linear(128, 64)), {"quant_method": "bitsandbytes", "load_in_8bit": True,
    ...                                                          "llm_int8_skip_modules": []})
    >>> q.method, q.sizes["0.weight"]  # 128 x 64 int8 and a float32 scale per output row
    ('bitsandbytes 8-bit (LLM.int8)', 8448)
    """
    config, method = _parse(quantization_config)
    layers, skip = _LAYERS[method](model, config)
    sizes: dict[str, int] = {}
    elements = 0
    for name, module in layers.items():
        for tensor_name, nbytes, numel in _LAYOUTS[method](module, config):
            sizes[f"{name}.{tensor_name}" if name else tensor_name] = int(nbytes)
            elements += numel
    return QuantizedSizes(method=_describe(method, config), sizes=sizes, quantized_elements=elements,
                          not_converted=tuple(sorted(set(skip))), hf_quantizer=_quantizer(config))


# -- the config ------------------------------------------------------------------------------------------------------


def _method_name(config) -> str | None:
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    if get("load_in_4bit", False):
        return "bitsandbytes_4bit"
    if get("load_in_8bit", False):
        return "bitsandbytes_8bit"
    method = get("quant_method", None)
    return getattr(method, "value", method)


def _parse(quantization_config):
    """(transformers' config object, the method key)."""
    method = _method_name(quantization_config)
    if method is None:
        raise InvalidOption("quantization_config has no quant_method; a quantized checkpoint's config names one "
                            "(e.g. 'bitsandbytes', 'gptq', 'awq', 'fp8').")
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AutoQuantizationConfig
    except ImportError:
        raise InvalidOption("sizing a quantization_config needs transformers: pip install 'allocator[hf]'.") from None
    if method not in AUTO_QUANTIZER_MAPPING:
        raise InvalidOption(f"quantization_config.quant_method {method!r} is unknown to transformers (from_pretrained "
                            f"would warn and load the model unquantized); allocator sizes {', '.join(METHODS)}. Fix "
                            f"the config, or delete quantization_config to plan the model unquantized.")
    if method not in METHODS:
        raise InvalidOption(f"quantization_config.quant_method {method!r} is not supported: allocator does not know "
                            f"how it stores weights and will not plan the model at full size; it sizes "
                            f"{', '.join(METHODS)}.")
    if not isinstance(quantization_config, Mapping):
        return quantization_config, method
    try:
        return AutoQuantizationConfig.from_dict(dict(quantization_config)), method
    except Exception as err:  # a config class's own checks raise ValueError, TypeError, ImportError, ...
        raise InvalidOption(f"transformers rejects the {method} quantization_config: {cause_line(err)}; fix the "
                            "fields it names, or delete quantization_config to plan the model unquantized.") from err


def _quantizer(config):
    """transformers' quantizer for ``config``, or ``None`` where it needs its backend to be made (GPTQ: optimum)."""
    try:
        from transformers.quantizers.auto import AutoHfQuantizer

        return AutoHfQuantizer.from_config(config, pre_quantized=True)
    except Exception:  # ImportError for a missing backend, or anything the constructor checks
        return None


def _describe(method: str, config) -> str:
    if method == "bitsandbytes_4bit":
        extra = ", double quant" if config.bnb_4bit_use_double_quant else ""
        return f"bitsandbytes 4-bit ({config.bnb_4bit_quant_type}{extra})"
    if method == "bitsandbytes_8bit":
        return "bitsandbytes 8-bit (LLM.int8" + (", fp16 weights kept)" if config.llm_int8_has_fp16_weight else ")")
    if method in ("gptq", "awq"):
        return f"{method} {config.bits}-bit, group size {config.group_size}"
    if method == "fp8":
        block = config.weight_block_size
        return (f"fp8 ({'blocks of ' + 'x'.join(map(str, block)) if block else 'per tensor'} scales; as on a GPU of "
                f"compute capability >= 8.9, elsewhere transformers loads it dequantized)")
    return "fbgemm_fp8 (per-row scales)"


# -- which layers: transformers' rules -------------------------------------------------------------------------------


def _not_converted(model, skip, add_default_skips: bool) -> list[str]:
    """``HfQuantizer.get_modules_to_not_convert`` (its defaults need a transformers model: tied and output
    embeddings, the last module); for another module, the configured list alone."""
    from transformers.quantizers.base import HfQuantizer

    keep = getattr(model, "_keep_in_fp32_modules", None)
    try:
        return list(HfQuantizer.get_modules_to_not_convert(model, skip, keep, add_default_skips))
    except AttributeError:  # not a PreTrainedModel: no all_tied_weights_keys, no get_output_embeddings
        return list(skip or []) + list(keep or [])


def _converted(model, skip, accept) -> dict:
    from transformers.quantizers.quantizers_utils import should_convert_module

    return {name: m for name, m in model.named_modules() if should_convert_module(name, skip) and accept(name, m)}


def _plain_linear(name, module) -> bool:
    import torch.nn as nn

    return type(module) is nn.Linear


def _bnb_layers(model, config):
    """``replace_with_bnb_linear``: ``nn.Linear`` (exactly) and ``Conv1D``."""
    from transformers.pytorch_utils import Conv1D

    skip = _not_converted(model, config.llm_int8_skip_modules, False)
    if getattr(config, "llm_int8_has_fp16_weight", False) and config.load_in_8bit:
        return {}, skip  # the weights stay in float16: nothing changes size
    return _converted(model, skip, lambda n, m: _plain_linear(n, m) or isinstance(m, Conv1D)), skip


def _awq_layers(model, config):
    """``replace_with_awq_linear``: every ``nn.Linear``, with transformers' default skips added."""
    import torch.nn as nn

    skip = _not_converted(model, config.modules_to_not_convert, True)
    return _converted(model, skip, lambda n, m: isinstance(m, nn.Linear)), skip


def _fp8_layers(model, config):
    """``replace_with_fp8_linear``: exactly ``nn.Linear``, and fused ``*.experts`` modules; nothing when the config
    asks to dequantize."""
    skip = _not_converted(model, config.modules_to_not_convert, False)
    if config.dequantize:
        return {}, skip
    return _converted(model, skip, lambda n, m: _plain_linear(n, m) or (n.endswith(".experts") and _fused(m))), skip


def _fbgemm_layers(model, config):
    """``replace_with_fbgemm_fp8_linear``: every ``nn.Linear``."""
    import torch.nn as nn

    skip = _not_converted(model, config.modules_to_not_convert, False)
    return _converted(model, skip, lambda n, m: isinstance(m, nn.Linear)), skip


def _gptq_layers(model, config):
    """optimum's ``GPTQQuantizer.convert_model``: ``Conv1D``, ``nn.Conv2d`` and ``nn.Linear`` inside the blocks
    (``block_name_to_quantize``, else the first of optimum's patterns the model has), filtered by
    ``modules_in_block_to_quantize``."""
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    names = [n for n, _ in model.named_modules()]
    blocks = config.block_name_to_quantize
    if blocks is None:
        blocks = next((p for p in GPTQ_BLOCKS if any(n == p or n.startswith(p + ".") for n in names)), None)
    if blocks is None:
        raise InvalidOption(f"gptq: none of optimum's block names ({', '.join(GPTQ_BLOCKS)}) is a module of "
                            f"{type(model).__name__}; set block_name_to_quantize in quantization_config.")
    prefixes = [blocks] if isinstance(blocks, str) else list(blocks)
    keep = [k for group in config.modules_in_block_to_quantize or [] for k in group]
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, (Conv1D, nn.Conv2d, nn.Linear)) or not any(name.startswith(p) for p in prefixes):
            continue
        if keep and not any(name.endswith(k) for k in keep):
            continue
        if not any(name.startswith(p + ".") for p in layers):  # optimum stops at the first layer on a path
            layers[name] = module
    return layers, [f"everything outside {p}" for p in prefixes]


_LAYERS = {"bitsandbytes_4bit": _bnb_layers, "bitsandbytes_8bit": _bnb_layers, "gptq": _gptq_layers,
           "awq": _awq_layers, "fp8": _fp8_layers, "fbgemm_fp8": _fbgemm_layers}


# -- layouts ---------------------------------------------------------------------------------------------------------


def _shape(module) -> tuple[int, int]:
    """(out, in) of a linear-like layer: ``nn.Linear`` (out, in), ``Conv1D`` (in, out), a convolution (out, in x k)."""
    from transformers.pytorch_utils import Conv1D

    weight = module.weight
    if isinstance(module, Conv1D):
        return int(weight.shape[1]), int(weight.shape[0])
    return int(weight.shape[0]), int(weight.numel() // weight.shape[0])


def _bnb4(module, config):
    n = module.weight.numel()
    blocks = math.ceil(n / BNB_4BIT_BLOCK)
    if config.bnb_4bit_use_double_quant:
        absmax = blocks + 4 * math.ceil(blocks / BNB_NESTED_BLOCK) + 4 * 256 + 4  # uint8, absmax2, code, offset
    else:
        absmax = 4 * blocks
    yield "weight", math.ceil(n / 2) + absmax + 4 * 16, n  # packed, absmax, quant map


def _bnb8(module, config):
    out, _ = _shape(module)
    n = module.weight.numel()
    yield "weight", n + 4 * out, n


def _groups(config, k: int) -> int:
    return math.ceil(k / (config.group_size if config.group_size and config.group_size > 0 else k))


def _gptq(module, config):
    out, k = _shape(module)
    bits, groups = config.bits, _groups(config, k)
    packed_out = math.ceil(out * bits / 32)
    yield "weight", 4 * math.ceil(k * bits / 32) * out + 4 * groups * packed_out + 2 * groups * out + 4 * k, out * k


def _awq(module, config):
    out, k = _shape(module)
    bits, groups = config.bits, _groups(config, k)
    packed_out = math.ceil(out * bits / 32)
    yield "weight", 4 * k * packed_out + 4 * groups * packed_out + 2 * groups * out, out * k


def _fused(module) -> bool:
    return any(getattr(module, p, None) is not None and getattr(module, p).dim() == 3
               for p in ("gate_up_proj", "up_proj", "down_proj"))


def _fp8_scale_bytes(config) -> int:
    return 1 if getattr(config, "scale_fmt", "float") == "ue8m0" else 4


def _fp8(module, config):
    block = config.weight_block_size
    scale = _fp8_scale_bytes(config)
    static = 4 if config.activation_scheme == "static" else 0
    if not _fused(module):
        out, k = _shape(module)
        scales = math.ceil(out / block[0]) * math.ceil(k / block[1]) if block else 1
        yield "weight", out * k + scale * scales + static, out * k
        return
    fp4 = getattr(config, "expert_dtype", "fp8") == "fp4"
    for proj in ("gate_up_proj", "up_proj", "down_proj"):
        weight = getattr(module, proj, None)
        if weight is None or weight.dim() != 3:
            continue
        experts, out, k = map(int, weight.shape)
        floor = 2 if proj == "gate_up_proj" else 1  # _alloc_expert_proj(min_sf_out=2) for the fused gate and up
        if fp4:  # int8 holding two e2m1 values, a scale per row and 32 inputs
            stored, rows, cols = math.ceil(k / 2), max(out, floor), math.ceil(k / 32)
        else:
            stored = k
            rows = max(math.ceil(out / block[0]) if block else 1, floor)
            cols = math.ceil(k / block[1]) if block else 1
        yield proj, experts * (out * stored + scale * rows * cols) + experts * static, experts * out * k


def _fbgemm(module, config):
    out, k = _shape(module)
    yield "weight", out * k + 4 * out + 4, out * k
    if getattr(module, "bias", None) is not None:
        yield "bias", 4 * out, 0  # FbgemmFp8Linear keeps its bias in float32


_LAYOUTS = {"bitsandbytes_4bit": _bnb4, "bitsandbytes_8bit": _bnb8, "gptq": _gptq, "awq": _awq, "fp8": _fp8,
            "fbgemm_fp8": _fbgemm}
