"""Scheduling: what each running request computes in a step, with prefill chunks sized by a fitted cost model."""

from deepserve.core.scheduler.cost_model import (
    DEEPSEEK_MAX_CHUNK,
    DEFAULT_PRIOR,
    MIN_STEP_SECONDS,
    Chunk,
    CostCoefficients,
    CostModelConfig,
    StepCostModel,
)

__all__ = [
    "DEEPSEEK_MAX_CHUNK",
    "DEFAULT_PRIOR",
    "MIN_STEP_SECONDS",
    "Chunk",
    "CostCoefficients",
    "CostModelConfig",
    "StepCostModel",
]
