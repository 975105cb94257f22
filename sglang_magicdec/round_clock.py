"""The phases of the batches the worker runs, and their wall times: the one clock the cost model
(γ = auto) and the benchmarks read.

Phases, as `MagicDecWorker` enters them: "extend"; a speculative "round", within it
"draft_round" (the draft slots resolved), "draft_step" (γ times), "verify" (the verify forward)
and "commit"; a "plain_decode" step (γ = 0). A benchmark times them by subscribing a
`PhaseListener` in the server's process (`benchmark/round_timers.py`); with no listener and no
cost model a phase costs one check.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch


class PhaseListener(Protocol):
    def phase_started(self, name: str) -> None: ...

    def phase_ended(self, name: str, seconds: float) -> None: ...


_listeners: list[PhaseListener] = []


def subscribe(listener: PhaseListener) -> None:
    """Tell `listener` of every phase of every worker in this process from now on."""
    _listeners.append(listener)


class RoundClock:
    """Times a worker's phases where somebody reads them: its cost model (`timed`) or a
    listener. On CUDA a timed point first waits for the device (what was queued is part of the
    phase)."""

    def __init__(self, timed: bool, on_cuda: bool):
        self.timed = timed
        self.on_cuda = on_cuda
        self.seconds: dict[str, float] = {}  # phase -> seconds of its latest run

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not (self.timed or _listeners):
            yield
            return
        for listener in _listeners:
            listener.phase_started(name)
        started = self.now()
        try:
            yield
        finally:
            seconds = self.now() - started
            self.seconds[name] = seconds
            for listener in reversed(_listeners):
                listener.phase_ended(name, seconds)

    def now(self) -> float:
        if self.on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
