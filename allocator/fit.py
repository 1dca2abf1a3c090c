"""How much fits: the longest context (or the largest batch) with the whole model and what ``generate`` needs on the
accelerators, then, for a longer context, the plan that offloads for it. Context first, then offload.

The model is read once (:func:`allocator.build_problem`); each length tried only swaps the generation budget's bytes
in the problem's graph (:func:`allocator.model.generation.generation_needs`, O(modules)), then checks the map that
keeps everything on the accelerators (one map check per try with one accelerator; a strategy run with several).
The KV cache, logits and activations grow monotonically with the length and the batch, so a bisection on integers
finds the exact answer in O(log N) tries.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

from .api import plan
from .budgets import format_bytes, parse_budgets
from .errors import AllocatorError, InfeasiblePlacement, InvalidOption
from .evaluate.validate import peak_parts
from .judge.verdict import is_valid, memory, verdict
from .model.generation import DECODER_POSITIONS, GenerationBudget, attention_words, generation_needs
from .placement import Placement
from .problem import PlanOptions, Problem, build_problem
from .report.plan import Plan
from .search.bisection import boundary
from .strategies import resolve, run
from .strategies.split import with_parts

__all__ = ["Fit", "fit", "positions", "split_map", "TERMS"]

TERMS = ("cache", "activations", "logits", "weights")
"""The parts of a device's peak (:attr:`allocator.Plan.parts`), as :class:`Fit` names what bounds the answer."""

MAX_TOKENS = 2**24
"""The longest context searched when the config names no position limit."""
MAX_BATCH = 2**16
"""The largest batch searched."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fit:
    """The answer of :func:`fit`.

    Attributes
    ----------
    searched : str
        ``"max_length"`` (the longest context at ``batch_size``) or ``"batch_size"`` (the largest batch at
        ``max_length``).
    max_length, batch_size : int
        The answer: the longest ``max_length`` (prompt and generated tokens) and the batch it holds, with the whole
        model, its KV cache, logits and activations on the accelerators; ``0`` where not even the smallest fits.
    device : int or str or None
        The accelerator that runs out first one step beyond the answer (``None`` when the model's positions bound it).
    term : str
        What bounds the answer: the part of that device's peak that grows the most (``"cache"``, ``"activations"``,
        ``"logits"``), ``"weights"`` when the weights alone do not fit, or ``"positions"`` (the model's
        ``max_position_embeddings`` or the like).
    reason : str
        The bound as a sentence, with the bytes of each part.
    plan : Plan or None
        The plan at the answer (everything on the accelerators); ``None`` when nothing fits.
    target : int or None
        The longer ``max_length`` (or larger batch) asked for.
    longer : Plan or None
        The plan for ``target``: the context kept, weights offloaded to RAM or disk as the contract's plan decides.
    margin : float
        The fraction of each budget kept free.
    tries : int
        Budgets checked by the search.
    positions : tuple
        The config field bounding the model's positions and its value (``("max_position_embeddings", 8192)``), or
        ``(None, None)``.
    attention : str
        The attention implementation the activations were computed for (the model's ``config._attn_implementation``,
        :func:`allocator.model.generation.attention_assumed`), in words: under ``"eager"`` the scores
        (``batch x heads x tokens x tokens``) are counted, under ``"sdpa"`` or flash attention they are not.
    """

    searched: str
    max_length: int
    batch_size: int
    device: object
    term: str
    reason: str
    plan: Plan | None
    target: int | None
    longer: Plan | None
    margin: float
    tries: int
    positions: tuple = (None, None)
    attention: str = ""
    split_length: int = 0
    """With ``runtime="allocator"`` (:attr:`allocator.problem.Problem.splits`), the longest ``max_length`` at
    ``batch_size`` with the attention side of every decoder layer and its KV cache on the first accelerator and
    everything else offloaded to RAM (:func:`split_map`), without prefetch unless ``prefetch=`` is given; 0 where not
    even 2 tokens fit so, or not searched."""
    split_map: Mapping | None = None
    """The map at :attr:`split_length`: each layer's attention side (attention, norms) on the accelerator, its MLP
    and every other module in RAM. ``None`` where not searched or nothing fits."""

    @property
    def tokens(self) -> int:
        """The longest context found (``max_length``)."""
        return self.max_length

    def summary(self) -> str:
        """The answer in a few lines: what fits, what bounds it, and what the target costs."""
        what = (f"{self.max_length:,} tokens (max_length) at batch {self.batch_size}" if self.searched == "max_length"
                else f"batch {self.batch_size:,} at max_length {self.max_length:,}")
        margin = f", {self.margin:.0%} of each budget kept free" if self.margin else ""
        lines = [f"fits: {what} with the whole model on the accelerators{margin}" if self.plan is not None else
                 f"fits: nothing with the whole model on the accelerators{margin}", f"bound: {self.reason}"]
        if self.attention:
            lines.append(f"assumes {self.attention}")
        name, value = self.positions
        if value is not None and self.max_length > value and self.plan is not None:
            lines.append(f"note: the model's positions end at {value:,} (config {name}); generate beyond them may "
                         "fail or degrade (fit(limit_positions=True), --limit-positions, stops there)")
        if self.split_map is not None:
            lines.append(f"split: {self.split_length:,} tokens (max_length) at batch {self.batch_size} with every "
                         "layer's attention and its KV cache on the accelerator, the MLPs and the rest in RAM "
                         "(runtime='allocator')")
        if self.longer is not None:
            offloaded = sum(self.longer.resident(d) for d in ("cpu", "disk"))
            unit = "tokens" if self.searched == "max_length" else "sequences"
            lines.append(f"target {self.target:,} {unit}: {format_bytes(offloaded)} of weights offloaded "
                         f"(main device {self.longer.main_device!r}, estimated "
                         f"{self.longer.cost.seconds * 1e3:.3f} ms {self.longer.priced_phrase()})")
        return "\n".join(lines)


def fit(model, max_memory: Mapping | None = None, *, batch_size: int = 1, max_length: int | None = None,
        target: int | None = None, margin: float = 0.0, limit_positions: bool = False, strategy="auto",
        options: PlanOptions | None = None, **keywords) -> Fit:
    """The longest context (or, given ``max_length``, the largest batch) whose ``generate`` keeps the whole model on
    the accelerators; then, given a longer ``target``, the plan that offloads for it.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A generative model, on the meta device or not. Never modified.
    max_memory : dict, optional
        Budgets as :func:`allocator.plan` takes them. Never modified.
    batch_size : int
        Sequences generated together while the context is searched (default 1).
    max_length : int, optional
        A fixed context: search the largest batch instead.
    target : int, optional
        A longer context (a larger batch when ``max_length`` is given) wanted anyway: :attr:`Fit.longer` is its plan.
    margin : float
        The fraction of each budget kept free, in [0, 1).
    limit_positions : bool
        Stop the search at the model's positions (config ``max_position_embeddings`` or the like). By default the
        answer is what memory allows, and :meth:`Fit.summary` says when it is beyond the positions.
    strategy, options, **keywords
        As :func:`allocator.plan` takes them (``dtype="bfloat16"``, ...); ``generation`` is what this function chooses.

    Returns
    -------
    Fit

    Raises
    ------
    InvalidOption
        A bad batch, length, target or margin, a ``generation`` option, or a model whose cache allocator does not
        model.

    Notes
    -----
    Exact under the memory model of :mod:`allocator.model.generation`: the bytes grow monotonically with the length
    and the batch, so a bisection over integers finds the largest value that fits in O(log N) checks, each O(modules)
    for the bytes plus one map check (one accelerator) or one strategy run (several). The plan at the answer is then
    made by :func:`allocator.plan` and checked to keep everything on the accelerators.

    Examples
    --------
    >>> import torch, allocator
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                              num_key_value_heads=2, intermediate_size=128, vocab_size=100,
    ...                              max_position_embeddings=100_000))
    >>> found = allocator.fit(model, {0: "4MiB"})
    >>> found.max_length, found.device, found.term
    (1202, 0, 'activations')
    >>> set(found.plan.device_map.values())
    {0}
    """
    _check(batch_size, "batch_size", 1)
    if max_length is not None:
        _check(max_length, "max_length", 2)
    if target is not None:
        _check(target, "target", 2)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise InvalidOption(f"margin must be a fraction of each budget kept free, in [0, 1), got {margin!r}; "
                            "e.g. margin=0.1.")
    if "generation" in keywords or (options is not None and options.generation is not None):
        raise InvalidOption("fit chooses the generation budget itself; give batch_size= and max_length= instead.")
    options = PlanOptions.of(options, **keywords)
    resolve(strategy)
    budgets = _kept_free(max_memory, margin)
    base = build_problem(model, budgets, options=options)
    if not base.budgets.accelerators:
        raise InvalidOption("fit answers how much fits on the accelerators, and max_memory names none; give e.g. "
                            "{0: '24GiB'}.")
    if not isinstance(limit_positions, bool):
        raise InvalidOption(f"limit_positions must be True or False, got {limit_positions!r}.")
    search = _Search(model, base, strategy, batch_size, max_length, limit_positions)
    with warnings.catch_warnings():   # lengths beyond the model's positions: Fit.summary says so once
        warnings.filterwarnings("ignore", message="GenerationBudget .* is above", category=UserWarning)
        return _fit(model, budgets, options, strategy, search, target, float(margin))


def _fit(model, budgets, options: PlanOptions, strategy, search: _Search, target, margin: float) -> Fit:
    best, bound = search.largest()
    searched, batch_size, max_length = search.searched, search.batch_size, search.max_length
    length, batch = (best, batch_size) if searched == "max_length" else (max_length, best)
    fitted = None
    if best:
        fitted = plan(model, budgets, strategy=strategy, options=dataclasses.replace(
            options, generation=GenerationBudget(batch, length)))
        offloaded = {"cpu", "disk"} & set(fitted.device_map.values())
        if offloaded:   # the strategy's plan offloads where a map on the accelerators exists: say so, never hide it
            raise AllocatorError(f"internal: the plan at {length} tokens, batch {batch}, offloads to {offloaded} "
                                 "though a map on the accelerators fits; please report it with the model and budgets.")
    device, term, reason = search.bound(best, bound, fitted)
    longer = None
    if target is not None and target > best:
        generation = (GenerationBudget(batch_size, target) if searched == "max_length"
                      else GenerationBudget(target, max_length))
        longer = plan(model, budgets, strategy=strategy, options=dataclasses.replace(options, generation=generation))
    split_length, found = search.split() if searched == "max_length" else (0, None)
    return Fit(searched, length or 0, batch, device, term, reason, fitted, target, longer, margin, search.tries,
               positions(model), attention_words(model), split_length, found)


def split_map(problem: Problem) -> dict | None:
    """The map with the attention side of every layer of ``problem.splits`` (dense ones) on the first accelerator
    and everything else in RAM, or ``None`` where no layer can be split (not ``runtime="allocator"``, no such
    layer, no accelerator)."""
    dense = [s for s in problem.splits if not s.moe]
    if not dense or not problem.budgets.accelerators:
        return None
    main = problem.budgets.accelerators[0]
    parts = {}
    for s in dense:
        parts.update(dict.fromkeys(s.near, main))
        parts[s.far] = "cpu"
    return with_parts(problem, {"": "cpu"}, parts, {s.layer for s in dense})


def _check(value, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidOption(f"{name} must be an integer of at least {least}, got {value!r}.")


def _kept_free(max_memory, margin: float):
    """``max_memory`` with ``margin`` of each budget kept free (a new dict; the caller's is not modified)."""
    if not margin:
        return max_memory
    budgets = parse_budgets(max_memory)
    return {d: int(limit * (1 - margin)) for d, limit in budgets.limits.items()}


def positions(model) -> tuple[str | None, int | None]:
    """The config field bounding the decoder's positions and its value (``max_position_embeddings``, ...)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in DECODER_POSITIONS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None, None


class _Search:
    """The bisection: one problem built, only the generation budget's bytes swapped per try."""

    def __init__(self, model, base: Problem, strategy, batch_size: int, max_length: int | None,
                 limit_positions: bool):
        self.model, self.base, self.strategy = model, base, strategy
        self.limit_positions = limit_positions
        self.searched = "batch_size" if max_length is not None else "max_length"
        self.batch_size, self.max_length = batch_size, max_length
        self.tries = 0

    def budget(self, value: int) -> GenerationBudget:
        if self.max_length is None:
            return GenerationBudget(self.batch_size, value)
        return GenerationBudget(value, self.max_length)

    def problem(self, value: int) -> Problem:
        """The base problem with the generation budget of ``value`` folded into its graph, as the builder folds it."""
        budget = self.budget(value)
        base = self.base
        needs = generation_needs(self.model, base.graph, budget, dtype=base.reading.dtype)
        graph = dataclasses.replace(base.graph, extra=needs.node_bytes(), workspace=needs.activations,
                                    main_workspace=needs.scores)
        return dataclasses.replace(base, graph=graph, generation=needs,
                                   options=dataclasses.replace(base.options, generation=budget))

    def on_accelerators(self, problem: Problem) -> dict | None:
        """A valid map that keeps everything on the accelerators, or ``None``."""
        self.tries += 1
        accelerators = problem.budgets.accelerators
        whole = {"": accelerators[0]}
        if is_valid(problem, whole):
            return whole
        if len(accelerators) == 1:
            return None
        try:
            found = run(self.strategy, problem).device_map
        except InfeasiblePlacement:
            return None
        if set(found.values()) <= set(accelerators) and is_valid(problem, found):
            return found
        return None

    def fits(self, value: int) -> bool:
        return self.on_accelerators(self.problem(value)) is not None

    def split_fits(self, value: int) -> dict | None:
        """:func:`split_map` where its verdict at ``value`` is valid (every byte our runtime holds within budget)."""
        self.tries += 1
        problem = self.problem(value)
        if problem.runtime.prefetch is None:   # the depth a plan would choose: none where nothing more fits
            problem = problem.with_options(prefetch=0)
        found = split_map(problem)
        if found is None:
            return None
        return found if verdict(problem, Placement(found, strategy="fit")).valid else None

    def split(self) -> tuple[int, dict | None]:
        """The longest ``max_length`` whose :func:`split_map` fits, and that map (``(0, None)`` where none)."""
        if not self.base.splits or self.split_fits(2) is None:
            return 0, None
        lo, hi = 2, (positions(self.model)[1] if self.limit_positions else None) or MAX_TOKENS
        if self.split_fits(hi) is not None:
            return hi, self.split_fits(hi)
        while hi - lo > 1:   # lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.split_fits(mid) is not None else (lo, mid)
        return lo, self.split_fits(lo)

    def largest(self) -> tuple[int, str | None]:
        """The largest value that fits (0: none), and ``"positions"`` when the model's positions stopped it."""
        least = 2 if self.max_length is None else 1
        if not self.fits(least):
            return 0, None
        limit = positions(self.model)[1] if self.limit_positions and self.max_length is None else None
        cap = limit or (MAX_TOKENS if self.max_length is None else MAX_BATCH)
        if self.fits(cap):
            return cap, "positions" if limit else "cap"
        return boundary(self.fits, least, cap), None   # least fits, cap does not

    def bound(self, best: int, stop: str | None, fitted: Plan | None) -> tuple[object, str, str]:
        """The device and term that bound ``best``, and the sentence that says so."""
        what = "tokens" if self.max_length is None else "sequences"
        if stop == "positions":
            name, value = positions(self.model)
            return None, "positions", f"the model's positions: config {name} is {value:,}"
        if stop == "cap":
            limit = MAX_TOKENS if self.max_length is None else MAX_BATCH
            return None, "positions", f"the search stops at {limit:,} {what}"
        base_map = fitted.device_map if fitted is not None else {"": self.base.budgets.accelerators[0]}
        over = self.problem(best + 1) if best else self.problem(2 if self.max_length is None else 1)
        needs = memory(over, base_map)
        parts = peak_parts(over, base_map, needs)
        limits = over.budgets.limits
        device = max((d for d in needs.peak if d in limits and limits[d]),
                     key=lambda d: needs.peak[d] / limits[d], default=self.base.budgets.accelerators[0])
        mine = parts.get(device, {})
        shown = " + ".join(f"{k} {format_bytes(mine.get(k, 0))}" for k in ("weights",) + TERMS[:3])
        if not best:
            return device, "weights", (f"not even {2 if self.max_length is None else 1} {what} fit on the "
                                       f"accelerators: device {device!r} would need {shown} = "
                                       f"{format_bytes(needs.peak[device])} of {format_bytes(limits[device])}")
        half = self.problem(max(best // 2, 2 if self.max_length is None else 1))
        before = peak_parts(half, base_map, memory(half, base_map)).get(device, {})
        term = max(TERMS[:3], key=lambda k: mine.get(k, 0) - before.get(k, 0))
        names = {"cache": "the KV cache grows", "activations": "the activations grow", "logits": "the logits grow"}
        return device, term, (f"device {device!r}: at {best + 1:,} {what} its peak would be {shown} = "
                              f"{format_bytes(needs.peak[device])}, over its budget of "
                              f"{format_bytes(limits[device])}; {names[term]} the most with the "
                              f"{'context' if self.max_length is None else 'batch'}")
