"""Wall-clock timers inside a MAGICDEC server's scheduler: each part of a round (the phases the
worker's `RoundClock` reports, `sglang_magicdec/round_clock.py`) and, within each, the native
kernels it called (`benchmark/profile_round.py`).

A sampling profiler misleads on two cores: py-spy takes CPU from one of the two OpenMP threads
of a parallel kernel, which then waits at its barrier, so kernels look slower and larger than
they are (a plain decode step at batch 2 × 1K ran 77 ms alone and 94 ms under py-spy at 200 Hz).
These timers cost a `perf_counter` pair per call.

Installed in the server's processes by `sitecustomize` (`SITECUSTOMIZE`, put on `PYTHONPATH`): a
listener subscribes to the round clock and the kernel functions are wrapped as their modules are
imported, and the scheduler writes its totals to `$MAGICDEC_ROUND_TIMERS` after every batch the
worker runs. A MAGICDEC server's parts are its worker's phases (extend batches included); with
`$MAGICDEC_ROUND_TIMERS_TARGET` set (a server without speculation) the target model's forwards
are the parts, named by their mode ("decode", "extend"), so that whatever is left of the wall
time is the scheduler's own.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable

ENV = "MAGICDEC_ROUND_TIMERS"
TARGET_ENV = "MAGICDEC_ROUND_TIMERS_TARGET"
KERNELS = {"few_rows_linear": "linear", "slot_attention": "attention"}
SITECUSTOMIZE = "import benchmark.round_timers as timers\ntimers.install()\n"

# part -> [calls, seconds]; (part, kernel) -> seconds.
_parts: dict[str, list] = defaultdict(lambda: [0, 0.0])
_kernels: dict[tuple[str, str], float] = defaultdict(float)
_stack: list[str] = []


class _PartTimers:
    """A `round_clock.PhaseListener`: the phases are the parts."""

    def phase_started(self, name: str) -> None:
        _stack.append(name)

    def phase_ended(self, name: str, seconds: float) -> None:
        entry = _parts[name]
        entry[0] += 1
        entry[1] += seconds
        _stack.pop()
        if not _stack:  # a batch is done: publish the totals
            _write(os.environ[ENV])


def _timed_part(name: str, method: Callable) -> Callable:
    timers = _PartTimers()

    @functools.wraps(method)
    def timed(*args, **kwargs):
        timers.phase_started(name)
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timers.phase_ended(name, time.perf_counter() - start)

    return timed


def _timed_kernel(label: str, function: Callable) -> Callable:
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            part = _stack[-1] if _stack else "outside the worker"
            _kernels[(part, label)] += time.perf_counter() - start

    return timed


def _write(path: str) -> None:
    totals = {
        "parts": dict(_parts),
        "kernels": {f"{part}/{label}": seconds for (part, label), seconds in _kernels.items()},
    }
    with open(path + ".tmp", "w") as out:
        json.dump(totals, out)
    os.replace(path + ".tmp", path)


def _subscribe(module) -> None:
    module.subscribe(_PartTimers())


def _wrap_target_worker(module) -> None:
    worker = module.TpModelWorker
    forward = worker.forward_batch_generation
    parts = {name: _timed_part(name, forward) for name in ("decode", "extend")}

    @functools.wraps(forward)
    def by_mode(self, batch, *args, **kwargs):
        mode = "decode" if batch.forward_mode.is_decode() else "extend"
        return parts[mode](self, batch, *args, **kwargs)

    worker.forward_batch_generation = by_mode


def _wrap_kernels(module) -> None:
    for name, label in KERNELS.items():
        setattr(module, name, _timed_kernel(label, getattr(module, name)))


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Runs `after[name](module)` once the module `name` has been executed."""

    def __init__(self, after: dict[str, Callable]):
        self.after = after

    def find_spec(self, name, path, target=None):
        if name not in self.after:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        execute, wrap = spec.loader.exec_module, self.after.pop(name)

        def exec_module(module):
            execute(module)
            wrap(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Time the parts and the kernels once their modules are imported (only where `ENV` is
    set)."""
    if os.environ.get(ENV):
        wraps = {"magicdec_kernels.cpu_native": _wrap_kernels}
        if os.environ.get(TARGET_ENV):
            wraps["sglang.srt.managers.tp_worker"] = _wrap_target_worker
        else:
            wraps["sglang_magicdec.round_clock"] = _subscribe
        sys.meta_path.insert(0, _WrapOnImport(wraps))


def read(path: str) -> dict:
    with open(path) as totals:
        return json.load(totals)
