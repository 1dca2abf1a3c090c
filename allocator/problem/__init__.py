"""The problem layer: the options a plan is made with (:mod:`.options`), their per-concern slices
(:mod:`.slices`), and the frozen :class:`Problem` built once from a model, budgets and options (:mod:`.build`)."""

from .build import (Problem, absent_accelerators, accelerators_up_to, build_problem, decode_inputs,
                    present_budgets, quantizer_size_fn, step_problem)
from .options import OBJECTIVES, OPTION_NAMES, RUNTIMES, STEPS, Options, PlanOptions

__all__ = ["absent_accelerators", "accelerators_up_to", "present_budgets", "OBJECTIVES", "STEPS", "OPTION_NAMES",
           "Options", "PlanOptions", "Problem", "RUNTIMES", "build_problem", "step_problem", "decode_inputs",
           "quantizer_size_fn"]
