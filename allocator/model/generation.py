"""Memory that ``generate`` needs beyond the weights: the KV cache, the logits, the activations.

A :class:`GenerationBudget` passed to :func:`allocator.plan` (``generation=``) is turned once, by the problem
builder, into bytes attached to the model graph (:attr:`ModelGraph.extra`, :attr:`ModelGraph.workspace`,
:attr:`ModelGraph.main_workspace`). Strategies never see the budget: the bytes enter the units like the buffers of a
module (they live where the module *executes*: its device when resident, the main device when offloaded), and
:func:`allocator.evaluate.memory.peaks` — the one place per-device peaks are computed — adds them. So every strategy
that respects the validator's peaks respects the generation budget too.

What is counted, for transformers' default ``DynamicCache`` (checked against transformers 5.24's and 5.25's
``cache_utils`` and ``GenerationMixin._sample``):

KV cache
    Per attention module that owns a cache layer (a module with an integer ``layer_idx`` and key/value projections,
    under the model's ``get_decoder()``), ``batch × tokens × (k width + v width) × bytes``, where the widths are the
    out features of its key and value projections (``num_key_value_heads × head_dim``, so GQA is exact; for fused
    projections such as GPT-2's ``c_attn`` or Falcon's ``query_key_value``, the module's or config's key/value heads
    × head dim) and ``tokens`` is:

    - full attention: ``max_length - 1`` (the last generated token is never fed back);
    - sliding window ``W`` (layer types from ``DynamicCache(config=...)``, i.e. ``config.layer_types`` /
      ``sliding_window``): ``max(prefill, min(max_length - 1, W))`` — the layer keeps a view of the last
      ``W - 1`` tokens of a tensor of up to ``W`` tokens, but right after the prefill it still holds the whole prompt;
    - cross-attention (encoder-decoder models): the encoder length (``prompt_length``).

    The key bytes are charged to the key projection, the value bytes to the value projection (the cache tensors are
    their outputs, so they live on the device those modules execute on). Each layer is counted at its own largest,
    so with sliding and full layers mixed and a prompt longer than the window the sum is an upper bound.
    Layers that reuse an earlier layer's keys and values (Gemma-4 E-series, ``num_kv_shared_layers``), which
    transformers gives a ``DummyLayer``, hold nothing: 0 bytes (their attention modules have no key/value
    projections, so they are not found at all). Other caches (``cache_implementation="static"``, quantized or
    offloaded caches) are not modelled; :mod:`allocator.model.cache_layers` models or refuses each cache-layer class
    by name.
Logits
    The output head's output for the positions generate asks for (``logits_to_keep=1`` when the model supports it,
    else the whole prefill) on the head's executing device, and on the main device the float32 next-token logits,
    the processed scores and the sampling probabilities (``3 × batch × vocab × 4`` bytes).
Activations
    On every device that executes part of the model, the largest forward's working set: the prefill of ``batch ×
    tokens`` (the prompt, or the encoder input of an encoder-decoder model) through one block, the larger of two
    moments, plus the 4-D masks ``create_causal_mask`` holds through the forward:

    - the MLP's (or the projections'): four hidden-state copies (the block's input, held by its caller; the
      embeddings, held by the model's forward; the residual; the normalised input), then the larger of the attention
      projections (query and key twice, before and after rotary embeddings; value; output) and the MLP's three
      intermediates, plus one layer's key (or value) tensor copied when the cache grows (``torch.cat`` allocates the
      new tensor before the old one is freed);
    - the attention's: the embeddings, residual and normalised input, the query, the keys and values repeated to
      every head, rotary cos and sin, and under eager attention (or T5-style position bias) two copies of the
      ``batch × heads × tokens × tokens`` scores at once (the product and its scaled copy in float32; in half
      precision the sum with the mask, its float32 copy and the float32 softmax), under sdpa with a mask the mask's
      copy in the compute dtype and the output;
    - the masks: under eager attention one float mask per kind of layer (full, sliding) in the compute dtype;
      under sdpa none for one unpadded sequence (``is_causal`` stands in), else a boolean one for a sliding window
      within the length and for a batch (padding possible).

    Measured on CPU against every allocation of a prefill (torch profiler, ``benchmarks/prefill_memory.py``,
    ``tests/model/test_prefill_memory.py``): a tiny qwen3 within 0.3 % at 256, 1,024 and 4,096 tokens under sdpa
    and eager, float32 and bfloat16; a padded batch under sdpa 0.95-1.02 (the CPU kernel's own buffers are not
    counted). Against all of ``generate`` (``tests/model/test_generation.py``): llama within the prediction; T5 about
    half (its position bias is counted as eager scores).

The attention modules that fill cache layers, and their key/value widths, are found by
:mod:`allocator.model.attention`. Unknown architectures (no attention module with ``layer_idx`` and key/value
projections, or cache layers :mod:`allocator.model.cache_layers` refuses, such as linear-attention, hybrid or indexed
layers) raise :class:`allocator.InvalidOption` rather than planning with a cache of unknown size.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field

from ..budgets import format_bytes
from ..errors import InvalidOption, warn_caller
from .attention import CacheAttention, cache_attentions, first_positive_int, in_features, out_features, projection
from .families import Family, family_of
from .sizes import as_dtype, dtype_bytes

__all__ = ["GenerationBudget", "GenerationNeeds", "generation_needs", "decoder_length"]

log = logging.getLogger(__name__)

SCORE_COPIES = 3  # float32 next-token logits, processed scores, sampling probabilities (GenerationMixin._sample)


@dataclass(frozen=True, slots=True)
class GenerationBudget:
    """The largest ``generate`` call a plan must have room for.

    Give ``max_length``, or ``max_new_tokens`` with ``prompt_length`` as in ``generate(max_new_tokens=...)``.

    Parameters
    ----------
    batch_size : int
        Sequences generated together.
    max_length : int, optional
        The longest sequence ``generate`` produces, prompt included (its ``max_length``: prompt length plus
        ``max_new_tokens``). For encoder-decoder models, the decoder's length, its start token included. Set from
        ``prompt_length + max_new_tokens`` when omitted.
    dtype : torch.dtype or str, optional
        The dtype of the cache and activations; by default the dtype the weights are planned in (``plan(dtype=)``,
        else the key projection's).
    prompt_length : int, optional
        Keyword only. The longest prompt: the prefill length of a decoder-only model (default and at most
        ``max_length - 1``); for encoder-decoder models the number of encoder positions the cross-attention cache
        holds (default ``max_length``): the input tokens for T5 or BART, 1500 audio frames for Whisper.
    max_new_tokens : int, optional
        Keyword only. Tokens generated after the prompt, as ``generate(max_new_tokens=...)`` takes them; needs
        ``prompt_length``. Then ``max_length`` is ``prompt_length + max_new_tokens`` as ``generate`` computes it
        (giving both is allowed only when they agree); for an encoder-decoder model the decoder holds
        ``max_new_tokens + 1`` tokens (its start token and the new ones) and ``prompt_length`` is the encoder's input.

    Raises
    ------
    InvalidOption
        Non-integer or non-positive sizes, a prompt longer than allowed, a dtype torch does not know, neither
        ``max_length`` nor ``max_new_tokens``, ``max_new_tokens`` without ``prompt_length``, or a ``max_length``
        that disagrees with ``prompt_length + max_new_tokens``.

    Notes
    -----
    A ``max_length`` above the model's ``max_position_embeddings`` is planned for, with a ``UserWarning`` naming both
    numbers when the plan is made (the config is known only then).

    Examples
    --------
    >>> GenerationBudget(4, 2048, "bfloat16")
    GenerationBudget(batch_size=4, max_length=2048, dtype=torch.bfloat16, prompt_length=None, max_new_tokens=None)
    >>> GenerationBudget(batch_size=4, prompt_length=100, max_new_tokens=28).max_length
    128
    >>> GenerationBudget(0, 2048)
    Traceback (most recent call last):
    ...
    allocator.errors.InvalidOption: GenerationBudget.batch_size must be a positive int, got 0; pass e.g. batch_size=1.
    """

    batch_size: int
    max_length: int | None = None
    dtype: object = None
    _: KW_ONLY
    prompt_length: int | None = None
    max_new_tokens: int | None = None

    def __post_init__(self):
        _positive("batch_size", self.batch_size, 1)
        if self.max_new_tokens is not None:
            self._from_new_tokens()
        elif self.max_length is None:
            raise InvalidOption("GenerationBudget needs max_length, or max_new_tokens with prompt_length (as generate "
                                "takes them); pass e.g. max_length=2048 or prompt_length=1024, max_new_tokens=256.")
        _positive("max_length", self.max_length, 2048)
        if self.max_length < 2:
            raise InvalidOption(f"GenerationBudget.max_length must be at least 2 (a prompt token and a generated "
                                f"one), got {self.max_length}.")
        if self.prompt_length is not None:
            _positive("prompt_length", self.prompt_length, self.max_length - 1)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", as_dtype(self.dtype, "GenerationBudget.dtype"))

    def _from_new_tokens(self) -> None:
        """``max_length = prompt_length + max_new_tokens``, as ``generate`` computes it; checked against a given one."""
        _positive("max_new_tokens", self.max_new_tokens, 256)
        if self.prompt_length is None:
            raise InvalidOption(f"GenerationBudget.max_new_tokens={self.max_new_tokens} needs prompt_length, the "
                                "longest prompt in tokens (generate's max_length is the prompt's length plus "
                                "max_new_tokens); pass e.g. prompt_length=1024.")
        _positive("prompt_length", self.prompt_length, 1024)
        total = self.prompt_length + self.max_new_tokens
        if self.max_length is None:
            object.__setattr__(self, "max_length", total)
        elif self.max_length != total:
            raise InvalidOption(
                f"GenerationBudget got max_length={self.max_length} and max_new_tokens={self.max_new_tokens}, but "
                f"prompt_length {self.prompt_length} + max_new_tokens {self.max_new_tokens} = {total}; give "
                f"max_length or max_new_tokens, not both.")


def _positive(name: str, value, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidOption(f"GenerationBudget.{name} must be a positive int, got {value!r}; pass e.g. "
                            f"{name}={example}.")


@dataclass(frozen=True, slots=True)
class CacheLayer:
    """One cache layer as planned: the attention module, its kind, the tokens it holds, its bytes."""

    module: str
    index: int         # its ``layer_idx``: the layer of the (self- or cross-attention) cache it fills
    kind: str          # "full", "sliding", "shared" (reuses an earlier layer's keys and values: 0 bytes) or "cross"
    tokens: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class GenerationNeeds:
    """The bytes a :class:`GenerationBudget` adds, attributed to graph nodes (built by :func:`generation_needs`)."""

    budget: GenerationBudget
    cache: Mapping[int, int]        # node -> KV bytes (keys on the key projection, values on the value projection)
    logits: Mapping[int, int]       # output head node -> bytes of its output
    scores: int                     # main device: float32 next-token logits, processed scores, probabilities
    activations: int                # every executing device
    layers: tuple[CacheLayer, ...] = ()
    notes: tuple[str, ...] = field(default=())
    attention: str = ""
    """The attention implementation the activations assume (:func:`attention_assumed`), in words."""

    @property
    def cache_bytes(self) -> int:
        """Bytes of the whole KV cache."""
        return sum(self.cache.values())

    def summary(self) -> str:
        """One line: the budget, the cache by kind of layer, logits, scores and activations."""
        kinds: dict[str, list[int]] = {}
        for layer in self.layers:
            kinds.setdefault(layer.kind, []).append(layer.nbytes)
        cache = ", ".join(f"{len(v)} {k} layers {format_bytes(sum(v))}" for k, v in kinds.items())
        return (f"{self.notes[0] if self.notes else 'generate'}: KV cache {format_bytes(self.cache_bytes)} ({cache}), "
                f"logits {format_bytes(sum(self.logits.values()))} where the head runs, scores "
                f"{format_bytes(self.scores)} on the main device, activations {format_bytes(self.activations)} on "
                "every device that runs the model")

    def node_bytes(self) -> dict[int, int]:
        """Cache and logits bytes per node: what :attr:`ModelGraph.extra` holds."""
        out = dict(self.cache)
        for node, nbytes in self.logits.items():
            out[node] = out.get(node, 0) + nbytes
        return out


# ----------------------------------------------------------------------------------------------- builder


def _element_bytes(budget: GenerationBudget, plan_dtype, weight, config) -> int:
    import torch

    if budget.dtype is not None:
        return dtype_bytes(budget.dtype)[0]
    own = weight.dtype if weight.is_floating_point() else as_dtype(getattr(config, "dtype", None) or torch.float32,
                                                                     "config.dtype")
    plan_dtype = as_dtype(plan_dtype, "dtype") if plan_dtype is not None else None
    if plan_dtype is not None and plan_dtype.is_floating_point:  # int8/int4 weights still compute in floating point
        return min(dtype_bytes(plan_dtype)[0], dtype_bytes(own)[0])
    return dtype_bytes(own)[0]


def generation_needs(model, graph, budget: GenerationBudget, *, dtype=None,
                     family: Family | None = None) -> GenerationNeeds:
    """The bytes ``budget`` adds for ``model``, attributed to the nodes of ``graph`` (see the module notes).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A generative transformers model (meta device is fine). Never modified.
    graph : ModelGraph
        Its graph, as :func:`allocator.model.build_graph` made it.
    budget : GenerationBudget
    dtype : torch.dtype, optional
        The dtype the plan loads the weights in (``plan(dtype=)``).
    family : Family, optional
        The model's family (:func:`allocator.model.families.family_of`, the default): its ``cache_layers`` hook
        says how the cache's layers are built.

    Raises
    ------
    InvalidOption
        When ``budget`` is not a :class:`GenerationBudget`, the model's family does not generate tokens, or the
        model has no attention module with a ``layer_idx`` and key/value projections, or its cache has layers
        allocator does not model.

    Notes
    -----
    O(number of modules).

    Examples
    --------
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from allocator.model import build_graph
    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                              num_key_value_heads=2, intermediate_size=128, vocab_size=100))
    >>> needs = generation_needs(model, build_graph(model), GenerationBudget(2, 16))
    >>> needs.cache_bytes  # 2 layers x (K + V) x batch 2 x 15 tokens x 2 kv heads x 16 dims x 4 bytes
    15360
    """
    family = family_of(model) if family is None else family
    config = _generative_config(model, budget, family)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    prefill, encoder_tokens = _lengths(budget, encoder_decoder)
    _check_positions(config, decoder_length(budget, encoder_decoder), encoder_tokens)
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)
    attentions = cache_attentions(model, config, encoder_decoder, names)
    self_layers = [a for a in attentions if not a.cross]
    if not self_layers:
        raise InvalidOption(
            f"{type(model).__name__} has no attention module with a layer_idx and key/value projections, so the size "
            "of its generation cache is unknown to allocator; plan without generation= and keep headroom on the "
            "devices instead.")
    ebytes = _element_bytes(budget, dtype, self_layers[0].key_module.weight, config)
    kinds = family.cache_layers(config, max(a.index for a in self_layers) + 1)
    B, L = budget.batch_size, decoder_length(budget, encoder_decoder)
    cache: dict[int, int] = {}
    layers: list[CacheLayer] = []
    for a in attentions:
        if a.cross:
            kind, tokens = "cross", encoder_tokens
        else:
            kind, window = kinds[a.index]
            tokens = {"full": L - 1, "shared": 0}.get(kind, max(prefill, min(L - 1, window or 0)))
        for path, width in ((a.key_path, a.key_width), (a.value_path, a.value_width)):
            node = _leaf_with_tensors(graph, graph.node_index[path])
            cache[node] = cache.get(node, 0) + B * tokens * width * ebytes
        layers.append(CacheLayer(a.name, a.index, kind, tokens, B * tokens * (a.key_width + a.value_width) * ebytes))
    largest_tensor = max(B * layer.tokens * max(a.key_width, a.value_width) * ebytes
                         for layer, a in zip(layers, attentions))
    logits, scores = _logits(model, graph, names, B, 1 if encoder_decoder else prefill, ebytes)
    tokens = max(prefill, encoder_tokens)
    masks = _masks(model, kinds, B, tokens)
    activations = _activations(model, config, self_layers[0], B, tokens, ebytes, masks, largest_tensor)
    notes = (f"generate: batch {B}, max_length {L}, prefill {prefill}"
             + (f", encoder {encoder_tokens}" if encoder_decoder else "") + f" tokens, {ebytes} bytes per element",)
    return GenerationNeeds(budget=budget, cache=cache, logits=logits, scores=scores, activations=activations,
                           layers=tuple(layers), notes=notes, attention=attention_words(model))


def _generative_config(model, budget, family: Family):
    """The model's config, after checking it can generate; typed errors otherwise."""
    if not isinstance(budget, GenerationBudget):
        raise InvalidOption(f"generation must be an allocator.GenerationBudget, got {type(budget).__name__}; pass "
                            "generation=allocator.GenerationBudget(batch_size, max_length).")
    if not family.generates:
        raise InvalidOption(f"{type(model).__name__} is a {family.name} model, which does not generate tokens; plan "
                            "it without generation= (pass inputs= to price its forward).")
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidOption(f"{type(model).__name__} has no transformers config: a generation budget needs a "
                            "transformers model (PreTrainedModel) to size its cache.")
    if callable(getattr(model, "can_generate", None)) and not model.can_generate():
        raise InvalidOption(f"{type(model).__name__} cannot generate (transformers' can_generate() is False); plan "
                            "without generation=, or load its generative variant (e.g. ...ForCausalLM).")
    return config


#: Config fields bounding the positions of the decoder (or a decoder-only model), then of an encoder, in the order read.
DECODER_POSITIONS = ("max_target_positions", "max_position_embeddings", "n_positions")
ENCODER_POSITIONS = ("max_source_positions", "max_position_embeddings", "n_positions")


def _check_positions(config, decoder_tokens: int, encoder_tokens: int) -> None:
    """Warn when the sequences planned for are longer than the model's position embeddings allow."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    checks = [("max_length", decoder_tokens, text, DECODER_POSITIONS)]
    if encoder_tokens:
        checks.append(("prompt_length (the encoder's input)", encoder_tokens, config, ENCODER_POSITIONS))
    for what, tokens, where, fields in checks:
        name, limit = next(((f, n) for f in fields if (n := first_positive_int(getattr(where, f, None)))), (None, None))
        if limit is not None and tokens > limit:
            warn_caller(f"GenerationBudget {what} {tokens} is above {type(config).__name__}.{name} {limit}: the model "
                        f"has no positions beyond {limit} (generate may fail or degrade there); planning for {tokens} "
                        f"tokens anyway.")


def decoder_length(budget: GenerationBudget, encoder_decoder: bool) -> int:
    """The longest sequence the decoder holds: ``max_length``, or for an encoder-decoder model given
    ``max_new_tokens``, those tokens and the decoder's start token (``generate`` adds them to the decoder's input)."""
    if encoder_decoder and budget.max_new_tokens is not None:
        return budget.max_new_tokens + 1
    return budget.max_length


def _lengths(budget: GenerationBudget, encoder_decoder: bool) -> tuple[int, int]:
    """(tokens of the decoder's prefill, tokens of the encoder input or 0)."""
    L = decoder_length(budget, encoder_decoder)
    if encoder_decoder:
        return 1, budget.prompt_length or L  # the decoder starts from its start token
    if budget.prompt_length is not None and budget.prompt_length > L - 1:
        raise InvalidOption(f"GenerationBudget.prompt_length {budget.prompt_length} leaves no token to generate "
                            f"within max_length {L}; use prompt_length <= {L - 1}.")
    return budget.prompt_length or L - 1, 0


def _logits(model, graph, names, batch: int, prefill: int, ebytes: int) -> tuple[dict, int]:
    """Bytes of the output head's output per head node, and of the float32 scores on the main device."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None or not hasattr(head, "weight") or id(head) not in names:
        return {}, 0
    vocab = out_features(head)
    keep = 1 if "logits_to_keep" in inspect.signature(model.forward).parameters else prefill
    node = _leaf_with_tensors(graph, graph.node_index[names[id(head)]])
    return {node: batch * keep * vocab * ebytes}, SCORE_COPIES * batch * vocab * 4


def _leaf_with_tensors(graph, node: int) -> int:
    """``node`` itself when it is a leaf, else its first descendant leaf with tensors (extras stay on one unit)."""
    nodes = graph.nodes
    while nodes.end[node] > node + 1 and not nodes.tensors_of(node):
        node += 1  # its first child
    return node


def _masks(model, kinds, batch: int, length: int) -> int:
    """The 4-D attention masks ``create_causal_mask`` materialises for a prefill of ``length`` tokens (transformers
    5.25's ``masking_utils``): one per kind of layer (full, sliding). Under eager attention always, in the compute
    dtype; under sdpa only where ``is_causal`` cannot stand in for it (``_ignore_causal_mask_sdpa``), as booleans: a
    sliding layer whose window is within the length, and a full layer when the batch may hold padding (batch > 1)."""
    eager = attention_assumed(model)[1]
    windows = [window for kind, window in kinds if kind == "sliding"]
    full = any(kind == "full" for kind, _ in kinds) or not kinds
    if eager:
        return int(full) + int(bool(windows))
    return int(full and batch > 1) + int(any(w is not None and length >= w for w in windows))


def _activations(model, config, attention: CacheAttention, batch: int, length: int, ebytes: int, masks: int,
                 largest_tensor: int) -> int:
    """Working set of the largest block forward of ``batch x length`` tokens (module notes): the larger of the MLP's
    moment and the attention's, both with the masks held through the forward."""
    import torch

    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kw, vw = attention.key_width, attention.value_width
    hidden = in_features(attention.key_module)
    _, q = projection(model.get_submodule(attention.name), ("q_proj", "q", "query", "q_lin", "to_q"))
    q_width = out_features(q) if q is not None else hidden
    vocab = getattr(text_config, "vocab_size", None)
    intermediate = 0
    for sub in model.modules():
        if isinstance(sub, torch.nn.Linear) and sub.out_features != vocab:
            intermediate = max(intermediate, sub.out_features)
    for key in ("intermediate_size", "d_ff", "decoder_ffn_dim", "ffn_dim"):
        value = getattr(text_config, key, None)
        if isinstance(value, int):
            intermediate = max(intermediate, value)
    heads = getattr(text_config, "num_attention_heads", None) or max(1, q_width // 64)
    tokens, pairs = batch * length, batch * length * length
    eager = attention_assumed(model)[1]
    held = masks * pairs * (ebytes if eager else 1)
    per_token = 4 * hidden + max(2 * q_width + 2 * kw + vw + hidden, 3 * intermediate)
    mlp = tokens * per_token * ebytes + largest_tensor
    # the attention's moment: embeddings, residual, normed input, query, keys and values repeated to every head,
    # rotary cos and sin; under eager two copies of the scores (the product and the next step's, a float32 softmax
    # and a cast back in half precision), under sdpa with a mask its copy in the compute dtype and the output
    attention_tokens = 3 * hidden + 3 * q_width + 2 * (q_width // heads)
    if eager:
        at_attention = heads * pairs * (ebytes + (4 if ebytes == 4 else 8))
    elif masks:
        at_attention, attention_tokens = pairs * ebytes, attention_tokens + q_width
    else:
        at_attention = 0
    return held + max(mlp, tokens * attention_tokens * ebytes + at_attention)


def attention_assumed(model) -> tuple[str, bool]:
    """The attention implementation :func:`generation_needs` counts activations for, and whether it materialises the
    scores: the (text) config's ``_attn_implementation`` (``"sdpa"``, ``"flash_attention_2"``, ``"eager"``, ...;
    ``"sdpa"`` where unset, as transformers picks it); the scores, ``batch x heads x tokens x tokens``, two copies
    at once (see the module notes), and a float mask are counted under ``"eager"`` and for T5-style position bias
    (``relative_attention_bias``), which materialise them, and not for the memory-efficient kernels.

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
    ...                      vocab_size=100)
    >>> config._attn_implementation = "eager"
    >>> with torch.device("meta"):
    ...     attention_assumed(LlamaForCausalLM(config))
    ('eager', True)
    """
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    name = getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None) or "sdpa"
    name = name if isinstance(name, str) else "sdpa"
    return name, name == "eager" or any(hasattr(m, "relative_attention_bias") for m in model.modules())


def attention_words(model) -> str:
    """:func:`attention_assumed` as a sentence for reports."""
    name, scores = attention_assumed(model)
    return (f"attention {name}: the scores are materialised and counted (batch x heads x tokens x tokens, two "
            "copies at once, one layer at a time, and a float mask)" if scores else
            f"attention {name}: a memory-efficient kernel, the scores are not materialised (eager attention would "
            "add batch x heads x tokens x tokens of them)")
