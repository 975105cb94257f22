"""Probes inside a real server's scheduler process, for tests (never installed).

A server started with this folder on PYTHONPATH loads this module as an SGLang plugin (the
dist-info beside it declares the entry point), and the probes named in the JSON of
`MAGICDEC_PROBE` hook our code through SGLang's HookRegistry, as our own plugin does:

- `{"silence_layer": N}`: layer N's SnapKV observer hook does nothing, as when a replayed
  graph or an attention call without the module skips it;
- `{"host_syncs": PATH}`: every speculative round appends one JSON line to PATH, counting the
  calls on the worker's path that synchronise with the device when their tensor is on a GPU
  (outside SGLang's own forward, which runs the model and its attention backend): copies to the
  host (`item`, `tolist`, `cpu`, `numpy`, `bool`/`int`/`float`/`index` of a tensor), blocking
  copies to a device (`to(device)` without `non_blocking`, `torch.tensor(..., device=)`) and
  results whose size depends on data (`nonzero`, `unique`, `masked_select`, boolean indexing).
  On this CPU every tensor is a host tensor, so the count is an upper bound of the syncs a GPU
  round would make: it also counts such calls on tensors that would stay on the host there.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
TO_HOST = {
    Tensor.item, Tensor.tolist, Tensor.cpu, Tensor.numpy,
    Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__,
}  # fmt: skip
DATA_DEPENDENT = {
    Tensor.nonzero, torch.nonzero, Tensor.unique, torch.unique, Tensor.masked_select,
    torch.masked_select,
}  # fmt: skip


def _is_device(value) -> bool:
    return isinstance(value, (str, torch.device, Tensor))


def _sync_kind(func, args, kwargs) -> str | None:
    if func in TO_HOST:
        return "to_host"
    if func in DATA_DEPENDENT:
        return "data_dependent_shape"
    if func is Tensor.__getitem__:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, Tensor) and i.dtype == torch.bool for i in index):
            return "data_dependent_shape"
    if func in (Tensor.to, Tensor.cuda) and not kwargs.get("non_blocking", False):
        if func is Tensor.cuda or "device" in kwargs or any(_is_device(a) for a in args[1:]):
            return "blocking_copy"
    if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
        return "blocking_copy"
    return None


class HostSyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            kind = _sync_kind(func, args, kwargs)
            if kind is not None:
                self.counts[kind] += 1
        return func(*args, **kwargs)


_active: list[HostSyncCounter] = []


def load() -> None:
    probe = json.loads(os.environ.get("MAGICDEC_PROBE") or "{}")
    if not probe:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if "silence_layer" in probe:
        silenced = int(probe["silence_layer"])

        def capture(original, observer, layer, *args, **kwargs):
            if layer.layer_id == silenced:
                return None
            return original(observer, layer, *args, **kwargs)

        HookRegistry.register(
            "sglang_magicdec.observer.WindowObserver._capture", capture, HookType.AROUND
        )
    if "host_syncs" in probe:
        path = probe["host_syncs"]

        def paused(function):
            def run(*args, **kwargs):
                for counter in _active:
                    counter.paused += 1
                try:
                    return function(*args, **kwargs)
                finally:
                    for counter in _active:
                        counter.paused -= 1

            return run

        def speculate(original, worker, batch, on_publish, gamma, budget):
            counter = HostSyncCounter()
            _active.append(counter)
            try:
                with counter:
                    publish = None if on_publish is None else paused(on_publish)
                    result = original(worker, batch, publish, gamma, budget)
            finally:
                _active.remove(counter)
            record = {
                "batch": len(batch.reqs),
                "gamma": gamma,
                "sampled": not batch.sampling_info.is_all_greedy,
                **counter.counts,
            }
            with open(path, "a") as out:
                out.write(json.dumps(record) + "\n")
            return result

        def sglang_forward(original, *args, **kwargs):
            return paused(original)(*args, **kwargs)

        HookRegistry.register(
            "sglang_magicdec.worker.MagicDecWorker._speculate", speculate, HookType.AROUND
        )
        HookRegistry.register(
            "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
            sglang_forward,
            HookType.AROUND,
        )
