"""``loraplex serve --demo``: a ready-to-try tenant on the embedded SmolLM2.

On every ``--demo`` start: the tenant ``demo`` exists (created once), its previous demo keys are
revoked and one new key is issued (a key is only ever shown when it is made, so each start
prints a fresh one), and the shipped demo adapters are uploaded through the registry like any
tenant upload (validated, versioned, audited) unless the tenant already has them. The adapters
(``demo_adapters/``, about 1 MB each, float16) were trained by ``loraplex.tools.train_adapter`` on the
embedded SmolLM2-135M-Instruct: ``pirate`` answers like a pirate, ``caps`` in capital letters.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread

from loraplex.platform import tenants
from loraplex.platform.db.models import ApiKey
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.errors import APIError

if TYPE_CHECKING:
    from loraplex.platform.components import Platform
    from loraplex.platform.store import Store

DEMO_TENANT = "demo"
DEMO_KEY_NAME = "demo (rotated at each --demo start)"
ACTOR = "admin (serve --demo)"
ADAPTERS_DIR = Path(__file__).with_name("demo_adapters")
DEMO_ADAPTERS: dict[str, str] = {
    "pirate": "answers like a pirate",
    "caps": "answers in capital letters",
}


@dataclass(frozen=True)
class DemoInfo:
    key: str
    adapters: tuple[str, ...]


def _rotate_key(store: Store) -> tuple[str, int]:
    with store.db.session() as session:
        tenant = tenants.get_tenant(session, DEMO_TENANT)
        if tenant is None:
            tenant = tenants.create_tenant(
                session, ACTOR, DEMO_TENANT, display_name="Demo tenant (loraplex serve --demo)"
            )
        scope = TenantScope(session, tenant.id)
        for key in scope.all(ApiKey, ApiKey.name == DEMO_KEY_NAME, ApiKey.revoked_at.is_(None)):
            tenants.revoke_key(session, ACTOR, tenant, key.public_id)
        _, new = tenants.create_key(session, ACTOR, tenant, name=DEMO_KEY_NAME)
        return new.token, tenant.id


async def setup_demo(platform: Platform) -> DemoInfo:
    """Create or refresh the demo tenant; raises ``APIError`` when the served model cannot take
    the demo adapters (they fit the embedded SmolLM2-135M-Instruct only)."""
    from loraplex.platform.registry.upload import STORED_NAME, ReceivedUpload
    from loraplex.platform.registry.validate import CONFIG_NAME, WEIGHTS_NAME

    if platform.tenancy is None:
        raise ValueError("--demo needs the multi-tenant platform (drop --no-platform)")
    store, registry = platform.tenancy.store, platform.tenancy.registry
    token, tenant_id = await anyio.to_thread.run_sync(_rotate_key, store)
    present = {a.name for a in await registry.list_adapters(tenant_id)}
    for name, description in DEMO_ADAPTERS.items():
        if name in present:
            continue
        source = ADAPTERS_DIR / name
        work = Path(tempfile.mkdtemp(prefix="demo-", dir=store.data_dir))
        try:
            config = Path(shutil.copy(source / CONFIG_NAME, work / STORED_NAME["config"]))
            weights = Path(shutil.copy(source / WEIGHTS_NAME, work / STORED_NAME["weights"]))
            received = ReceivedUpload(
                fields={"name": name, "description": description},
                files={"config": config, "weights": weights},
            )
            try:
                await registry.upload(tenant_id, ACTOR, received, work)
            except APIError as exc:
                raise APIError(
                    exc.status,
                    f"the demo adapter {name!r} does not fit the served model ({exc.message}); "
                    "--demo needs the embedded SmolLM2-135M-Instruct (serve without a MODEL)",
                ) from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return DemoInfo(token, tuple(DEMO_ADAPTERS))


def demo_message(info: DemoInfo, base_url: str, base_model: str) -> str:
    first = info.adapters[0]
    return f"""
loraplex demo: tenant {DEMO_TENANT!r}, adapters {", ".join(info.adapters)} (and the base model \
{base_model!r}).
Your demo key (a new one at each --demo start; the previous one is revoked):

    export OPENAI_API_KEY={info.key}

Try it:

    curl {base_url}/v1/chat/completions -H "Authorization: Bearer $OPENAI_API_KEY" \\
      -H "Content-Type: application/json" \\
      -d '{{"model": "{first}", "messages": [{{"role": "user", "content": "What is the capital \
of France?"}}], "max_tokens": 48, "temperature": 0}}'

    python -c '
from openai import OpenAI
client = OpenAI(base_url="{base_url}/v1")  # reads OPENAI_API_KEY
for model in ["{base_model}", {", ".join(f'"{a}"' for a in info.adapters)}]:
    r = client.chat.completions.create(model=model, max_tokens=48, temperature=0,
        messages=[{{"role": "user", "content": "What is the capital of France?"}}])
    print(model, "->", r.choices[0].message.content)
'
"""
