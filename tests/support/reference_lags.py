"""An independent slow reference of the LAGS rule of ``horovod_sparse.methods.lags.rule`` (written from
its docstrings; imports nothing from ``horovod_sparse``): the predicted step by a plain event
walk, and each group's count by scanning every count from the cap down."""
import math
from typing import Dict, List, Sequence, Tuple


def step_after_backward(groups: Sequence[Tuple[int, float]], counts: Sequence[int], floor: Sequence[int],
                        alpha: float, beta: float, workers: int, local: Dict[str, float]) -> float:
    """Seconds from the measured end of backward to the end of the step. ``groups``: ``(numel,
    t_comp)`` in launch order; ``local``: the LocalCost fields."""
    latency = alpha * math.log2(workers)
    delay, wire_ready, wire_seconds = 0.0, [], []
    for (numel, t_comp), count, measured in zip(groups, counts, floor):
        selection = local["select_element"] * numel + local["select_pair"] * count
        wire_ready.append(delay - t_comp + selection)
        wire_seconds.append(latency + (workers - 1) * beta * 8 * count)
        delay += local["select_pair"] * (count - measured)
    link_free = -math.inf
    for ready, seconds in zip(wire_ready, wire_seconds):
        link_free = max(link_free, ready) + seconds
    end = max(delay, link_free) if groups else delay
    return end + local["apply_pair"] * workers * sum(counts)


def counts(groups: Sequence[Tuple[int, float]], alpha: float, beta: float, workers: int, local: Dict[str, float],
           floor: float, cap: float, slack: float) -> List[int]:
    """Each group's count: the largest, scanned from the cap down, whose predicted step stays
    within ``slack`` times (first launch to step end at the floor counts) of the step at the
    floor counts (later groups at the floor)."""
    def at(density: float, numel: int) -> int:
        return max(1, int(density * numel))

    lowest = [at(floor, numel) for numel, _ in groups]
    at_floor = step_after_backward(groups, lowest, lowest, alpha, beta, workers, local)
    first_launch = max([t_comp for _, t_comp in groups] + [0.0])
    budget = at_floor + slack * (first_launch + at_floor)
    chosen = list(lowest)
    for i, (numel, _) in enumerate(groups):
        for count in range(at(max(floor, cap), numel), lowest[i] - 1, -1):
            trial = chosen[:i] + [count] + chosen[i + 1:]
            if step_after_backward(groups, trial, lowest, alpha, beta, workers, local) <= budget:
                chosen[i] = count
                break
    return chosen
