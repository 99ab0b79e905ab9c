"""A recorder around loraplex's loaded native library, shared by the native-kernel tests."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pytest

from loraplex.kernels import native

# What the build is, not work done: asked on every call, so not recorded
QUERIES = frozenset({"lp_gemm_panel_width"})


class LibSpy:
    """Stands in for the loaded library and records which kernels the wrappers call (not the
    build queries in ``QUERIES``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._lib, name)

        def call(*args: Any) -> Any:
            if name not in QUERIES:
                self.calls.append(name)
            return fn(*args)

        return call


def install_spy(monkeypatch: pytest.MonkeyPatch) -> LibSpy:
    """The real library behind a recorder, so a test also proves which path ran."""
    lib = native.library()
    assert lib is not None, "the native kernels did not build (CI needs a C compiler)"
    recorder = LibSpy(lib)
    monkeypatch.setattr(native, "library", lambda: recorder)
    return recorder
