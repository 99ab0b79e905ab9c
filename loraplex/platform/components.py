"""The platform's components, built once, by constructors: ``Platform.build``.

    Platform                       every server
      settings, client, resolver, serving (OpenAI API), metrics, authenticator,
      operator_adapters (vLLM's adapter API; gives the resolver --lora-resolver-dir)
      tenancy: Tenancy | None      the multi-tenant platform (a ``Store``: database + files)
        quotas, usage, budgets, registry, tenants (TenantService), authenticator (tenant keys +
        admin), webhooks (alerts: budgets' crossings, quota refusals, adapter failures, ...),
        request_log (the stored, searchable request log)

Nothing is wired after construction: each component gets what it uses when it is built, the
request log's observers are listed here (``observers``), and ``lifespan`` is the one place that
starts and stops what runs in the background. Routes reach components through ``deps``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from loraplex.engine.client import EngineClient
from loraplex.platform.adapter_metrics import AdapterVersionIndex
from loraplex.platform.admin_token import AdminCredential
from loraplex.platform.auth import Authenticator, OperatorKeyAuthenticator
from loraplex.platform.budget_manager import BudgetManager
from loraplex.platform.metrics import PlatformMetrics
from loraplex.platform.model_resolver import ModelResolver, ServedName
from loraplex.platform.openai.serving import OpenAIServing, ServingConfig
from loraplex.platform.operator_adapters import DEFAULT_MAX_BYTES, OperatorAdapters
from loraplex.platform.quota_db import DatabaseQuotaStore
from loraplex.platform.quotas import QuotaManager, QuotaStore
from loraplex.platform.registry.resolver import RegistryModels
from loraplex.platform.registry.service import Registry
from loraplex.platform.request_log import BodyCap, RecordObserver
from loraplex.platform.request_log_writer import RequestLogCollector, RequestLogWriter
from loraplex.platform.settings import ServerSettings, load_settings
from loraplex.platform.store import Store
from loraplex.platform.tenant_auth import TenantAuthenticator
from loraplex.platform.tenants import TenantService
from loraplex.platform.usage import RETENTION_INTERVAL_S, UsageRecorder, retention_loop
from loraplex.platform.vllm_metrics import AdapterNames, VllmCollector, operator_adapter_names
from loraplex.platform.webhooks.service import WebhookService
from loraplex.platform.webhooks.settings import load_webhook_settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tenancy:
    """The multi-tenant platform's components, on one ``Store``."""

    store: Store
    quotas: QuotaManager
    usage: UsageRecorder
    budgets: BudgetManager
    registry: Registry
    tenants: TenantService
    authenticator: TenantAuthenticator
    request_log: RequestLogWriter
    webhooks: WebhookService

    @classmethod
    def build(cls, store: Store, client: EngineClient, base_name: ServedName) -> Tenancy:
        registry = Registry(store, client, base_name)
        registry.recover()  # before the first request: what a crash left behind
        quota_store: QuotaStore | None = None
        if store.settings.shares_state:  # replicas: one window per tenant, in the database
            quota_store = DatabaseQuotaStore(store.db, lease_ttl=store.settings.quota_lease_ttl_s)
        usage = UsageRecorder(store.db)
        budgets = BudgetManager(store.db, usage, base_name)
        quotas = QuotaManager(store.db, store=quota_store, budgets=budgets)
        request_log = RequestLogWriter(
            store.db, retention_days=store.settings.request_log_retention_days
        )
        request_log.load_caps()
        webhooks = WebhookService(store.db, load_webhook_settings())
        budgets.subscribe(webhooks.budget_alert)
        registry.on_failure(webhooks.adapter_failure)
        return cls(
            store=store,
            quotas=quotas,
            usage=usage,
            budgets=budgets,
            registry=registry,
            tenants=TenantService(store.db, quotas, registry, client),
            authenticator=TenantAuthenticator(store.db, AdminCredential(store.settings)),
            request_log=request_log,
            webhooks=webhooks,
        )


@dataclass(frozen=True)
class Platform:
    settings: ServerSettings
    client: EngineClient
    resolver: ModelResolver
    serving: OpenAIServing
    metrics: PlatformMetrics
    authenticator: Authenticator  # who is calling (tenant keys and the admin token, or one key)
    operator_adapters: OperatorAdapters  # vLLM's load/unload API, --lora-modules, resolver dir
    tenancy: Tenancy | None = None  # None: the single-operator server (--no-platform)

    @classmethod
    def build(
        cls,
        client: EngineClient,
        settings: ServerSettings | None = None,
        *,
        store: Store | None = None,
        tokenizer: object | None = None,
        authenticator: Authenticator | None = None,
    ) -> Platform:
        """``store``: the platform's database and files (None: the single-operator server,
        with ``settings.api_key`` as its one credential). ``tokenizer``: the base model's
        (default: loaded from the engine's model directory on first use). ``authenticator``:
        replaces the default one (tests)."""
        settings = settings or load_settings()
        base_name = ServedName(settings.served_model_name, client)
        tenancy = Tenancy.build(store, client, base_name) if store is not None else None
        registry_models = RegistryModels(tenancy.registry) if tenancy is not None else None
        resolver = ModelResolver(
            base_name,
            tenant_models=registry_models,
            share_base_prefix_cache=store is not None and store.settings.share_prefix_cache,
        )
        operator_adapters = OperatorAdapters(
            client,
            resolver,
            db=store.db if store is not None else None,
            max_bytes=store.settings.max_adapter_bytes if store is not None else DEFAULT_MAX_BYTES,
            resolver_dir=settings.lora_resolver_dir,
        )
        config = ServingConfig(
            max_n=settings.max_n,
            max_prompts=settings.max_prompts,
            default_max_tokens=settings.default_max_tokens,
        )
        quotas = tenancy.quotas if tenancy is not None else None
        serving = OpenAIServing(client, resolver, config, tokenizer, quotas=quotas)
        if authenticator is None:
            if tenancy is not None:
                authenticator = tenancy.authenticator
            else:
                key = settings.api_key.get_secret_value() if settings.api_key else None
                authenticator = OperatorKeyAuthenticator(key)
        platform = cls(
            settings=settings,
            client=client,
            resolver=resolver,
            serving=serving,
            metrics=PlatformMetrics(
                client,
                versions=AdapterVersionIndex(store.db) if store is not None else None,
                db=store.db if store is not None else None,
                max_tenants=settings.metrics_max_tenants,
                max_adapters=settings.metrics_max_adapters,
                vllm=VllmCollector(
                    base_name,
                    AdapterNames(lambda: operator_adapter_names(resolver), registry_models),
                    lambda: client.info.max_loras,
                ),
            ),
            authenticator=authenticator,
            operator_adapters=operator_adapters,
            tenancy=tenancy,
        )
        if tenancy is not None:
            platform.metrics.registry.register(RequestLogCollector(tenancy.request_log))
        return platform

    @property
    def observers(self) -> tuple[RecordObserver, ...]:
        """What sees every finished request (``RequestLogMiddleware``): the metrics, and on
        the platform the quotas (the lease ends), the usage rows and the budgets (which write
        a budgeted request's row at once: after the usage recorder buffered it)."""
        if self.tenancy is None:
            return (self.metrics.observe,)
        tenancy = self.tenancy
        return (self.metrics.observe, tenancy.quotas.observe, tenancy.usage.observe,
                tenancy.budgets.observe, tenancy.request_log.observe,
                tenancy.webhooks.observe)  # fmt: skip

    @property
    def body_cap(self) -> BodyCap | None:
        """How much of each body the request log keeps for a request (None: no bodies)."""
        return self.tenancy.request_log.body_cap if self.tenancy is not None else None

    @asynccontextmanager
    async def lifespan(self, *, own_client: bool) -> AsyncIterator[None]:
        """Start what runs while serving (the engine when ``own_client``, the usage retention,
        the quota store's upkeep, and with shared state the replicas' change feed) and stop it
        afterwards, flushing the quota releases and usage rows still buffered."""
        if own_client:
            await self.client.start()
        background: list[asyncio.Task[None]] = []
        try:
            try:  # before the first request: loading it (transformers, torch) holds the GIL
                await self.serving.tokenizer()
            except Exception as exc:  # the first request that needs it reports the problem
                logger.warning("the base model's tokenizer could not be loaded yet: %s", exc)
            if self.tenancy is not None:
                tenants = self.tenancy.tenants
                await tenants.push_weights()  # the scheduler's tenant shares
                retention = retention_loop(
                    self.tenancy.store.db,
                    self.tenancy.store.settings.usage_retention_days,
                    RETENTION_INTERVAL_S,
                )
                background = [
                    asyncio.create_task(retention, name="usage-retention"),
                    asyncio.create_task(tenants.refresh_weights_forever(), name="tenant-weights"),
                    asyncio.create_task(
                        self.tenancy.quotas.store.maintain_forever(), name="quota-upkeep"
                    ),
                    asyncio.create_task(
                        self.tenancy.request_log.maintain_forever(), name="request-log-upkeep"
                    ),
                    asyncio.create_task(
                        self.tenancy.webhooks.run_forever(self.client), name="webhooks"
                    ),
                ]
                registry, settings = self.tenancy.registry, self.tenancy.store.settings
                if registry.shared:  # other replicas' deletions reach this one's engine
                    feed = registry.follow_changes_forever(settings.replica_poll_s)
                    background.append(asyncio.create_task(feed, name="replica-changes"))
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if self.tenancy is not None:
                await self.tenancy.quotas.store.close()
                await self.tenancy.webhooks.close()
                await self.tenancy.budgets.close()
                await self.tenancy.usage.close()
                await self.tenancy.request_log.close()
            if own_client:
                await self.client.shutdown()
