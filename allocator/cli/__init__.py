"""Command line: ``allocator plan``, ``allocator demo`` and ``allocator profile``.

::

    allocator plan SOURCE [--max-memory 0=20GiB,1=20GiB,cpu=64GiB] [--dtype bfloat16] [--strategy auto]
                          [--compare] [--explain] [--json FILE] [--plot FILE] [--profile FILE]
                          [--inputs input_ids=1x512] [--optimize prefill|decode] [--trust-remote-code]
    allocator plan --list
    allocator demo [--model t5-base] [--strategy auto]
    allocator profile [--out FILE] [--folder DIR]
    allocator --version

``SOURCE`` is a local model folder holding a ``config.json``, a ``config.json`` path, or a built-in example
(``allocator plan --list``). Models are built from their config on the meta device: nothing is downloaded and no
weights are read.

Bad input exits with status 2 and one line on stderr starting with ``allocator: error:``, never a traceback. A reader
that stops early (``allocator plan ... | head -3``) ends the command quietly, with status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Mapping

from .. import __version__
from ..model import zoo
from ..api import plan
from ..budgets import format_bytes, parse_budgets, small_bare_number
from ..model.checkpoint import kept_in_float32, load_dtype
from ..profile import Profile
from ..errors import AllocatorError, InvalidBudget, InvalidModel, InvalidOption
from ..model.generation import GenerationBudget
from ..model import as_dtype
from ..problem import build_problem
from ..model.quantization import quantized_sizes
from ..strategies import STRATEGIES, resolve
from ..model.zoo import move_strays_to_meta, quiet_transformers

__all__ = ["main", "parse_max_memory", "parse_inputs", "LoadedModel", "load_model", "load_profile", "device_table",
           "generation_table", "compare_text", "side_by_side", "plot_plans", "DEMO_SCENARIOS"]

ACCELERATE = "sequential"
"""The strategy that reproduces accelerate's ``infer_auto_device_map`` output for output."""

DEMO_SCENARIOS: dict[str, dict] = {
    "one GPU at 60% of the model, RAM for the rest": {0: 0.60, "cpu": 1.0},
    "two GPUs at 15% each, RAM at 50%": {0: 0.15, 1: 0.15, "cpu": 0.50},
    "RAM only, 50% of the model (the rest on disk)": {"cpu": 0.50},
}
"""Budgets of ``allocator demo`` as fractions of the model's size."""

_MAX_MESSAGE = 400
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, like every other error of the command."""

    def error(self, message):  # noqa: D102 - argparse's hook
        _fail(f"{message} (see '{self.prog} --help')")
        raise SystemExit(2)


def _one_line(text: str, limit: int = _MAX_MESSAGE) -> str:
    """``text`` on one line, cut to ``limit`` characters.

    >>> _one_line("a\\n  b")
    'a b'
    >>> len(_one_line("x" * 1000))
    400
    """
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(message: str) -> int:
    print(f"allocator: error: {_one_line(message, 10 * _MAX_MESSAGE)}", file=sys.stderr)
    return 2


# -- inputs ----------------------------------------------------------------------------------------------------------


def parse_generation(text: str):
    """``"4,2048"`` or ``"4,2048,1024"`` -> ``GenerationBudget(4, 2048, prompt_length=1024)``, checked.

    >>> parse_generation("4,2048,1024")
    GenerationBudget(batch_size=4, max_length=2048, dtype=None, prompt_length=1024, max_new_tokens=None)
    """
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise InvalidOption(f"--generation takes BATCH,MAX_LENGTH or BATCH,MAX_LENGTH,PROMPT as integers, got "
                            f"{text!r}; e.g. --generation 4,2048.")
    batch, length, *prompt = map(int, parts)
    return GenerationBudget(batch, length, prompt_length=prompt[0] if prompt else None)


def parse_inputs(text: str):
    """``"input_ids=1x512,pixel_values=1x3x512x512"`` -> ``{"input_ids": (1, 512), ...}``; ``"default"`` as is.

    Raises
    ------
    InvalidOption
        An entry that is not ``NAME=DIMxDIM...`` of positive integers, or a name given twice.

    Examples
    --------
    >>> parse_inputs("input_ids=1x512,pixel_values=1x3x64x64")
    {'input_ids': (1, 512), 'pixel_values': (1, 3, 64, 64)}
    >>> parse_inputs("input_ids=1x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    allocator.errors.InvalidOption: --inputs entry 'input_ids=1x' is not NAME=DIMxDIM... of positive integers; ...
    """
    if text.strip() == "default":
        return "default"
    out: dict = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, shape = (s.strip() for s in part.partition("="))
        dims = shape.lower().split("x")
        if not sep or not name.isidentifier() or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise InvalidOption(f"--inputs entry {part!r} is not NAME=DIMxDIM... of positive integers; write e.g. "
                                "input_ids=1x512 or pixel_values=1x3x512x512.")
        if name in out:
            raise InvalidOption(f"--inputs names {name!r} twice; give each input once.")
        out[name] = tuple(int(d) for d in dims)
    return out


def parse_max_memory(text: str) -> dict:
    """``"0=20GiB,1=20GiB,cpu=64GiB"`` -> ``{0: "20GiB", 1: "20GiB", "cpu": "64GiB"}``, checked.

    A size of digits alone is bytes (``cpu=64`` is ``{"cpu": 64}``, with accelerate's reading and its warning).

    Raises
    ------
    InvalidBudget
        An entry that is not ``DEVICE=SIZE``, an unknown device or a malformed size.

    Examples
    --------
    >>> parse_max_memory("0=20GiB,cpu=64GiB")
    {0: '20GiB', 'cpu': '64GiB'}
    >>> parse_max_memory("gpu=1GiB")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    allocator.errors.InvalidBudget: unknown device 'gpu': use an accelerator index ...
    """
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise InvalidBudget(f"--max-memory entry {part!r} is not DEVICE=SIZE; write e.g. 0=20GiB,cpu=64GiB.")
        out[int(key) if key.isdigit() else key] = int(value) if value.isdigit() else value  # bytes, as in a dict
    for key, value in out.items():
        small_bare_number(key, value)
    if not out:
        raise InvalidBudget("--max-memory is empty; write e.g. 0=20GiB,cpu=64GiB.")
    parse_budgets(out)  # unknown devices, malformed sizes, a device named twice: before building any model
    return out


def load_profile(path: str):
    """The :class:`~allocator.Profile` stored in ``path`` by ``allocator profile --out`` (:meth:`Profile.load`)."""
    return Profile.load(path)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model built on the meta device, with where it came from."""

    model: object
    source: str
    """What was built, for the report: ``"t5-base (built-in example: ...)"`` or ``"LlamaForCausalLM from DIR"``."""
    dtype: object = None
    """The dtype ``from_pretrained`` would load the model in by default (:func:`allocator.model.checkpoint.load_dtype`;
    a built-in example's published dtype, :func:`allocator.model.zoo.dtype`), used when ``--dtype`` is not given."""
    dtype_reason: str = ""
    """Why that dtype: ``"the config's dtype, as from_pretrained loads it"``."""
    quantization: object = None
    """How the config's ``quantization_config`` stores the weights
    (:class:`allocator.model.quantization.QuantizedSizes`),
    or ``None`` for an unquantized model."""


def load_model(source: str, *, trust_remote_code: bool = False) -> LoadedModel:
    """Build ``source`` on the meta device: a folder with ``config.json``, a config file, or a built-in example.

    A path that exists wins over an example of the same name. The class is the first of ``config.architectures``
    that transformers defines, else ``transformers.AutoModel``. Nothing is downloaded. A config whose ``auto_map``
    names code of its own is built with that code only with ``trust_remote_code`` (passed to transformers, so it
    never asks on the terminal); without it, transformers' own classes are used where it has them.

    Raises
    ------
    InvalidModel
        No such folder, file or example; no ``config.json`` in the folder; transformers cannot read the config
        or build the model from it; or the config needs its own code and ``trust_remote_code`` is not set.
    """
    if os.path.exists(source):
        return _from_config(source, trust_remote_code)
    if source in zoo.ZOO:
        import torch

        entry = zoo.ZOO[source]
        return LoadedModel(zoo.build(source), f"{source} (built-in example: {entry.description})",
                           getattr(torch, zoo.dtype(source)),
                           "the published checkpoint's dtype, as from_pretrained loads it")
    hint = (" This command never downloads: fetch the config first, e.g. "
            f"'hf download {source} config.json --local-dir DIR', and pass DIR.") if _HUB_ID.match(source) else ""
    raise InvalidModel(f"{source!r} is neither a model folder, a config.json, nor a built-in example "
                       f"(see 'allocator plan --list').{did_you_mean(source)}{hint}")


def did_you_mean(name: str) -> str:
    """`` Did you mean 'llama-8b'?`` for a name close to built-in examples (difflib), else ``""``.

    >>> did_you_mean("llama8b")
    " Did you mean 'llama-8b'?"
    >>> did_you_mean("./my-model")
    ''
    """
    lowered = {n.lower(): n for n in zoo.ZOO}
    close = difflib.get_close_matches(name.lower(), lowered, n=1, cutoff=0.6)
    return f" Did you mean {lowered[close[0]]!r}?" if close else ""


def _config_json(path: str) -> dict:
    """The config at ``path`` (folder or file) as a dict; ``{}`` when unreadable (transformers then says why)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as fh:
            data = json.load(fh)
    except (OSError, ValueError):  # unreadable or not JSON: transformers says so below
        return {}
    return data if isinstance(data, dict) else {}


def _auto_map(path: str) -> dict:
    """The ``auto_map`` of the config at ``path`` (folder or file): auto class -> custom code; ``{}`` when none."""
    found = _config_json(path).get("auto_map")
    return found if isinstance(found, dict) else {}


def _custom_class(auto_map: Mapping, declared: list[str]):
    """The transformers auto class (``AutoModelForCausalLM``, ...) whose custom code is the declared architecture,
    else the first model auto class the map names, else ``AutoModel``."""
    import transformers

    models = [k for k in auto_map if k.startswith("AutoModel") and isinstance(getattr(transformers, k, None), type)]
    named = [k for k in models if isinstance(auto_map[k], str) and auto_map[k].rpartition(".")[2] in declared]
    return getattr(transformers, (named or models or ["AutoModel"])[0])


def _from_config(path: str, trust_remote_code: bool = False) -> LoadedModel:
    import torch

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise InvalidModel(f"folder {path} has no config.json; pass a model folder saved by save_pretrained, "
                           f"a config.json, or a built-in example.")
    try:
        import transformers
    except ImportError:
        raise InvalidModel("building a model from a config needs transformers: pip install 'allocator[hf]'.") from None
    auto_map = _auto_map(path)
    custom = bool(auto_map) and trust_remote_code
    where = path
    if custom and os.path.isfile(path):  # transformers finds the code beside config.json only given the folder
        if os.path.basename(path) != "config.json":
            raise InvalidModel(f"--trust-remote-code needs the model folder (its config.json and code), not {path}.")
        where = os.path.dirname(os.path.abspath(path))
    with quiet_transformers():
        try:
            config = transformers.AutoConfig.from_pretrained(where, local_files_only=True,
                                                             trust_remote_code=trust_remote_code)
        except Exception as err:  # a config's own checks raise anything (ZeroDivisionError for 0 heads, ...)
            if auto_map and not trust_remote_code and "trust_remote_code" in str(err):
                raise InvalidModel(
                    f"the config {path} needs its own code (auto_map: {', '.join(auto_map)}), which transformers "
                    f"runs only when asked: add --trust-remote-code if you trust the code in that folder.") from None
            raise InvalidModel(f"transformers cannot read the config {path}: "
                               f"{type(err).__name__}: {_one_line(err)}") from None
        declared = list(getattr(config, "architectures", None) or [])
        cls = next((c for c in (getattr(transformers, name, None) for name in declared)
                    if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)), None)
        auto = _custom_class(auto_map, declared) if custom else None
        name = (f"{auto.__name__} with the folder's code" if auto else cls.__name__ if cls
                else f"AutoModel for {type(config).__name__}")
        try:
            with torch.device("meta"):
                if auto is not None:
                    model = auto.from_config(config, trust_remote_code=True)
                else:
                    model = cls(config) if cls else transformers.AutoModel.from_config(config)
        except Exception as err:  # anything the model's constructor raises is a config it cannot build
            raise InvalidModel(f"transformers cannot build {name} from {path}: "
                               f"{type(err).__name__}: {_one_line(err)}") from None
    move_strays_to_meta(model)
    model.eval()
    # config.dtype: transformers >= 5 (reading the old torch_dtype alias logs a warning)
    dtype, why = load_dtype(path, getattr(config, "dtype", None), _config_json(path))
    with quiet_transformers():  # transformers' quantization config classes log about their defaults
        quantization = _quantization(model, config)
    if auto is not None:
        note = " (the folder's own code, --trust-remote-code)"
    elif cls:
        note = ""
    else:
        note = f" (config.architectures {'names no class transformers defines' if declared else 'is empty'})"
    if auto_map and not custom:
        note += (" (config.auto_map names custom code; built with transformers' own classes: add "
                 "--trust-remote-code to use the folder's code)")
    return LoadedModel(model, f"{type(model).__name__} from {path}{note}", dtype, why, quantization)


def _quantization(model, config):
    """The sizes under the config's ``quantization_config`` (where transformers' ``get_hf_quantizer`` looks: the
    config, else its text config), or ``None``.

    Raises
    ------
    InvalidOption
        A method whose storage is not modelled, or unknown (never a silent full-size plan).
    """
    found = getattr(config, "quantization_config", None)
    if found is None and hasattr(config, "get_text_config"):
        found = getattr(config.get_text_config(decoder=True), "quantization_config", None)
    return quantized_sizes(model, found) if found is not None else None


def _check_writable(path: str | None, flag: str) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InvalidOption(f"{flag} {path}: folder {folder} does not exist.")


# -- reports ---------------------------------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    """Bytes in binary units with one decimal (:func:`~allocator.budgets.format_bytes`); ``None`` is no limit.

    >>> _size(0), _size(1536), _size(3 * 2**30), _size(None)
    ('0 B', '1.5 KiB', '3.0 GiB', 'unlimited')
    """
    return "unlimited" if n is None else format_bytes(n, decimals=1, largest="TiB")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds * 1e3:,.0f} ms"


def _devices(*plans) -> list:
    """Devices with a budget or holding something, in the budgets' order."""
    order = plans[0].problem.budgets.order
    return [d for d in order
            if any(d in p.problem.budgets.limits or p.resident(d) or p.peak.get(d) for p in plans)]


def _streamed_from(result, device) -> int:
    """Bytes copied from ``device`` to the main device per forward."""
    if device == "disk":
        return result.cost.disk_bytes
    if device == "cpu":
        return result.cost.streamed_bytes - result.cost.disk_bytes
    return 0


def _headline(result) -> str:
    proof = {None: "", True: ", proven optimal", False: ", not proven optimal"}[result.optimal]
    return (f"strategy {result.strategy}{proof}; main device {result.main_device!r}; estimated "
            f"{_ms(result.cost.seconds)} per forward, {_size(result.cost.streamed_bytes)} streamed per forward, "
            f"{result.cost.device_changes} device changes")


def device_table(result) -> str:
    """One row per device: budget, resident bytes (and share of the model), bytes streamed from it per forward,
    the streaming reserve, the peak and its share of the budget; then the strategy, estimate and violations."""
    total = result.problem.graph.total
    header = ("device", "budget", "resident", "of model", "streamed/fwd", "reserve", "peak", "of budget")
    rows = [header]
    for d in _devices(result):
        limit = result.problem.budgets.limit(d)
        peak = result.peak.get(d, 0)
        rows.append((
            str(d), _size(limit), _size(result.resident(d)), f"{result.resident(d) / total:.1%}" if total else "-",
            _size(_streamed_from(result, d)), _size(result.streamed if d == result.main_device else 0),
            _size(peak), f"{peak / limit:.0%}" if limit else "-",
        ))
    lines = _align(rows)
    lines.append(_headline(result))
    lines += [f"VIOLATION {v}" for v in result.violations]
    return "\n".join(lines)


def generation_table(result) -> str:
    """With a generation budget, what each device's peak is made of (``Plan.parts``): weights (with the buffers of
    offloaded modules and the streaming reserve), KV cache, logits and activations; ``""`` without one."""
    needs = result.problem.generation
    if needs is None:
        return ""
    rows = [("device", "weights", "cache", "logits", "activations", "peak", "of budget")]
    for d in _devices(result):
        limit = result.problem.budgets.limit(d)
        parts, peak = result.parts.get(d, {}), result.peak.get(d, 0)
        rows.append((str(d), *(_size(parts.get(k, 0)) for k in ("weights", "cache", "logits", "activations")),
                     _size(peak), f"{peak / limit:.0%}" if limit else "-"))
    title = (f"{needs.notes[0] if needs.notes else 'generate'}: the parts of each peak (weights with the buffers of "
             "offloaded modules and the streaming reserve)")
    return "\n".join([title, *_align(rows)])


def _align(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def compare_text(ours, theirs, *, violations: bool = True) -> str:
    """What ``ours`` changes against accelerate's plan ``theirs``: resident bytes on the fastest tier, estimated
    time per forward, and (with ``violations``) the rules accelerate's map breaks when it is invalid."""
    total = ours.problem.graph.total
    fast = "accelerators" if ours.problem.budgets.accelerators else "RAM; no accelerator"
    a, o = theirs.cost.resident_fast, ours.cost.resident_fast
    lines = [f"resident on the fastest tier ({fast}): accelerate {_size(a)} ({a / total:.1%}) -> allocator "
             f"{_size(o)} ({o / total:.1%}), {'+' if o >= a else '-'}{_size(abs(o - a))}"]
    ratio = theirs.cost.seconds / ours.cost.seconds if ours.cost.seconds else float("inf")
    verdict = (f"{ratio:.2f}x faster" if ratio > 1.005 else f"{1 / ratio:.2f}x slower" if ratio < 0.995
               else "the same")
    lines.append(f"estimated time per forward: accelerate {_ms(theirs.cost.seconds)} -> allocator "
                 f"{_ms(ours.cost.seconds)} ({verdict})")
    if theirs.violations:
        lines.append(f"accelerate's map is INVALID: it breaks {len(theirs.violations)} runtime rule(s) "
                     f"(it would fail or run out of memory){':' if violations else ', listed above.'}")
        lines += [f"  {v}" for v in theirs.violations] if violations else []
    else:
        lines.append("accelerate's map is valid.")
    if ours.device_map == theirs.device_map:
        lines.append("Both plans are the same device map.")
    return "\n".join(lines)


def side_by_side(ours, theirs) -> str:
    """accelerate's plan and ours in one table: resident and peak bytes per device, then the estimate."""
    rows = [("", "", "accelerate", "", f"allocator {ours.strategy}", ""),
            ("device", "budget", "resident", "peak", "resident", "peak")]
    for d in _devices(ours, theirs):
        limit = ours.problem.budgets.limit(d)

        def peak(p):
            value = p.peak.get(d, 0)
            return _size(value) + (f" ({value / limit:.0%})" if limit else "")

        rows.append((str(d), _size(limit), _size(theirs.resident(d)), peak(theirs),
                     _size(ours.resident(d)), peak(ours)))
    rows.append(("est. forward", "", "", _ms(theirs.cost.seconds), "", _ms(ours.cost.seconds)))
    rows.append(("valid", "", "", "no" if theirs.violations else "yes", "", "no" if ours.violations else "yes"))
    return "\n".join(_align(rows))


def plot_plans(plans: Mapping[str, object], path: str, *, title: str | None = None):
    """A PNG bar chart of bytes per device for each labelled plan: resident bytes, the streaming reserve stacked
    on the main device, and each device's budget as a black line.

    Each bar says what its percentages are of: inside (or just above a short bar) the share *of the model* resident
    on the device, above it the device's peak as a share *of its budget*. A label that would cross its device's
    budget line is lifted above the line. Needs matplotlib; uses its Agg canvas, so no display and no global pyplot
    state. Returns the matplotlib ``Figure`` written to ``path``.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise InvalidOption("--plot needs matplotlib: pip install 'allocator[plot]'.") from None
    items = list(plans.items())
    first = items[0][1]
    budgets = first.problem.budgets
    devices = _devices(*(p for _, p in items))
    scale, unit = next(((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
                        if first.problem.graph.total >= 4 * s), (1, "B"))

    def stack(p, d):  # (resident, streaming reserve) in plot units
        return p.resident(d) / scale, (p.streamed if d == p.main_device else 0) / scale

    tallest = max(sum(stack(p, d)) for _, p in items for d in devices)
    limits = {j: budgets.limit(d) / scale for j, d in enumerate(devices) if budgets.limit(d) is not None}
    top = 1.3 * max([tallest] + [b for b in limits.values() if b <= 2 * tallest]) or 1.0
    shown = {j: b for j, b in limits.items() if b <= top}
    line = 0.05 * top  # the height of one line of a label, in plot units (8 pt on a 4.2 in figure)

    fig = Figure(figsize=(max(7.0, 3.2 + 1.3 * len(devices) * len(items)), 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(items)
    colors = ["#c44e52", "#4c72b0", "#55a868", "#8172b2", "#ccb974"]
    for i, (label, p) in enumerate(items):
        color = colors[i % len(colors)]
        total = p.problem.graph.total
        for j, d in enumerate(devices):
            x = j - 0.4 + width * (i + 0.5)
            resident, reserve = stack(p, d)
            ax.bar(x, resident, width, color=color, label=f"{label}: resident" if j == 0 else None)
            if reserve:
                ax.bar(x, reserve, width, bottom=resident, color=color, alpha=0.35, hatch="//",
                       label=f"{label}: streaming reserve")
            above = []
            share = f"{p.resident(d) / total:.0%}\nof model" if total else ""
            if resident >= 2.4 * line:
                ax.text(x, resident / 2, share, ha="center", va="center", fontsize=8, color="white")
            elif share:
                above.append(share.replace("\n", " "))
            if limits.get(j):
                above.append(f"peak {p.peak.get(d, 0) / (limits[j] * scale):.0%}\nof budget")
            if above:
                text = "\n".join(above)
                y = resident + reserve
                height = (text.count("\n") + 1) * line
                if j in shown and y - 0.2 * line <= shown[j] <= y + height:  # would sit on the budget line
                    y = shown[j]
                ax.annotate(text, (x, y), ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                            textcoords="offset points", linespacing=1.0)
    for j, limit in limits.items():
        if j in shown:
            ax.hlines(limit, j - 0.45, j + 0.45, colors="black", linewidth=1.5)
        else:  # a budget far above everything placed: say it rather than squash the bars
            ax.annotate(f"budget {_size(int(limit * scale))} \u2191", (j, top), ha="center", va="top", fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    if shown:
        handles, labels = handles + [Line2D([], [], color="black", linewidth=1.5)], labels + ["budget"]
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(devices)), [f"GPU {d}" if isinstance(d, int) else str(d) for d in devices])
    ax.set_ylabel(unit)
    ax.set_title(title or f"{first.problem.graph.model_class} ({_size(first.problem.graph.total)}): bytes per device",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


# -- commands --------------------------------------------------------------------------------------------------------


def _list() -> int:
    rows = [("name", "family", "what it is")] + [(n, e.family, e.description) for n, e in zoo.ZOO.items()]
    print("\n".join(_align_left(rows)))
    print("\nallocator plan NAME --max-memory 0=8GiB,cpu=64GiB   (built on the meta device; nothing is downloaded)")
    return 0


def _align_left(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _cmd_plan(args) -> int:
    if args.list:
        return _list()
    if args.source is None:
        raise InvalidOption("plan needs a SOURCE: a model folder, a config.json or a built-in example "
                            "(see 'allocator plan --list').")
    max_memory = parse_max_memory(args.max_memory) if args.max_memory is not None else None
    resolve(args.strategy)
    if args.dtype is not None:
        as_dtype(args.dtype, "--dtype")
    profile = load_profile(args.profile) if args.profile else None
    generation = parse_generation(args.generation) if args.generation is not None else None
    inputs = parse_inputs(args.inputs) if args.inputs is not None else "auto"   # PlanOptions' default
    _check_writable(args.json, "--json")
    _check_writable(args.plot, "--plot")
    loaded = load_model(args.source, trust_remote_code=args.trust_remote_code)
    dtype = args.dtype or loaded.dtype
    kept, patterns = kept_in_float32(loaded.model, dtype)  # from_pretrained's _keep_in_fp32_modules(_strict)
    options = dict(dtype=dtype, profile=profile, generation=generation, special_dtypes=kept or None, inputs=inputs,
                   optimize=args.optimize)
    if loaded.quantization is not None:
        options.update(size_fn=loaded.quantization.size_fn, hf_quantizer=loaded.quantization.hf_quantizer)
    ours = plan(loaded.model, max_memory, strategy=args.strategy, objective=args.objective, strict=True, **options)
    print(f"{loaded.source}")
    print(f"{ours.problem.graph.model_class}: {_size(ours.problem.graph.total)}"
          f"{f' in {_dtype_name(dtype)}' if dtype else ''}{f'; bandwidths from {args.profile}' if profile else ''}")
    print(_dtype_line(args.dtype, loaded) + (f"; {len(kept)} tensors kept in float32, as from_pretrained keeps "
                                             f"{', '.join(patterns)}" if kept else ""))
    if loaded.quantization is not None:
        print(_quantization_line(loaded.quantization, dtype, ours))
    if ours.problem.flops is not None:
        print(ours.compute_term())
        if len(ours.problem.steps) > 1:
            print(f"{ours.per_step()}; the plan minimises the {args.optimize}")
    if max_memory is None:
        print(f"budgets: the default, this machine's free memory now ({_budget_spec(ours.problem.budgets)}); "
              f"plan for another machine with --max-memory, e.g. 0=24GiB,cpu=64GiB")
    print()
    print(device_table(ours))
    if generation is not None:
        print()
        print(generation_table(ours))
    if args.explain:
        print()
        print(ours.explain())
    plans = {f"allocator ({ours.strategy})": ours}
    if args.compare:
        theirs = _accelerate(loaded.model, max_memory, options)
        print()
        if isinstance(theirs, AllocatorError):
            print(f"accelerate (strategy {ACCELERATE}) finds no map: {_one_line(theirs)}")
        else:
            print(f"accelerate's infer_auto_device_map (strategy {ACCELERATE}, reproduced output for output):")
            print(device_table(theirs))
            if generation is not None:
                print()
                print(generation_table(theirs))
            print()
            print(compare_text(ours, theirs, violations=False))
            plans = {"accelerate": theirs, **plans}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(ours.device_map, fh, indent=1)
        print(f"\ndevice map written to {args.json} (pass it as device_map= to from_pretrained or dispatch_model)")
    if args.plot:
        plot_plans(plans, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _dtype_line(given, loaded: LoadedModel) -> str:
    """``dtype bfloat16 (the config's dtype, as from_pretrained loads it)``: the dtype planned in, and why."""
    default = _dtype_name(loaded.dtype) if loaded.dtype is not None else None
    if given is None:
        return f"dtype {default or 'as built'} ({loaded.dtype_reason or 'each tensor as the model holds it'})"
    name = _dtype_name(as_dtype(given, "--dtype"))
    if default is None or default == name:
        return f"dtype {name} (--dtype)"
    return f"dtype {name} (--dtype; from_pretrained would load {default}: {loaded.dtype_reason})"


def _quantization_line(q, dtype, result) -> str:
    """``quantization: bitsandbytes 4-bit (nf4, double quant): 6,979,321,856 weights in 224 tensors stored in 3.4 GiB;
    not converted: lm_head; ...``: what the config's quantization_config changes, with transformers' budget margin
    and bitsandbytes' rule on offloaded modules."""
    line = (f"quantization: {q.method}: {q.quantized_elements:,} weights in {len(q.sizes)} tensors stored in "
            f"{_size(sum(q.sizes.values()))}; not converted: {', '.join(q.not_converted) or 'nothing'}; "
            f"embeddings, norms and the rest in {_dtype_name(dtype) if dtype else 'their own dtype'}")
    quantizer = q.hf_quantizer
    if quantizer is not None and hasattr(quantizer, "adjust_max_memory"):
        kept = quantizer.adjust_max_memory({0: 1000})[0] / 1000
        if kept != 1:
            line += (f"; budgets x{kept:.2f}, as transformers' {type(quantizer).__name__}.adjust_max_memory has "
                     f"from_pretrained plan")
    config = getattr(quantizer, "quantization_config", None)
    offloaded = {"cpu", "disk"} & set(result.device_map.values())
    if q.method.startswith("bitsandbytes") and offloaded and not getattr(config, "llm_int8_enable_fp32_cpu_offload",
                                                                         True):
        line += ("; note: bitsandbytes refuses a device_map with cpu or disk entries unless quantization_config has "
                 "llm_int8_enable_fp32_cpu_offload=True (and then loads those modules unquantized)")
    return line


def _budget_spec(budgets) -> str:
    """``"0=22.0GiB,cpu=62.1GiB"``: budgets as --max-memory would take them (binary units, one decimal)."""
    return ",".join(f"{d}={_size(b).replace(' ', '')}" for d, b in budgets.limits.items())


def _accelerate(model, max_memory, options):
    """accelerate's plan, or the error saying it finds none (a valid outcome to report, not a failure)."""
    try:
        return plan(model, max_memory, strategy=ACCELERATE, **options)
    except AllocatorError as err:
        return err


def _cmd_demo(args) -> int:
    resolve(args.strategy)
    if args.model not in zoo.ZOO:
        raise InvalidModel(f"unknown built-in example {args.model!r}; see 'allocator plan --list'."
                           f"{did_you_mean(args.model)}")
    model = zoo.build(args.model)
    total = build_problem(model, {"cpu": 0}).graph.total
    print(f"allocator demo: {args.model}, {_size(total)} in float32 ({zoo.ZOO[args.model].description}),")
    print("built on the meta device. accelerate's infer_auto_device_map against allocator's plan, per budget.")
    for title, shares in DEMO_SCENARIOS.items():
        budget = {d: int(total * f) for d, f in shares.items()}
        spec = ",".join(f"{d}={_size(b).replace(' ', '')}" for d, b in budget.items())
        print(f"\n== {title}   (--max-memory {spec})")
        try:
            ours = plan(model, budget, strategy=args.strategy, strict=True)
        except AllocatorError as err:
            print(f"allocator finds no map: {_one_line(err)}")
            continue
        theirs = _accelerate(model, budget, {})
        if isinstance(theirs, AllocatorError):
            print(device_table(ours))
            print(f"accelerate finds no map: {_one_line(theirs)}")
            continue
        print(side_by_side(ours, theirs))
        print(compare_text(ours, theirs))
    gpu, ram = (_size(int(f * total)).replace(" ", "") for f in (0.4, 2))
    print(f"\nNext: allocator plan {args.model} --max-memory 0={gpu},cpu={ram} --compare --plot plan.png; "
          f"allocator plan --list{'' if args.model == 'segformer-b0' else '; allocator demo --model segformer-b0'}")
    return 0


def _cmd_profile(args) -> int:
    _check_writable(args.out, "--out")
    if args.folder is not None and not os.path.isdir(args.folder):
        raise InvalidOption(f"--folder {args.folder} is not a folder; give an existing one on the disk to measure.")
    measured = Profile.measure(folder=args.folder)
    rows = [("field", "value", "")]
    for field in dataclasses.fields(Profile):
        if field.name == "spread":
            continue
        value = getattr(measured, field.name)
        spread = measured.spread.get(field.name)
        rows.append((field.name, _quantity(field.name, value),
                     "default" if spread is None else f"measured, spread {spread:.0%}"))
    print("\n".join(_align(rows)))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(measured.to_dict(), fh, indent=1)
        print(f"\nprofile written to {args.out}; use it with: allocator plan SOURCE --profile {args.out}")
    return 0


def _quantity(name: str, value: float) -> str:
    """A Profile field with its unit: latencies (seconds) in µs or ms, bandwidths in GB/s.

    >>> _quantity("host_to_device", 1e10), _quantity("switch_latency", 2e-5), _quantity("tokens", 512)
    ('10.0 GB/s', '20.0 µs', '512')
    >>> _quantity("offload_tensor_latency", 6.6e-5), _quantity("disk_tensor_latency", 2.86e-3)
    ('66.0 µs', '2.86 ms')
    >>> _quantity("cpu_flops", 9.2e10), _quantity("cpu_op_latency", 1.9e-6)
    ('92.0 GFLOP/s', '1.9 µs')
    """
    if name.endswith("flops"):
        return f"{value / 1e9:.1f} GFLOP/s"
    if name.endswith("latency"):
        return f"{value * 1e6:.1f} µs" if value < 1e-3 else f"{value * 1e3:.2f} ms"
    if name == "activation_bytes":
        return _size(int(value))
    if name == "tokens":
        return f"{value:g}"
    return f"{value / 1e9:.1f} GB/s"


def _parser() -> argparse.ArgumentParser:
    strategies = ", ".join(STRATEGIES)
    parser = _Parser(prog="allocator", description="Plan where each part of a model lives: accelerators, RAM, disk.")
    parser.add_argument("--version", action="version", version=f"allocator {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,demo,profile}")
    p = sub.add_parser("plan", help="plan a model folder, a config.json or a built-in example",
                       description="Plan a model built on the meta device from its config (nothing is downloaded).")
    p.add_argument("source", nargs="?", help="a folder with config.json, a config.json, or a built-in example name")
    p.add_argument("--list", action="store_true", help="list the built-in examples and exit")
    p.add_argument("--max-memory", metavar="DEV=SIZE,...",
                   help="budgets, e.g. 0=20GiB,1=20GiB,cpu=64GiB (default: what this machine has)")
    p.add_argument("--dtype", help="dtype the weights will be loaded in, e.g. bfloat16 (default: the config's)")
    p.add_argument("--strategy", default="auto", metavar="NAME", help=f"one of {strategies} (default: auto)")
    p.add_argument("--objective", default="contract", choices=["contract", "latency"],
                   help="contract (default): GPU 0 first, accelerators in index order, never below accelerate; "
                        "latency: the cost model's estimate alone decides (the CPU may run the model)")
    p.add_argument("--compare", action="store_true", help="also plan with accelerate's algorithm and compare")
    p.add_argument("--explain", action="store_true",
                   help="print why: the main device, what each device holds and why not more, the budget that bound, "
                        "the streaming reserve, the candidate kept and its margin; then the strategy's decisions")
    p.add_argument("--json", metavar="FILE", help="write the device map as JSON")
    p.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of bytes per device")
    p.add_argument("--profile", metavar="FILE", help="bandwidths written by 'allocator profile --out FILE'")
    p.add_argument("--inputs", metavar="NAME=DIMxDIM,...",
                   help="shapes of one forward, e.g. input_ids=1x512 or pixel_values=1x3x512x512, or 'default' (the "
                        "config's): FLOPs, ops and activations are counted on the meta device for the cost model")
    p.add_argument("--optimize", default="prefill", choices=["prefill", "decode"],
                   help="the forward objectives price: prefill (default, one forward at --inputs) or decode (one "
                        "decoding step: needs --inputs and --generation)")
    p.add_argument("--generation", metavar="BATCH,MAX_LENGTH[,PROMPT]",
                   help="keep room for generate: KV cache, logits and activations (allocator.GenerationBudget)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the model folder's own code, for a config whose auto_map names it")
    d = sub.add_parser("demo", help="accelerate vs allocator on a built-in example under three budgets")
    d.add_argument("--model", default="t5-base", help="a built-in example (default: t5-base)")
    d.add_argument("--strategy", default="auto", metavar="NAME", help=f"one of {strategies} (default: auto)")
    f = sub.add_parser("profile", help="measure this machine's bandwidths")
    f.add_argument("--out", metavar="FILE", help="write them as JSON for 'allocator plan --profile FILE'")
    f.add_argument("--folder", metavar="DIR",
                   help="where the disk test file is written (default: the temporary folder); use the disk that "
                        "will hold offloaded weights")
    return parser


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0, or 2 on bad input with one line on stderr)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    commands = {"plan": _cmd_plan, "demo": _cmd_demo, "profile": _cmd_profile}
    # The report states violations itself: keep the library's warnings about them off stderr, without touching
    # the caller's logging configuration (main also runs inside notebooks and tests).
    library = logging.getLogger("allocator")
    level = library.level
    library.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # restores showwarning after
            warnings.showwarning = functools.partial(_show_warning, set())
            code = commands[args.command](args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (AllocatorError, OSError) as err:  # every AllocatorError is a ValueError; typed and worded for users
        return _fail(str(err))
    except KeyboardInterrupt:
        print("allocator: interrupted", file=sys.stderr)
        return 130
    finally:
        library.setLevel(level)


def _show_warning(shown: set, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, like the errors (``allocator: warning: max_memory['cpu'] = 64 is read as 64 bytes...``),
    once per command: budgets are read twice (checked before the model is built, then planned)."""
    text = f"allocator: warning: {_one_line(message, 10 * _MAX_MESSAGE)}"
    if text not in shown:
        shown.add(text)
        print(text, file=sys.stderr)


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``allocator plan ... | head -3``): stop quietly, with status 0.

    What is still buffered would fail again when the interpreter flushes stdout at exit (printing "Exception ignored
    ... BrokenPipeError" on stderr), so stdout is pointed at the null device first, as the Python docs advise.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a notebook's, a test's)
        pass
    return 0
