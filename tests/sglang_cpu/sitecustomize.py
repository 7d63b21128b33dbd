"""Test-only patches that let SGLang 0.5.23's HiCache run on a CPU without AMX (put on PYTHONPATH only for the
SGLang processes the ``sglang`` tests start; never part of tierkv).

1. ``sgl_kernel`` (CUDA only on the index): a stub package whose attributes raise when called; a small Llama
   takes the native torch path on CPU (``--device cpu --attention-backend torch_native``).
2. The host pool registers its memory with CUDA and pins it: a no-op register, ``pin_memory=False``.
3. The device<->host copy op of ``--hicache-io-backend direct --hicache-mem-layout layer_first`` is bound only
   for CUDA/HIP/XPU: a torch ``index_select`` / ``index_copy_`` stand-in.
4. ``torch.cpu.Stream`` has no ``synchronize``: a no-op.

Every patch is pinned to 0.5.23's internals: a target that is missing raises at import, naming it, so an
SGLang upgrade fails loudly instead of running unpatched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class PatchTargetMissing(RuntimeError):
    pass


def _need(obj: object, name: str, where: str) -> None:
    if not hasattr(obj, name):
        raise PatchTargetMissing(f"tests/sglang_cpu/sitecustomize.py: {where}.{name} is gone (SGLang upgraded?)")


# -- 1. sgl_kernel stub ------------------------------------------------------------------------------------
class _Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *a: object, **k: object) -> object:
        raise RuntimeError(f"{self._name}: sgl_kernel is a stub on this CPU test machine")

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        m = _StubModule(spec.name)
        m.__path__ = []  # a package: every submodule is a stub too
        m.__version__ = "0.0.0+cpu-stub"
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        return None


sys.meta_path.insert(0, _StubFinder())


# -- 2-4. patches applied when their module is imported -------------------------------------------------------
def _patch_common(m: types.ModuleType) -> None:
    _need(m, "_cuda_host_register", m.__name__)
    m._cuda_host_register = lambda *a, **k: None


def _patch_base(m: types.ModuleType) -> None:
    _need(m, "HostKVCache", m.__name__)
    cls = m.HostKVCache
    init = cls.__init__

    def __init__(self, *a, **k):  # type: ignore[no-untyped-def]
        if "pin_memory" not in k:
            raise PatchTargetMissing("HostKVCache.__init__ no longer takes pin_memory by keyword")
        k["pin_memory"] = False
        init(self, *a, **k)

    cls.__init__ = __init__


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1, **_):  # type: ignore[no-untyped-def]
    import torch

    src_idx = src_indices.to(torch.long)
    dst_idx = dst_indices.to(torch.long)
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, src_idx.to(src.device))
        dst.index_copy_(0, dst_idx.to(dst.device), rows.to(dst.device))


def _patch_mha(m: types.ModuleType) -> None:
    _need(m, "MHATokenToKVPoolHost", m.__name__)
    if "transfer_kv_direct(" not in open(m.__file__).read():
        raise PatchTargetMissing(f"{m.__name__} no longer calls transfer_kv_direct")
    m.transfer_kv_direct = _transfer_kv_direct


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": _patch_common,
    "sglang.srt.mem_cache.pool_host.base": _patch_base,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
}


class _PatchLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch) -> None:  # type: ignore[no-untyped-def]
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self._inner.create_module(spec)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        self._inner.exec_module(module)
        self._patch(module)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _StubFinder):
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchLoader(spec.loader, patch)
                return spec
        raise PatchTargetMissing(f"tests/sglang_cpu/sitecustomize.py: module {name} not found (SGLang upgraded?)")


sys.meta_path.insert(0, _PatchFinder())

import torch

_need(torch, "cpu", "torch")
if not hasattr(torch.cpu.Stream, "synchronize"):
    torch.cpu.Stream.synchronize = lambda self: None
