"""What the command line prints: device tables, the parts of each peak under a generation budget, the comparison
with accelerate (as text, side by side, or as a PNG bar chart). Text is rendered here from the plan's data; nothing
is computed again."""

from __future__ import annotations

from collections.abc import Mapping

from ..budgets import format_bytes, format_ms
from ..errors import InvalidOption
from ..model import as_dtype
from ..model.load import LoadedModel
from ..report.explain import reasons

__all__ = ["format_size", "format_time", "dtype_name", "empty_accelerators", "device_table", "generation_table",
           "align", "align_left", "compare_text", "side_by_side", "dtype_line", "quantization_line", "budget_spec",
           "quantity", "plot_plans"]


def format_size(n: int | None) -> str:
    """Bytes in binary units with one decimal (:func:`~allocator.budgets.format_bytes`); ``None`` is no limit.

    >>> format_size(0), format_size(1536), format_size(3 * 2**30), format_size(None)
    ('0 B', '1.5 KiB', '3.0 GiB', 'unlimited')
    """
    return "unlimited" if n is None else format_bytes(n, decimals=1, largest="TiB")


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


format_time = format_ms
"""Seconds as milliseconds with three decimals (:func:`allocator.budgets.format_ms`), the one format of every estimate
the package prints (``Plan.explain``, ``repr(plan)``, the CLI): ``format_time(4.5754)`` is ``'4575.400 ms'``."""


def empty_accelerators(result) -> list[str]:
    """One line per accelerator with a budget that holds nothing, saying why: the sentence of the plan's own
    explanation (:func:`allocator.report.explain.reasons`), not derived again."""
    accelerators = [d for d in result.problem.budgets.accelerators if not result.resident(d)]
    if not accelerators:
        return []
    empty = reasons(result).empty
    return [f"{d!r} is empty: " + (empty[d][1] or empty[d][0] if d in empty else "nothing was placed on it")
            for d in accelerators]


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
    per = result.priced_phrase()
    return (f"strategy {result.strategy}{proof}; main device {result.main_device!r}; estimated "
            f"{format_time(result.cost.seconds)} {per}, {format_size(result.cost.streamed_bytes)} streamed {per}, "
            f"{result.cost.device_changes} device changes")


def device_table(result) -> str:
    """One row per device: budget, resident bytes (and share of the model), bytes streamed from it per forward,
    the streaming reserve (with the allocator runtime's prefetch: ``Plan.parts[d]["reserve"]``), the peak and its
    share of the budget; then the strategy, estimate and violations."""
    total = result.problem.graph.total
    header = ("device", "budget", "resident", "of model", "streamed/fwd", "reserve", "peak", "of budget")
    hybrid = bool(result.compute)   # issue #40: a plan that decides where offloaded units compute
    rows = [header + (("computes (decode)",) if hybrid else ())]
    for d in _devices(result):
        limit = result.problem.budgets.limit(d)
        peak = result.peak.get(d, 0)
        rows.append((
            str(d), format_size(limit), format_size(result.resident(d)),
            f"{result.resident(d) / total:.1%}" if total else "-",
            format_size(_streamed_from(result, d)), format_size(result.parts.get(d, {}).get("reserve", 0)),
            format_size(peak), f"{peak / limit:.0%}" if limit else "-",
        ) + ((_computes_at_decode(result, d),) if hybrid else ()))
    lines = align(rows)
    lines.append(_headline(result))
    lines += [f"VIOLATION {v}" for v in result.violations]
    return "\n".join(lines)


def _computes_at_decode(result, device) -> str:
    """Where the units living on ``device`` compute at decode (``Plan.compute``): ``"cpu 70"``, ``"0 3, cpu 5"``;
    the device itself for resident units, ``"-"`` where none live."""
    units = [u for u, d in result.device_map.items() if d == device]
    if not units:
        return "-"
    counts: dict = {}
    for u in units:
        where = result.compute.get(u, {}).get("decode", device)
        counts[str(where)] = counts.get(str(where), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def generation_table(result) -> str:
    """With a generation budget, what each device's peak is made of (``Plan.parts``, :data:`allocator.judge.verdict.
    PARTS`): the weights (with the buffers of offloaded modules), what the runtime holds (streaming reserve, resident
    experts, expert cache, fetch buffers), KV cache, logits and activations; ``""`` without one."""
    needs = result.problem.generation
    if needs is None:
        return ""
    rows = [("device", "weights", "runtime", "cache", "logits", "activations", "peak", "of budget")]
    for d in _devices(result):
        limit = result.problem.budgets.limit(d)
        parts, peak = result.parts.get(d, {}), result.peak.get(d, 0)
        runtime = sum(parts.get(k, 0) for k in ("experts", "expert_cache", "fetch", "reserve"))
        rows.append((str(d), format_size(parts.get("weights", 0)), format_size(runtime),
                     *(format_size(parts.get(k, 0)) for k in ("cache", "logits", "activations")),
                     format_size(peak), f"{peak / limit:.0%}" if limit else "-"))
    title = (f"{needs.notes[0] if needs.notes else 'generate'}: the parts of each peak (runtime: the streaming "
             "reserve, resident experts, expert cache and fetch buffers); estimates")
    return "\n".join([title, *align(rows)])


def align(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def align_left(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def compare_text(ours, theirs, *, violations: bool = True) -> str:
    """What ``ours`` changes against accelerate's plan ``theirs``: resident bytes on the fastest tier, estimated
    time per forward, and (with ``violations``) the rules accelerate's map breaks when it is invalid."""
    total = ours.problem.graph.total
    fast = "accelerators" if ours.problem.budgets.accelerators else "RAM; no accelerator"
    a, o = theirs.cost.resident_fast, ours.cost.resident_fast
    lines = [f"resident on the fastest tier ({fast}): accelerate {format_size(a)} ({a / total:.1%}) -> allocator "
             f"{format_size(o)} ({o / total:.1%}), {'+' if o >= a else '-'}{format_size(abs(o - a))}"]
    ratio = theirs.cost.seconds / ours.cost.seconds if ours.cost.seconds else float("inf")
    verdict = (f"{ratio:.2f}x faster" if ratio > 1.005 else f"{1 / ratio:.2f}x slower" if ratio < 0.995
               else "the same")
    lines.append(f"estimated time per forward: accelerate {format_time(theirs.cost.seconds)} -> allocator "
                 f"{format_time(ours.cost.seconds)} ({verdict})")
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
            return format_size(value) + (f" ({value / limit:.0%})" if limit else "")

        rows.append((str(d), format_size(limit), format_size(theirs.resident(d)), peak(theirs),
                     format_size(ours.resident(d)), peak(ours)))
    rows.append(("est. forward", "", "", format_time(theirs.cost.seconds), "", format_time(ours.cost.seconds)))
    rows.append(("valid", "", "", "no" if theirs.violations else "yes", "", "no" if ours.violations else "yes"))
    return "\n".join(align(rows))


def dtype_line(given, loaded: LoadedModel) -> str:
    """``dtype bfloat16 (the config's dtype, as from_pretrained loads it)``: the dtype planned in, and why."""
    default = dtype_name(loaded.dtype) if loaded.dtype is not None else None
    if given is None:
        return f"dtype {default or 'as built'} ({loaded.dtype_reason or 'each tensor as the model holds it'})"
    name = dtype_name(as_dtype(given, "--dtype"))
    if default is None or default == name:
        return f"dtype {name} (--dtype)"
    return f"dtype {name} (--dtype; from_pretrained would load {default}: {loaded.dtype_reason})"


def quantization_line(q, dtype, result) -> str:
    """``quantization: bitsandbytes 4-bit (nf4, double quant): 6,979,321,856 weights in 224 tensors stored in 3.4 GiB;
    not converted: lm_head; ...``: what the config's quantization_config changes, with transformers' budget margin
    and bitsandbytes' rule on offloaded modules."""
    line = (f"quantization: {q.method}: {q.quantized_elements:,} weights in {len(q.sizes)} tensors stored in "
            f"{format_size(sum(q.sizes.values()))}; not converted: {', '.join(q.not_converted) or 'nothing'}; "
            f"embeddings, norms and the rest in {dtype_name(dtype) if dtype else 'their own dtype'}")
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


def budget_spec(budgets) -> str:
    """``"0=22.0GiB,cpu=62.1GiB"``: budgets as --max-memory would take them (binary units, one decimal)."""
    return ",".join(f"{d}={format_size(b).replace(' ', '')}" for d, b in budgets.limits.items())


def quantity(name: str, value: float) -> str:
    """A Profile field with its unit: latencies (seconds) in µs or ms, bandwidths in GB/s.

    >>> quantity("host_to_device", 1e10), quantity("switch_latency", 2e-5), quantity("tokens", 512)
    ('10.0 GB/s', '20.0 µs', '512')
    >>> quantity("offload_tensor_latency", 6.6e-5), quantity("disk_tensor_latency", 2.86e-3)
    ('66.0 µs', '2.86 ms')
    >>> quantity("cpu_flops", 9.2e10), quantity("cpu_op_latency", 1.9e-6)
    ('92.0 GFLOP/s', '1.9 µs')
    """
    if name.endswith("flops"):
        return f"{value / 1e9:.1f} GFLOP/s"
    if name.endswith("latency"):
        return f"{value * 1e6:.1f} µs" if value < 1e-3 else f"{value * 1e3:.2f} ms"
    if name == "activation_bytes":
        return format_size(int(value))
    if name == "tokens":
        return f"{value:g}"
    return f"{value / 1e9:.1f} GB/s"


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
            ax.annotate(f"budget {format_size(int(limit * scale))} \u2191", (j, top), ha="center", va="top", fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    if shown:
        handles, labels = handles + [Line2D([], [], color="black", linewidth=1.5)], labels + ["budget"]
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(devices)), [f"GPU {d}" if isinstance(d, int) else str(d) for d in devices])
    ax.set_ylabel(unit)
    graph = first.problem.graph
    ax.set_title(title or f"{graph.model_class} ({format_size(graph.total)}): bytes per device", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig
