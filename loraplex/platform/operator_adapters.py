"""The operator's adapters: vLLM's adapter API (``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter``), ``--lora-modules`` and ``--lora-resolver-dir``.

They are the operator's entries of the model table (``ModelResolver``'s adapters, owned by the
operator, never a tenant's): the operator's credential uses them and its ``/v1/models`` lists
them (on a server without the platform, every caller is the operator). Tenants' adapters come
through the registry (``/v1/adapters``) and never see these.

Every load is checked as an upload is before the engine reads it: ``check_adapter`` under the
upload byte limit (``max_adapter_bytes``; pickles refused, rank, shapes against the base model)
and only target modules the engine serves, in a worker thread; a refusal is a 400 (413 when too
large) naming what is wrong. On the platform each change is an audit row
(``operator_adapter.load`` / ``operator_adapter.unload``, actor ``admin``), in the log without it.

The entries live in this process, as vLLM's do: a restarted server holds its ``--lora-modules``
only, and a caller that loads adapters at run time (AIBrix's ModelAdapter controller reads
``/v1/models`` first) loads them again.

``--lora-resolver-dir DIR`` (vLLM's filesystem resolver): a request from the operator for a
model ``X`` that is neither the base model nor a loaded adapter, where ``DIR/X/`` holds an
adapter, resolves to a model whose load (after admission, like a registry version's) checks and
loads ``DIR/X`` as the adapter ``X``. ``X`` must be one plain path component.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from loraplex.engine.client import AdapterInfo, EngineClient
from loraplex.platform import audit
from loraplex.platform.auth import Caller
from loraplex.platform.errors import APIError
from loraplex.platform.model_resolver import ModelResolver, ResolvedModel

if TYPE_CHECKING:
    from loraplex.lora.adapter import AdapterSummary, BaseModelInfo
    from loraplex.platform.db.database import Database

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 512 * 1024 * 1024  # TenancySettings.max_adapter_bytes' default
CONFIG_NAME = "adapter_config.json"
# A resolver-directory name: one path component, never "." / ".." or hidden.
DIRECTORY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
TOO_LARGE_CODES = frozenset({"too_large", "archive_too_large"})


class OperatorAdapters:
    def __init__(
        self,
        client: EngineClient,
        resolver: ModelResolver,
        *,
        db: Database | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        resolver_dir: Path | None = None,
    ) -> None:
        """``db``: the platform's database, for the audit rows (None: log only).
        ``resolver_dir``: ``--lora-resolver-dir`` (the resolver then asks this component for
        operator models it does not know)."""
        self.client = client
        self.resolver = resolver
        self.db = db
        self.max_bytes = max_bytes
        self.resolver_dir = resolver_dir
        self._base: BaseModelInfo | None = None
        if resolver_dir is not None:
            resolver.directory = self.from_directory

    # ---- load / unload -----------------------------------------------------------------------

    async def load(self, name: str, path: str, *, pinned: bool = False) -> AdapterInfo:
        """Check and load the adapter at ``path`` as ``name``: 400 for a taken name, a bad
        adapter or weights loaded under another name already, 413 when too large."""
        async with self.resolver.lock:
            self.resolver.check_new_name(name)
            info = await self._load(name, path, pinned=pinned)
        await self._audit("operator_adapter.load", name, after=_snapshot(info, path))
        return info

    async def unload(self, name: str) -> None:
        """Remove the operator's adapter ``name`` (404 when there is none, 409 while requests
        use it). The engine copy goes with the last name the operator holds it under."""
        async with self.resolver.lock:
            entry = self.resolver.get_adapter(Caller("operator"), name)
            if entry is None or entry.adapter is None:
                raise APIError(
                    404,
                    f"No adapter named {name!r} is loaded; GET /v1/models lists them.",
                    param="lora_name",
                    code="adapter_not_found",
                )
            info = entry.adapter
            if self.resolver.names_of(info.key) == [name]:
                try:
                    await self.client.remove_lora(info.key)
                except ValueError as exc:  # still in use by running requests
                    raise APIError(
                        409, str(exc), param="lora_name", code="adapter_in_use"
                    ) from None
            self.resolver.remove_adapter(name)
        await self._audit("operator_adapter.unload", name, before=_snapshot(info, None))

    async def _load(
        self, name: str, path: str, *, pinned: bool, alias: bool = False
    ) -> AdapterInfo:
        """Check, load and list ``path`` as ``name``; call with the resolver's lock held."""
        await self._check(path)
        try:
            info = await self.client.add_lora(name, path, pinned=pinned)
        except ValueError as exc:  # AdapterError (a ValueError with a .code), without torch
            raise _refused(exc) from None
        try:
            self.resolver.add_adapter(info, alias=alias)
        except APIError:
            if not self.resolver.names_of(info.key):  # nobody else holds the operator's copy
                await self.client.remove_lora(info.key)
            raise
        return info

    # ---- validation --------------------------------------------------------------------------

    async def _check(self, path: str) -> None:
        """The upload's checks on ``path``, in a worker thread."""
        try:
            summary = await anyio.to_thread.run_sync(self._check_sync, path)
        except ValueError as exc:
            raise _refused(exc) from None
        if summary is None:
            return
        served = self.client.info.lora_target_modules
        unserved = sorted(set(summary.target_modules) - set(served))
        if unserved:
            raise APIError(
                400,
                f"The adapter was refused: LoRA on {', '.join(unserved)} is not served by this "
                f"engine, which applies adapters to {', '.join(served) or 'no module'}; retrain "
                "with target_modules among those.",
                param="lora_path",
                code="unsupported_target",
            )

    def _check_sync(self, path: str) -> AdapterSummary | None:
        """``check_adapter`` against the base model; None where the base model's config
        cannot be read here (an engine without a model directory: tests' fakes), leaving the
        engine's own load checks, which are the same but for the byte limit and targets."""
        from loraplex.lora.adapter import check_adapter
        from loraplex.platform.registry.validate import base_model_info

        if self._base is None:
            try:
                self._base = base_model_info(self.client.info.model_dir)
            except (OSError, ValueError) as exc:
                logger.warning("operator adapters: the base model's config is unreadable: %s", exc)
                return None
        return check_adapter(
            path, self._base, max_rank=self.client.info.max_lora_rank, max_bytes=self.max_bytes
        )

    # ---- the resolver directory --------------------------------------------------------------

    def from_directory(self, caller: Caller, name: str) -> ResolvedModel | None:
        """``name`` as an adapter of ``--lora-resolver-dir`` (the resolver's fallback for
        operator callers): a model loaded by ``prepare``, after admission; None when
        ``DIR/name/`` holds no adapter config. Reads one directory entry, nothing more."""
        if self.resolver_dir is None or not DIRECTORY_NAME.fullmatch(name):
            return None
        path = self.resolver_dir / name
        if not (path / CONFIG_NAME).is_file():
            return None

        async def load() -> str:
            return await self._load_from_directory(name, str(path))

        return ResolvedModel(name, None, caller.cache_extra_keys, load=load)

    async def _load_from_directory(self, name: str, path: str) -> str:
        """The engine key of ``name``, loading ``path`` unless a concurrent request did."""
        async with self.resolver.lock:
            entry = self.resolver.get_adapter(Caller("operator"), name)
            if entry is not None and entry.adapter is not None:
                return entry.adapter.key
            try:
                info = await self._load(name, path, pinned=False)
            except APIError as exc:
                raise APIError(
                    exc.status if exc.status != 400 else 422,
                    f"The adapter {name} in the server's resolver directory could not be "
                    f"loaded: {exc.message}",
                    param="model",
                    code=exc.code or "adapter_failed",
                ) from None
        logger.info("operator adapters: loaded %s from the resolver directory", name)
        await self._audit("operator_adapter.load", name, after=_snapshot(info, path))
        return info.key

    # ---- start-up (--lora-modules) -----------------------------------------------------------

    async def load_modules(self, modules: list[tuple[str, str]]) -> None:
        """``--lora-modules``: pinned, checked like any load; a path named twice (KServe names
        each adapter twice) is one engine copy under both names."""
        loaded: dict[str, AdapterInfo] = {}
        async with self.resolver.lock:
            for name, path in modules:
                self.resolver.check_new_name(name)
                known = loaded.get(path)
                if known is None:
                    loaded[path] = await self._load(name, path, pinned=True, alias=True)
                else:
                    self.resolver.add_adapter(_renamed(known, name), alias=True)

    # ---- audit -------------------------------------------------------------------------------

    async def _audit(
        self,
        action: str,
        name: str,
        *,
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
    ) -> None:
        logger.info("operator adapters: %s %s", action, name)
        if self.db is None:
            return
        await self.db.run(
            lambda s: audit.record(
                s, audit.ADMIN_ACTOR, action, "operator_adapter", name, before=before, after=after
            )
        )


def _renamed(info: AdapterInfo, name: str) -> AdapterInfo:
    return dataclasses.replace(info, name=name)


def _snapshot(info: AdapterInfo, path: str | None) -> dict[str, Any]:
    """The audit row's fields (the path is the operator's own, so it may be recorded)."""
    out: dict[str, Any] = {
        "content_sha256": info.key,
        "rank": info.rank,
        "target_modules": list(info.target_modules),
        "size_bytes": info.size_bytes,
    }
    if path is not None:
        out["lora_path"] = path
    return out


def _refused(exc: ValueError) -> APIError:
    """The answer to an adapter the checks or the engine refused (``AdapterError``)."""
    code = str(getattr(exc, "code", None) or "invalid_adapter")
    message = (getattr(exc, "message", None) or str(exc)).rstrip(".")
    return APIError(
        413 if code in TOO_LARGE_CODES else 400,
        f"The adapter was refused: {message}.",
        param="lora_path",
        code=code,
    )
