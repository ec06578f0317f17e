"""The idle time a pipeline schedule leaves each rank on dedicated cores, for ``benchmarks/pipeline.py``: each
rank's actions in the order torch's schedule ran them, replayed with each action's thread CPU seconds
(``bmt_wrap.runtime.pipeline.action_times``). Four ranks sharing two cores make wall-clock idle time mostly
the machine's load; an action's CPU time is what its stage computed, whatever else ran.

The order is the one the ranks ran, not the schedule object's ``pipeline_order``: torch 2.13's
``Schedule1F1B.pipeline_order`` (an IR it does not execute) gives the last rank forwards 1..M for 0..M-1.
"""

from __future__ import annotations

#: Torch's compute actions: forward, whole backward, the inputs' part of a backward, the weights' part.
COMPUTE = ("F", "B", "I", "W")

Action = tuple[str, int, int]  # (kind, stage, micro-batch)


def _inputs(order: dict[int, list[Action]]) -> dict[Action, Action | None]:
    """The action whose end each action of ``order`` waits for: a forward the previous stage's forward, a
    backward (or its inputs' part, I) the next stage's, the last stage's its own forward, a weights' part (W) its
    inputs' part."""
    present = {a for actions in order.values() for a in actions}
    last = max(stage for _, stage, _ in present)

    def source(kind: str, stage: int, micro: int) -> Action | None:
        if kind == "F":
            return ("F", stage - 1, micro) if stage > 0 else None
        if kind == "W":
            return ("I", stage, micro)
        if stage == last:
            return ("F", stage, micro)
        return ("I", stage + 1, micro) if ("I", stage + 1, micro) in present else ("B", stage + 1, micro)
    return {a: source(*a) for a in present}


def replay(order: dict[int, list[Action]], seconds: dict[Action, float]) -> dict[int, float]:
    """Each rank's idle fraction of the step when it runs its actions of ``order`` in turn, each starting once the
    rank's previous action and the action it takes its input from ended; transfers take no time, the step ends
    with the last action of any rank. ``seconds``: each action's duration."""
    inputs = _inputs(order)
    missing = [a for actions in order.values() for a in actions if a not in seconds]
    if missing:
        raise ValueError(f"no measured time for the schedule's actions {missing[:4]}")
    ended: dict[Action, float] = {}
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    done = dict.fromkeys(order, 0)
    while any(done[r] < len(order[r]) for r in order):
        moved = False
        for rank, actions in order.items():
            while done[rank] < len(actions):
                action = actions[done[rank]]
                dep = inputs[action]
                if dep is not None and dep not in ended:
                    break
                start = max(clock[rank], ended[dep] if dep is not None else 0.0)
                ended[action] = clock[rank] = start + seconds[action]
                busy[rank] += seconds[action]
                done[rank] += 1
                moved = True
        if not moved:
            stuck = {r: order[r][done[r]] for r in order if done[r] < len(order[r])}
            raise ValueError(f"the order deadlocks: each rank's next action waits for another's: {stuck}")
    span = max(clock.values())
    return {rank: 1 - busy[rank] / span if span else 0.0 for rank in order}
