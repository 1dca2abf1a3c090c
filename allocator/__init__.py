"""allocator: decide where each part of a PyTorch model lives (accelerators, CPU RAM, disk).

>>> import allocator, torch.nn as nn
>>> allocator.plan(nn.Linear(4, 4), {"cpu": 1000}).device_map
{'': 'cpu'}
"""

from .api import plan
from .fit import Fit, fit
from .integrations.accelerate import infer_auto_device_map
from .report.plan import Plan
from .budgets import parse_budgets, parse_size
from .evaluate.cost import Cost, estimate
from .profile import Profile
from .errors import (
    AllocatorError, BrokenContract, InfeasiblePlacement, InvalidBudget, InvalidDeviceMap, InvalidModel, InvalidOption,
    InvalidPlacement, InvalidRuntime, NoPlan, PlanModelMismatch, UnsupportedByAccelerate,
)
from .model.generation import GenerationBudget
from .model.expert_profile import ExpertProfile, profile_experts
from . import offload
from .integrations.plans import plan_of
from .integrations.transformers import patch, unpatch
from .pipelines import DiffusionBudget, JointPlan, PipelinePlan, plan_pipeline, plan_together
from .placement import Placement
from .problem import Options, PlanOptions, Problem, build_problem
from .strategies import STRATEGIES
from .judge.contract import contract_violations
from .evaluate.validate import Violation, validate

__all__ = [
    "AllocatorError", "BrokenContract", "InfeasiblePlacement", "InvalidBudget", "InvalidDeviceMap", "InvalidModel",
    "InvalidOption", "InvalidPlacement", "InvalidRuntime", "NoPlan", "PlanModelMismatch", "UnsupportedByAccelerate",
    "Cost",
    "ExpertProfile",
    "GenerationBudget", "profile_experts",
    "Profile",
    "estimate", "Fit", "fit",
    "Options", "PlanOptions", "Placement", "Plan", "Problem", "STRATEGIES", "Violation", "build_problem",
    "contract_violations",
    "infer_auto_device_map", "offload", "patch", "plan_of", "PipelinePlan", "plan_pipeline", "JointPlan",
    "plan_together", "DiffusionBudget",
    "unpatch", "parse_budgets", "parse_size", "plan", "validate",
]
__version__ = "0.1.0"
