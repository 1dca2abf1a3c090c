"""Budget scenarios as fractions of a model's size (one GPU, two GPUs, RAM only)."""

SCENARIOS = {
    "gpu30": {0: 0.30, "cpu": 0.50},
    "gpu50": {0: 0.50, "cpu": 0.30},
    "gpu90": {0: 0.90, "cpu": 1.00},
    "gpu60-ram2x": {0: 0.60, "cpu": 2.00},
    "2gpu30": {0: 0.15, 1: 0.15, "cpu": 0.50},
    "2gpu90": {0: 0.45, 1: 0.45, "cpu": 0.20},
    "ram50": {"cpu": 0.50},
}


def budget(total: int, scenario: str) -> dict:
    return {d: int(total * f) for d, f in SCENARIOS[scenario].items()}
