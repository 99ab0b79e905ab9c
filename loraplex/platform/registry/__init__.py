"""The adapter registry: tenants upload LoRA adapters as immutable numbered versions, stored
content-addressed on disk, and select them by ``model`` = ``name`` or ``name@N``.

``install`` puts the ``Registry`` on ``app.state.registry``, makes it the resolver of tenant
callers' models (``ModelResolver.tenant_models``) and applies ``share_prefix_cache``; the app
mounts the routers of ``registry.routes`` (see ``app.mount_routes``). Modules: ``names`` (adapter names, ``name@N``), ``upload``
(streamed multipart), ``validate`` (the engine's checks, in a worker thread), ``storage`` (files),
``records`` (what leaves a session), ``service`` (rows + files + engine), ``resolver``,
``routes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:  # the package stays light: app.py imports registry.upload without tenancy
    from loraplex.platform.tenancy import Platform


def install(app: FastAPI, platform: Platform) -> None:
    """Install this component's state on ``app.state``."""
    from loraplex.platform.registry.resolver import RegistryModels
    from loraplex.platform.registry.service import Registry

    serving = app.state.serving
    registry = Registry(platform, serving.client, serving.resolver)
    registry.recover()
    app.state.registry = registry
    serving.resolver.tenant_models = RegistryModels(registry)
    serving.resolver.share_base_prefix_cache = platform.settings.share_prefix_cache
