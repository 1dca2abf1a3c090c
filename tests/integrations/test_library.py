"""What every integration needs of a library (:mod:`allocator.integrations.library`): here, that a failure of the
library's own planner is said on one line (issue #48), its error named in one sentence."""

from __future__ import annotations

import logging

import torch

from allocator.integrations.library import baseline_map


def test_a_failing_baseline_planner_is_logged_on_one_line(caplog):
    def theirs():
        raise ValueError("Couldn't plan it from one of:\n(1) a map,\n(2) a budget.\nGive it more memory.")

    with caplog.at_level(logging.INFO, logger="allocator"):
        assert baseline_map(theirs, torch.nn.Linear(2, 2), "their planner") is None
    assert [r.getMessage() for r in caplog.records] == [
        "their planner fails for Linear (ValueError: Couldn't plan it from one of: ... Give it more memory): planning "
        "without its map as the floor"]
