"""Fixtures of the native-kernel tests: a recorder around the loaded library, a seeded generator."""

from __future__ import annotations

import pytest
import torch

from tests.utils.native_spy import LibSpy, install_spy


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> LibSpy:
    return install_spy(monkeypatch)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
