"""Fixtures of the ``loraplex serve`` tests: a tiny model with a chat template, per module."""

from __future__ import annotations

import pytest

from tests.utils.app import add_chat_template
from tests.utils.models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", "llama", seed=3)
    add_chat_template(model_dir)
    return model_dir
