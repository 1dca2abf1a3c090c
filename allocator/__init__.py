"""allocator: decide where each part of a PyTorch model lives (accelerators, CPU RAM, disk).

>>> import allocator, torch.nn as nn
>>> allocator.plan(nn.Linear(4, 4), {"cpu": 1000}).device_map
{'': 'cpu'}
"""

from .api import Plan, infer_auto_device_map, plan
from .budgets import parse_budgets, parse_size
from .cost import Cost, estimate
from .cost_profile import Profile
from .errors import (
    AllocatorError,
    BrokenContract,
    InfeasiblePlacement,
    InvalidBudget,
    InvalidDeviceMap,
    InvalidModel,
    InvalidOption,
    InvalidPlacement,
    InvalidRuntime,
    UnsupportedByAccelerate,
)
from .generation import GenerationBudget
from . import offload
from .hf import patch, unpatch
from .placement import Placement
from .problem import Options, PlanOptions, Problem, build_problem
from .strategies import STRATEGIES
from .strategies.contract import contract_violations
from .validate import Violation, validate

__all__ = [
    "AllocatorError", "BrokenContract", "InfeasiblePlacement", "InvalidBudget", "InvalidDeviceMap", "InvalidModel",
    "InvalidOption", "InvalidPlacement", "InvalidRuntime", "UnsupportedByAccelerate", "Cost", "GenerationBudget",
    "Profile",
    "estimate", "Options", "PlanOptions", "Placement", "Plan", "Problem", "STRATEGIES", "Violation", "build_problem",
    "contract_violations",
    "infer_auto_device_map", "offload", "patch", "unpatch", "parse_budgets", "parse_size", "plan", "validate",
]
__version__ = "0.1.0"
