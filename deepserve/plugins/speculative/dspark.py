"""The engine's side of DSpark: the verify planner over the online step-time curve (plain Python).

The engine asks `plan` once per step, before scheduling, with the draft confidences of every running sequence
that has drafts (computed on the device when the drafts were made, so they are as old as the drafts), and
feeds `observe` every finished step's size and duration.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepserve.plugins.speculative.planner import StepTimeCurve, plan_verify_lengths


class DSparkPlanner:
    def __init__(self, curve: StepTimeCurve | None = None) -> None:
        self.curve = curve or StepTimeCurve()

    def plan(self, confidences: Sequence[Sequence[float]], other_tokens: int = 0, other_outputs: int = 0) -> list[int]:
        """How many drafts of each sequence to verify this step, beside `other_tokens` of other work in it that
        sample `other_outputs` tokens."""
        return plan_verify_lengths(confidences, self.curve, other_tokens, other_outputs)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step that computed `num_tokens` tokens took `seconds` on the runner."""
        if num_tokens > 0 and seconds > 0:
            self.curve.observe(num_tokens, seconds)
