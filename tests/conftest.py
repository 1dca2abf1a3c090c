import logging
import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet_accelerate():
    # accelerate warns "Device 0 is not available" when planning for GPUs on this CPU-only host.
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def quiet():
    """transformers' progress bars and accelerate's warnings silenced for a module's end-to-end loads."""
    from models import quiet_hf

    with quiet_hf():
        yield
