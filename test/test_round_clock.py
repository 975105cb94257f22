"""The worker's phase clock: times what somebody reads, tells listeners of nested phases."""

from __future__ import annotations

import time

from sglang_magicdec import round_clock
from sglang_magicdec.round_clock import RoundClock


class Recorder:
    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self.seconds: dict[str, float] = {}

    def phase_started(self, name: str) -> None:
        self.events.append(("start", name))

    def phase_ended(self, name: str, seconds: float) -> None:
        self.events.append(("end", name))
        self.seconds[name] = seconds


def test_an_untimed_clock_without_listeners_records_nothing():
    clock = RoundClock(timed=False, on_cuda=False)
    with clock.phase("round"):
        pass
    assert clock.seconds == {}


def test_phases_are_timed_for_the_cost_model_and_told_to_listeners(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(round_clock, "_listeners", [])
    round_clock.subscribe(recorder)
    clock = RoundClock(timed=False, on_cuda=False)  # a listener alone makes it time
    with clock.phase("round"):
        with clock.phase("verify"):
            time.sleep(0.02)
    assert recorder.events == [
        ("start", "round"),
        ("start", "verify"),
        ("end", "verify"),
        ("end", "round"),
    ]
    assert clock.seconds["round"] >= clock.seconds["verify"] >= 0.02
    assert recorder.seconds == clock.seconds
