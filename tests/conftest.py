import logging
import os
import warnings

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run, so CI is reproducible and a failure recurs until fixed.
# `pytest --hypothesis-profile=explore` draws fresh ones.
settings.register_profile("default", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("default")


def pytest_configure(config):
    """``ALLOCATOR_TEST_THREADS=n`` runs the suite's in-process torch work on ``n`` threads (``torch.set_num_threads``):
    outputs of two code paths are compared within float tolerance, so results must hold on 1 thread and on 2
    (``ALLOCATOR_TEST_THREADS=1 pytest ...``).

    Unset, a pytest-xdist worker (``make test`` runs ``-n 2``) uses 1 thread, and so do the processes its tests start
    (``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, where the caller did not set them): two workers of torch's default
    thread count on a 2-core machine spin on each other's cores, and small forwards then run many times slower. A run
    without workers keeps torch's own default."""
    threads = os.environ.get("ALLOCATOR_TEST_THREADS")
    if not threads and os.environ.get("PYTEST_XDIST_WORKER"):
        threads = "1"
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


@pytest.fixture(autouse=True)
def _quiet_accelerate():
    # accelerate warns "Device 0 is not available" when planning for GPUs on this CPU-only host.
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(autouse=True)
def _budget_warnings_unsaid(monkeypatch):
    """A budget's warning is given once per process (``allocator.budgets``): each test starts with none given, so a
    test that expects one does not depend on which tests ran before it."""
    monkeypatch.setattr("allocator.budgets._warned", set())


@pytest.fixture(autouse=True)
def _planned_accelerators(request, monkeypatch):
    """Tests plan GPU budgets on machines without those GPUs (the maps are captured where transformers computes them,
    before anything is loaded): under ``allocator.patch()`` every accelerator in ``max_memory`` counts as present at
    load time, unless the test is marked ``load_time_devices`` (it then sees this machine's real accelerators)."""
    if request.node.get_closest_marker("load_time_devices") is None:
        monkeypatch.setattr("allocator.integrations.transformers.present_budgets", dict)
    yield


@pytest.fixture(scope="module")
def quiet():
    """transformers' progress bars and accelerate's warnings silenced for a module's end-to-end loads."""
    from models import quiet_hf

    with quiet_hf():
        yield
