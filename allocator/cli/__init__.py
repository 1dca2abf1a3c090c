"""Command line: ``allocator plan``, ``allocator fit``, ``allocator demo``, ``allocator profile`` and
``allocator profile-experts`` (:mod:`allocator.cli.main` holds the parser; see its notes for the commands and their
options).

- :mod:`~allocator.cli.arguments`: the parsers of ``--max-memory``, ``--generation``, ``--inputs``, ``--dtype``;
- :mod:`~allocator.cli.render`: device tables, the comparison with accelerate, plots;
- :mod:`~allocator.cli.moe`: what ``plan --runtime allocator`` prints: the runtime, the experts per layer, the
  every-token parts;
- :mod:`~allocator.cli.commands`: one function per command;
- :mod:`~allocator.cli.record`: ``allocator profile-experts`` (the one command that loads weights);
- :mod:`~allocator.cli.main`: the argparse parser and :func:`main`.

Models are built by :func:`allocator.model.load.load_model` (library code: a folder, a ``config.json`` or a built-in
example, on the meta device).
"""

from ..model.load import LoadedModel, load_model
from .arguments import load_profile, parse_generation, parse_inputs, parse_max_memory
from .commands import BASELINE, DEMO_SCENARIOS
from .main import main
from .render import compare_text, device_table, format_size, format_time, generation_table, plot_plans, side_by_side

__all__ = ["main", "parse_max_memory", "parse_inputs", "parse_generation", "LoadedModel", "load_model",
           "load_profile", "device_table", "generation_table", "compare_text", "side_by_side", "plot_plans",
           "DEMO_SCENARIOS", "BASELINE", "format_size", "format_time"]

_size = format_size   # the names the tests and benchmarks used before the split
_ms = format_time
