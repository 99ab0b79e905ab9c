"""The adapter registry: tenants upload LoRA adapters as immutable numbered versions, stored
content-addressed on disk, and select them by ``model`` = ``name`` or ``name@N``.

Modules: ``names`` (adapter names, ``name@N``), ``upload`` (streamed multipart), ``validate``
(the engine's checks, in a worker thread), ``storage`` (files), ``records`` (what leaves a
session), ``service`` (``Registry``: rows + files + engine), ``resolver`` (the registry as the
resolver of tenant callers' models), ``routes`` (a tenant's and the operator's routers). The
package itself stays light: the server imports ``registry.upload`` without the platform.
"""
