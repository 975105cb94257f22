"""Resolve server arguments as a launch on an H200 would, on this CPU machine (run as a script in
a fresh process: it makes torch report a CUDA device before SGLang is imported).

SGLang's resolution reads the device through `torch.cuda` (availability, capability, memory)
and imports a few modules that pull its compiled CUDA packages (sgl_kernel, flashinfer) at import
time. Here torch answers as one H200 would, and those packages are stand-ins that import but run
nothing: resolution declares settings, it launches no kernel. Everything else is SGLang 0.5.23's
own resolution pipeline with our plugins loaded, as `resolve_once()` runs it in a launcher.

Usage: python -m test.cuda_launch '[{"attention_backend": "fa3", ...}, ...]'
Prints one JSON object per case: the resolved fields the contract tests read, or the error.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types

import torch

STUBBED_PACKAGES = ("sgl_kernel", "flashinfer")


class _StubType(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)


def _stub(name: str) -> type:
    """A class usable as anything an import-time statement asks of it (a base class, a
    decorator, a constant's namespace); calling it does nothing."""
    return _StubType(
        name,
        (),
        {
            "__init__": lambda self, *args, **kwargs: None,
            "__call__": lambda self, *args, **kwargs: None,
            "__getattr__": lambda self, attr: _stub(attr),
        },
    )


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def pretend_h200() -> None:
    sys.meta_path.insert(0, _StubFinder())
    properties = types.SimpleNamespace(
        major=9, minor=0, name="NVIDIA H200", total_memory=141 * 2**30, multi_processor_count=132
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_name = lambda *args, **kwargs: properties.name
    torch.cuda.get_device_properties = lambda *args, **kwargs: properties
    torch.cuda.mem_get_info = lambda *args, **kwargs: (140 * 2**30, properties.total_memory)


def resolve(case: dict) -> dict:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import ServerArgs

    from sglang_magicdec.model import SMOLLM2, embedded_model_path

    case = {"model_path": embedded_model_path(SMOLLM2), "device": "cuda", **case}
    server_args = ServerArgs(**case)
    try:
        server_args.resolve_once()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        return {"error": f"{type(exc).__name__}: {exc}"}
    resolved = resolving_view(server_args)
    graphs = resolved.cuda_graph_config
    return {
        "attention_backend": resolved.attention_backend,
        "disable_cuda_graph": resolved.disable_cuda_graph,
        "decode_graph": graphs.decode.backend,
        "prefill_graph": graphs.prefill.backend,
        "speculative_num_draft_tokens": resolved.speculative_num_draft_tokens,
    }


def main() -> None:
    cases = json.loads(sys.argv[1])
    pretend_h200()
    from sglang.srt.platforms import current_platform
    from sglang.srt.plugins import load_plugins

    load_plugins()
    platform = type(current_platform).__name__
    for case in cases:
        print(json.dumps({"platform": platform, **resolve(case)}), flush=True)


if __name__ == "__main__":
    main()
