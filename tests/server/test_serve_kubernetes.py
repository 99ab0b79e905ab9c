"""``loraplex serve`` as the Kubernetes inference stack runs vLLM: started by KServe's
LLMInferenceServiceConfig script for a LoRA service, in bash, with ``vllm`` being loraplex as in
its image (TLS, two adapters each under two names, the base model under two names), then driven
as AIBrix's ModelAdapter controller drives vLLM: ``GET /v1/models``,
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` with its exact payloads and
the admin token (the platform is on); a tenant's key is refused."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.utils.kserve import kserve_command, vllm_shim
from tests.utils.models import make_adapter
from tests.utils.serve import Serve

ADMIN = "lpx-admin-kserve-test-0123456789"


def self_signed(tmp_path: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


class TLSServe(Serve):
    """``Serve`` over HTTPS, its command line whole (``args``): ``start`` appends ``--port``
    and waits for /health with the test's CA."""

    def __init__(self, args: list[str], env: dict[str, str], ca: str) -> None:
        super().__init__(args, env)
        self.ca = ca

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, verify=self.ca, timeout=60)

    def start(self) -> TLSServe:
        self.proc = subprocess.Popen(
            [*self.args, "--port", str(self.port)],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        with self.http() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(self.proc.stdout.read() if self.proc.stdout else "server exited")
                try:
                    if http.get("/health", timeout=1).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
        pytest.fail("server did not become healthy in 120 s")


def aibrix(http: httpx.Client, path: str, payload: dict[str, str]) -> httpx.Response:
    """A POST as AIBrix's lora client sends it: Go's json.Marshal of a map[string]string
    (sorted keys, no spaces), Content-Type application/json, the api-key as a bearer token."""
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"}
    return http.post(path, content=body, headers=headers)


def model_ids(http: httpx.Client, token: str) -> set[str]:
    """AIBrix's getModels: ``data[].id`` of GET /v1/models (200 expected)."""
    r = http.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


@pytest.mark.slow
def test_kserve_argv_starts_and_aibrix_loads_and_unloads(tiny_model: str, tmp_path: Path) -> None:
    targets = ["q_proj", "v_proj"]
    lora = {
        name: make_adapter(tiny_model, tmp_path / name, 4, 8, targets, seed=i)
        for i, name in enumerate(("a", "b", "text2sql"))
    }
    cert, _ = self_signed(tmp_path / "tls")
    command = kserve_command(tiny_model, str(tmp_path / "tls"), {"a": lora["a"], "b": lora["b"]})
    env = {**vllm_shim(tmp_path / "bin"), "LORAPLEX_ADMIN_TOKEN": ADMIN,
           "LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_MAX_MODEL_LEN": "128"}  # fmt: skip
    server = TLSServe(command, env, ca=cert).start()
    try:
        with server.http() as http:
            assert model_ids(http, ADMIN) == {
                "tiny", "publishers/ns/models/tiny", "a", "publishers/ns/models/a",
                "b", "publishers/ns/models/b",
            }  # fmt: skip
            chat = {"max_tokens": 3, "messages": [{"role": "user", "content": "t5 t6"}]}
            admin = {"Authorization": f"Bearer {ADMIN}"}
            for model in ("publishers/ns/models/tiny", "publishers/ns/models/a", "b"):
                r = http.post("/v1/chat/completions", headers=admin, json={**chat, "model": model})
                assert r.status_code == 200, (model, r.text)

            # AIBrix: the adapter is not listed, so it loads it, then sees it listed.
            assert "text2sql" not in model_ids(http, ADMIN)
            r = aibrix(http, "/v1/load_lora_adapter",
                       {"lora_name": "text2sql", "lora_path": lora["text2sql"]})  # fmt: skip
            assert r.status_code in (200, 201), r.text
            assert "text2sql" in model_ids(http, ADMIN)
            r = http.post("/v1/chat/completions", headers=admin, json={**chat, "model": "text2sql"})
            assert r.status_code == 200 and r.json()["model"] == "text2sql", r.text

            # A tenant's key reaches neither endpoint, nor sees the operator's adapters.
            r = http.post("/admin/api/tenants", headers=admin, json={"name": "acme"})
            assert r.status_code == 201, r.text
            r = http.post("/admin/api/tenants/acme/keys", headers=admin, json={})
            tenant = {"Authorization": f"Bearer {r.json()['key']}"}
            for path, body in (
                ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": lora["a"]}),
                ("/v1/unload_lora_adapter", {"lora_name": "text2sql"}),
            ):
                r = http.post(path, headers=tenant, json=body)
                assert r.status_code == 403, (path, r.text)
            base = {"tiny", "publishers/ns/models/tiny"}  # the base model's names, no adapter
            assert model_ids(http, tenant["Authorization"].split()[1]) == base
            r = http.post("/v1/chat/completions", headers=tenant,
                          json={**chat, "model": "publishers/ns/models/tiny"})  # fmt: skip
            assert r.status_code == 200 and r.json()["model"] == "tiny", r.text

            r = aibrix(http, "/v1/unload_lora_adapter", {"lora_name": "text2sql"})
            assert r.status_code in (200, 201), r.text
            assert "text2sql" not in model_ids(http, ADMIN)
            audit = http.get("/admin/api/audit", headers=admin,
                             params={"action": "operator_adapter."}).json()  # fmt: skip
            rows = audit["data"] if isinstance(audit, dict) else audit
            assert sorted(row["action"] for row in rows if row["object_id"] == "text2sql") == [
                "operator_adapter.load",
                "operator_adapter.unload",
            ]
    finally:
        assert server.stop() == 0
