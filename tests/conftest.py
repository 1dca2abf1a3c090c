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
