"""Where a rank's step time goes: the time it waits in each kind of collective, the pipeline's
waits (its bubble and sends), and the step's whole time; compute is the rest.

`comm` times every wait of a collective (`Pending.wait`, the blocking ops) under its group's kind
(`kind_of`); the pipeline times its schedule and the stages' work inside it (`span`), the
schedule's other time being spent waiting for the other stages. Nothing is timed outside a step
(`step_began` .. `step_ended`), so evaluation and set-up cost nothing.

On CUDA each span is a pair of events on the current stream: the time that stream was held, the
compute stream being the one that waits for a collective. The events are read by `read`, where the
trainer reads the steps' other numbers (one host sync for its log.every steps, none in a step).
On CPU a span is wall time.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

KINDS = ("dp", "tensor", "pipeline", "cp", "ep")  # the waits a step is split into, beside "compute"


def kind_of(group: str) -> str:
    """The kind of wait a collective over `group` (a `comm.Group` name: "x", "dp_cp", ...) is:
    tensor parallel (x, y, z), the pipeline (pp), context parallel (cp), the experts' token
    exchange (ep), else data parallel (gradients, and the reductions over whole replicas: the
    loss, the gradient norm, the routers' counts)."""
    dims = set(group.split("_"))
    if dims <= {"x", "y", "z"}:
        return "tensor"
    if dims in ({"pp"}, {"cp"}, {"ep"}):
        return {"pp": "pipeline", "cp": "cp", "ep": "ep"}[dims.pop()]
    return "dp"


class Clock:
    """This rank's spans of the steps since the last `read`, by name: the kinds of wait, the whole
    step ("step"), and the pipeline's schedule and stage work ("schedule", "stage")."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.timing = False  # inside a step
        self._spans: dict[str, list] = defaultdict(list)  # CUDA: (start, end) events; CPU: seconds
        self._open: dict[str, int] = defaultdict(int)  # spans of a name in progress (nested ones count once)
        self._steps = 0
        self._events: list = []  # CUDA events read and free again: recorded anew, not created per span

    def step_began(self) -> None:
        self._open.clear()  # (a step that raised left its spans open: they are not this one's)
        self.timing = True
        self._begin = self._mark()

    def step_ended(self) -> None:
        self._spans["step"].append((self._begin, self._mark()) if self.cuda else time.perf_counter() - self._begin)
        self._steps += 1
        self.timing = False

    @contextlib.contextmanager
    def span(self, name: str):
        """Time the body under `name` (a kind of wait, or a part of the pipeline's schedule), when
        inside a step; a span inside one of the same name is part of it."""
        if not self.timing or self._open[name]:
            yield
            return
        self._open[name] += 1
        start = self._mark()
        try:
            yield
        finally:
            self._open[name] -= 1
            self._spans[name].append((start, self._mark()) if self.cuda else time.perf_counter() - start)

    @property
    def span_count(self) -> int:
        """Spans recorded since the last read (the clock's cost: two timer reads, or events, each)."""
        return sum(len(spans) for spans in self._spans.values())

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def read(self) -> dict[str, float] | None:
        """Seconds a step of the steps since the last read (their mean): "step", "compute" and each
        of `KINDS`; None when no step ran since. Forgets them."""
        if not self._steps:
            return None
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # (the read's one sync: the events are done)
        total = {name: sum(s.elapsed_time(e) / 1e3 for s, e in spans) if self.cuda else sum(spans)
                 for name, spans in self._spans.items()}
        if self.cuda:
            self._events += [event for spans in self._spans.values() for pair in spans for event in pair]
        steps = self._steps
        self._spans.clear()
        self._steps = 0
        out = {kind: total.get(kind, 0.0) / steps for kind in KINDS}
        # the schedule's time not spent in a stage's work: waiting for the other stages
        out["pipeline"] += max(0.0, total.get("schedule", 0.0) - total.get("stage", 0.0)) / steps
        out["step"] = total["step"] / steps
        out["compute"] = max(0.0, out["step"] - sum(out[k] for k in KINDS))
        return out
