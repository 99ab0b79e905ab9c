"""(being written)"""

from __future__ import annotations

from fastapi import FastAPI

from loraplex.platform.tenancy import Platform


def install(app: FastAPI, platform: Platform) -> None:
    """Install this component's state on ``app.state`` and its routes."""
