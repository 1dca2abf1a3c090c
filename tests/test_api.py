"""The public entry points' user-facing surface: ``repr(Plan)`` and ``infer_auto_device_map(verbose=True)``."""

from __future__ import annotations

import functools
import logging

import pytest

import allocator
from allocator.model import zoo
from allocator.evaluate.validate import format_bytes


@functools.cache
def _segformer():
    model = zoo.build("segformer-b0")
    return model, allocator.build_problem(model, {"cpu": 0}).graph.total


def test_plan_repr_is_one_short_line():
    model, total = _segformer()
    p = allocator.plan(model, {0: int(0.6 * total), "cpu": 2 * total})
    text = repr(p)
    assert "\n" not in text and len(text) < 300, text  # the dataclass repr of the whole Problem ran to 11-16k
    assert text.startswith(f"<Plan {p.strategy} for SegformerForSemanticSegmentation: main device 0, "
                           f"estimated {p.cost.seconds * 1e3:.3f} ms per forward, valid; ")
    assert (f"0: resident {format_bytes(p.resident(0))}, peak {format_bytes(p.peak[0])} of "
            f"{format_bytes(int(0.6 * total))}") in text
    assert f"cpu: resident {format_bytes(p.resident('cpu'))}" in text
    assert str(p) == text


def test_plan_repr_counts_violations():
    model, total = _segformer()
    p = allocator.plan(model, {0: int(0.15 * total), 1: int(0.15 * total), "cpu": 2 * total}, strategy="sequential")
    assert p.violations and f"{len(p.violations)} violation(s)" in repr(p)


# -- infer_auto_device_map(verbose=True) --------------------------------------------------------------------------

VERBOSE = """
import logging, sys
import torch.nn as nn
import allocator
{setup}
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
quiet = allocator.infer_auto_device_map(model, {{0: "20KiB", "cpu": "1MiB"}})
print("--- verbose", file=sys.stderr, flush=True)
assert allocator.infer_auto_device_map(model, {{0: "20KiB", "cpu": "1MiB"}}, verbose=True) == quiet
print(quiet)
"""


def _run(setup=""):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", VERBOSE.format(setup=setup)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.subprocess
def test_verbose_prints_the_decisions_on_stderr_like_accelerate():
    """accelerate prints with verbose=True; ours log at INFO on a logger nobody configured, which showed nothing."""
    done = _run()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("{")
    quiet, verbose = done.stderr.split("--- verbose\n")
    assert quiet == ""  # without verbose: nothing
    assert "strategy auto" in verbose and "main device" in verbose and "- 0 -> " in verbose


@pytest.mark.subprocess
def test_verbose_uses_the_callers_logging_configuration_and_restores_it():
    setup = 'logging.basicConfig(stream=sys.stdout, format="LOG %(name)s %(message)s")'  # root at WARNING
    done = _run(setup)
    assert done.returncode == 0 and done.stderr == "--- verbose\n"
    assert "LOG allocator strategy auto" in done.stdout  # through the caller's handler, with its format
    import logging

    import torch.nn as nn

    logger = logging.getLogger("allocator")
    handlers, level = list(logger.handlers), logger.level
    allocator.infer_auto_device_map(nn.Linear(4, 4), {"cpu": "1MiB"}, verbose=True)
    assert logger.handlers == handlers and logger.level == level


def test_verbose_records_reach_caplog(caplog):
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert logging.getLogger("allocator").getEffectiveLevel() > logging.INFO  # root at WARNING: INFO dropped
    allocator.infer_auto_device_map(model, {"cpu": "1MiB"})
    assert not any("strategy auto" in r.getMessage() for r in caplog.records)
    allocator.infer_auto_device_map(model, {"cpu": "1MiB"}, verbose=True)
    assert any("strategy auto" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
