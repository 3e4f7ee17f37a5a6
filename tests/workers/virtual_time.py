"""Given times for the workers: a virtual clock that moves only when the worker advances it, and
the step durations a config gives, so what LAGS and MergeComp decide from times is a function of
the config, not of the machine's speed (shared by ``torch_exchange.py`` and ``tf_exchange.py``)."""
from typing import List, Sequence


class VirtualClock:
    """The front end's clock in a run with given times: it moves only when the worker advances
    it, so every duration the front end measures is one the config gave."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def after(self, seconds: float):
        """A gradient hook: computing this gradient takes ``seconds``."""
        def hook(grad):
            self.advance(seconds)
            return grad
        return hook


def step_seconds(spec: dict, group_sizes: Sequence[int], step: int, rank: int) -> float:
    """The given duration of ``step`` on ``rank`` with groups of ``group_sizes`` elements (in the
    optimizer's group order, which MergeComp's groups are launched in):
    ``(1 + rank) * (per_group * groups + per_element * elements of the last group)`` (a fixed
    cost per group; the last group's exchange overlaps nothing), plus
    ``extra[(step - 1) % len(extra)]`` (e.g. a slow first step after each regrouping)."""
    extra: List[float] = spec.get("extra", [0.0])
    base = spec["per_group"] * len(group_sizes) + spec["per_element"] * group_sizes[-1]
    return (1 + rank) * base + extra[(step - 1) % len(extra)]
