"""Two (or more) platform replicas on one database: apps, each with its own engine (the fake
one by default) and its own data directory (no shared filesystem), with
``shared_state="database"`` and their lifespans running (the change feed, the lease heartbeat).
The ``shared_url`` and ``replicas`` fixtures in ``tests/platform/conftest.py`` build on this."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import TenancyEnv, tenancy_env


async def open_replicas(
    stack: AsyncExitStack,
    tmp_path: Path,
    tokenizer_dir: str,
    tokenizer: Any,
    url: str,
    *,
    count: int = 2,
    client: Any = None,
    **settings: Any,
) -> list[TenancyEnv]:
    """``count`` replicas on ``url``, each in its own data directory, lifespans entered.
    ``client(name)``: builds each replica's engine (default: the fake engine)."""
    envs = []
    for index in range(count):
        name = "ab"[index] if count <= 2 else str(index)
        fake = client(tmp_path / name) if client else FakeEngineClient(model_dir=tokenizer_dir)
        env = await stack.enter_async_context(
            tenancy_env(
                tmp_path / name,
                fake,
                tokenizer,
                database_url=url,
                shared_state="database",
                replica_poll_s=0.05,
                **settings,
            )
        )
        await stack.enter_async_context(env.app.platform.lifespan(own_client=False))
        envs.append(env)
    return envs
