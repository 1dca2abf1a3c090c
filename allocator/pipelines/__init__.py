"""Several models placed as one problem: a diffusion pipeline's components (:func:`plan_pipeline`), a target and its
draft model (:func:`plan_together`)."""

from .budget import DiffusionBudget
from .components import Component, read_components, runs_per_image
from .plan import PipelinePlan, plan_pipeline
from .together import JointPlan, plan_together

__all__ = ["Component", "DiffusionBudget", "JointPlan", "PipelinePlan", "plan_pipeline", "plan_together",
           "read_components", "runs_per_image"]
