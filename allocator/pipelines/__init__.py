"""A diffusion pipeline's components placed as one problem (:func:`plan_pipeline`)."""

from .components import Component, read_components, runs_per_image
from .plan import PipelinePlan, plan_pipeline

__all__ = ["Component", "PipelinePlan", "plan_pipeline", "read_components", "runs_per_image"]
