"""`ExpertLoadBalancer`: EPLB's windowed statistics and reassignment schedule for one expert-parallel group.

The schedule. Steps are numbered from 1. A reassignment is due every `step_interval` steps (steps I, 2I, ...);
the one due at step `d` places the experts by the token counts of steps `d - window_size + 1 .. d` (fewer at the
start) and takes effect from step `d + 1`. DeepInfer's settings are the presets: prefill 4 redundant experts per
GPU, a 100-step window, every 1,000 steps; decode 1, 1,000, 10,000.

The rank loop's contract (every rank of the group calls it with the same, all-reduced, numbers, so every rank
computes the same placement; the algorithm is deterministic):

    balancer = ExpertLoadBalancer(EplbConfig.prefill(), num_layers=43, num_experts=256, num_gpus=8)
    placement = balancer.placement                 # load these slots, route by placement.log2phy
    every step (or every n <= balancer.max_steps_per_observe steps):
        counts = None
        if balancer.needs_counts:                  # these steps fall in a coming window: read the device
            counts = all_reduce(device_counters)   # [layers][logical experts] tokens of those n steps
            device_counters.zero_()
        new = balancer.observe(counts, num_steps=n)
        if new is not None:                        # a reassignment: load the moved slots' weights, then switch
            moves = balancer.last_rebalance.moved_slots; placement = new

A new placement is EPLB's for the window's counts, renumbered (`Placement.aligned_to`) to keep as many slots as
possible where the old placement had them; `last_rebalance.moved_slots` lists the slots whose weights change.

Counts outside the coming windows may still be handed in (they feed `latest_imbalance`, the gauge for /metrics)
or left out (None). Memory stays one `[layers][experts]` sum per stretch of steps that the coming windows use
alike: with `window_size <= step_interval` (both presets) that is one sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from .eplb import as_load_rows
from .placement import Placement


@dataclass(frozen=True, slots=True)
class EplbConfig:
    """EPLB options. `redundant_experts_per_gpu` times the EP size is vLLM's `num_redundant_experts`;
    `window_size` and `step_interval` are vLLM's `EPLBConfig` fields. Defaults: DeepInfer's prefill settings.

    `min_rebalancing_utilization_threshold` (SGLang's `--eplb-min-rebalancing-utilization-threshold`, applied
    per layer here): a reassignment re-places only the layers whose window utilization under the current
    placement (mean GPU load over the most loaded GPU's, i.e. 1 / imbalance) is at or below it; the others keep
    their slots and move no weights. 1.0 (the default, DeepInfer's behaviour) re-places every layer."""

    window_size: int = 100
    step_interval: int = 1000
    redundant_experts_per_gpu: int = 4
    min_rebalancing_utilization_threshold: float = 1.0

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EplbConfig.{name} must be an int >= 1, got {value!r}")
        value = self.redundant_experts_per_gpu
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"EplbConfig.redundant_experts_per_gpu must be an int >= 0, got {value!r}")
        value = self.min_rebalancing_utilization_threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"EplbConfig.min_rebalancing_utilization_threshold must be in [0, 1], got {value!r}")

    @classmethod
    def prefill(cls) -> EplbConfig:
        """DeepInfer's prefill: 4 redundant experts per GPU, 100-step window, reassignment every 1,000 steps."""
        return cls(window_size=100, step_interval=1000, redundant_experts_per_gpu=4)

    @classmethod
    def decode(cls) -> EplbConfig:
        """DeepInfer's decode: 1 redundant expert per GPU, 1,000-step window, reassignment every 10,000 steps."""
        return cls(window_size=1000, step_interval=10_000, redundant_experts_per_gpu=1)


@dataclass(frozen=True, slots=True)
class RebalanceReport:
    """What the reassignment due at `step` found: per-layer imbalance of the window's counts under the old
    placement and under the new one, and per layer the slots whose expert changed (empty when nothing moved,
    or when the window held no tokens and the placement was kept)."""

    step: int
    imbalance_before: tuple[float, ...]
    imbalance_after: tuple[float, ...]
    moved_slots: tuple[tuple[int, ...], ...]

    @property
    def num_moved_slots(self) -> int:
        return sum(len(layer) for layer in self.moved_slots)


@dataclass(slots=True)
class _Stretch:
    first: int  # steps first..last, summed
    last: int
    counts: list[list[float]]


class ExpertLoadBalancer:
    """Counts in, an optional new placement out (see the module docstring for the rank loop's calls).

    num_layers, num_experts: the MoE layers and each layer's logical (routed) experts.
    num_gpus, num_nodes, num_groups: the EP group and the model's expert groups, as `rebalance_experts` takes
    them. `initial`: the placement before the first reassignment (default: EPLB's for uniform loads).
    """

    def __init__(self, config: EplbConfig, num_layers: int, num_experts: int, num_gpus: int, num_nodes: int = 1,
                 num_groups: int = 1, initial: Placement | None = None) -> None:
        self.config = config
        self.num_gpus, self.num_nodes, self.num_groups = num_gpus, num_nodes, num_groups
        self.num_redundant_experts = config.redundant_experts_per_gpu * num_gpus
        if initial is None:
            initial = self._place([[1.0] * num_experts for _ in range(num_layers)])
        elif (initial.num_layers, initial.num_logical_experts, initial.num_gpus, initial.num_nodes) != (
                num_layers, num_experts, num_gpus, num_nodes):
            raise ValueError(f"initial placement is {initial.num_layers} layers x {initial.num_logical_experts} "
                             f"experts on {initial.num_gpus} GPUs in {initial.num_nodes} nodes, not {num_layers} x "
                             f"{num_experts} on {num_gpus} in {num_nodes}")
        elif initial.num_physical_experts != num_experts + self.num_redundant_experts:
            raise ValueError(f"initial placement has {initial.num_physical_experts} slots per layer, not "
                             f"{num_experts} experts + {self.num_redundant_experts} redundant")
        self.placement = initial
        self.num_layers, self.num_experts = num_layers, num_experts
        self.step = 0  # steps observed so far
        self.num_rebalances = 0  # reassignments that changed the placement
        self.last_rebalance: RebalanceReport | None = None
        self._stretches: list[_Stretch] = []
        self._latest: tuple[list[list[float]], Placement] | None = None

    @property
    def next_rebalance_step(self) -> int:
        return (self.step // self.config.step_interval + 1) * self.config.step_interval

    @property
    def needs_counts(self) -> bool:
        """Whether the next step's counts enter the window of a coming reassignment."""
        return self.step + 1 > self.next_rebalance_step - self.config.window_size

    @property
    def max_steps_per_observe(self) -> int:
        """The most steps one `observe` may cover: up to the next window start or reassignment, whichever is
        first, so a call's counts fall wholly inside or wholly outside each window."""
        w, i = self.config.window_size, self.config.step_interval
        next_start = ((self.step + w) // i + 1) * i - w  # the first window start after this step
        return min(next_start, self.next_rebalance_step) - self.step

    def observe(self, counts: object | None, num_steps: int = 1) -> Placement | None:
        """Account `num_steps` more steps with their summed `[layers][logical experts]` token counts (None where
        `needs_counts` is False). Returns the new placement when these steps end with a reassignment that
        changed it (it applies from the next step), else None."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        if num_steps > self.max_steps_per_observe:
            raise ValueError(f"observe covers at most {self.max_steps_per_observe} steps from step {self.step} "
                             f"(a window starts or a reassignment is due), got num_steps={num_steps}")
        first, last, due = self.step + 1, self.step + num_steps, self.next_rebalance_step
        inside = first > due - self.config.window_size
        if counts is None:
            if inside:
                raise ValueError(f"steps {first}..{last} are in the window of the reassignment at step {due}: "
                                 "their counts are needed")
        else:
            rows = as_load_rows(counts)
            if len(rows) != self.num_layers or len(rows[0]) != self.num_experts:
                raise ValueError(f"counts must be [{self.num_layers}][{self.num_experts}] (layers, logical "
                                 f"experts), got [{len(rows)}][{len(rows[0])}]")
            self._latest = (rows, self.placement)
            if inside:
                self._add(first, last, rows)
        self.step = last
        return self._rebalance(due) if last == due else None

    def latest_imbalance(self) -> list[float] | None:
        """Per layer, slowest GPU over mean for the latest counts handed in, under the placement they ran on
        (None before any): the value for a per-layer imbalance gauge."""
        if self._latest is None:
            return None
        rows, placement = self._latest
        return placement.imbalance(rows)

    def _add(self, first: int, last: int, rows: list[list[float]]) -> None:
        tail = self._stretches[-1] if self._stretches else None
        # merge unless a later window starts right after the tail (then the two are not always used together)
        if tail is not None and tail.last + 1 == first and (tail.last + self.config.window_size) % \
                self.config.step_interval:
            tail.counts = [[a + b for a, b in zip(x, y)] for x, y in zip(tail.counts, rows)]
            tail.last = last
        else:
            self._stretches.append(_Stretch(first, last, [list(r) for r in rows]))

    def _rebalance(self, due: int) -> Placement | None:
        w = self.config.window_size
        window = [[0.0] * self.num_experts for _ in range(self.num_layers)]
        for stretch in self._stretches:
            if stretch.first > due - w:
                window = [[a + b for a, b in zip(x, y)] for x, y in zip(window, stretch.counts)]
        next_start = due + self.config.step_interval - w
        self._stretches = [s for s in self._stretches if s.first > next_start]
        before = tuple(self.placement.imbalance(window))
        if not any(any(row) for row in window):  # an idle window says nothing about the loads: keep the placement
            self.last_rebalance = RebalanceReport(due, before, before, ((),) * self.num_layers)
            return None
        threshold = self.config.min_rebalancing_utilization_threshold
        redo = [layer for layer, imbalance in enumerate(before) if 1.0 / imbalance <= threshold]
        new = self._place(window).aligned_to(self.placement)
        if len(redo) < self.num_layers:  # the well-balanced layers keep their slots
            new = self.placement.with_layers_from(new, redo)
        moved = tuple(tuple(layer) for layer in self.placement.changed_slots(new))
        self.last_rebalance = RebalanceReport(due, before, tuple(new.imbalance(window)), moved)
        if not any(moved):
            return None
        self.placement = new
        self.num_rebalances += 1
        return new

    def _place(self, loads: list[list[float]]) -> Placement:
        return Placement.from_loads(loads, self.num_gpus, self.num_redundant_experts, self.num_groups,
                                    self.num_nodes)
