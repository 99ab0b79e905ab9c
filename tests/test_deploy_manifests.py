"""The Kubernetes manifests in ``deploy/kubernetes/``, checked without a cluster.

Each variant (``cpu``: ``kubectl apply -k deploy/kubernetes``; ``gpu``: ``.../gpu``) is the set
of resources its kustomization lists. Every resource must pass the Kubernetes JSON schemas in
strict mode (``kubernetes-validate``, at pinned Kubernetes versions). Then what a schema cannot
see and a real deploy would trip on:

* the container's command line and environment are a configuration loraplex accepts: parsed by
  ``loraplex``'s own parser with exactly the environment the pod gets (ConfigMaps, Secret,
  the variables Kubernetes adds for Services unless ``enableServiceLinks`` is off), and every
  record and settings object ``serve`` builds from them validates;
* every variable set is one loraplex reads (its settings ignore unknown ``LORAPLEX_*`` names);
* the probes ask routes the app mounts for anyone (the kubelet sends no credential) and they
  answer 200; the probes, the Service and the server agree on the port;
* selectors (Service, PDB, spread) select the platform pods; Secret and ConfigMap references
  resolve; writable paths are volumes under a read-only root; the grace period covers the
  shutdown; GPU pods ask for the GPU their engine uses; the pods meet the namespace's
  "restricted" Pod Security Standard.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from loraplex.cli import build_parser
from loraplex.engine_args import ENV_PREFIX, from_args
from loraplex.platform import access
from loraplex.platform.admin_token import configured_token
from loraplex.platform.engine_state import ENGINE_STATS_TIMEOUT_S
from loraplex.platform.settings import ServerSettings, TenancySettings, load_settings
from loraplex.server.serve import add_serve_arguments, apply_default_policy
from loraplex.webui import load_webui_settings
from loraplex.webui.context import WebUISettings
from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import tenancy_env

try:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError
except ImportError:  # an optional test tool: pip install kubernetes-validate (the test extra)
    kubernetes_validate = None

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "kubernetes"
SOURCE = REPO / "loraplex"
DOCKERFILE = (REPO / "Dockerfile").read_text()
VARIANTS = {"cpu": DEPLOY, "gpu": DEPLOY / "gpu", "inference-stack": DEPLOY / "inference-stack"}
GPU_VARIANTS = {"gpu", "inference-stack"}
# Custom resources: kubernetes-validate bundles the Kubernetes API's own schemas only, so these
# are skipped here and checked field by field in tests/test_deploy_inference_stack.py.
CUSTOM_RESOURCES = {("inference.networking.k8s.io/v1", "InferencePool")}
# The oldest Kubernetes the manifests are for, and the newest the pinned kubernetes-validate
# (1.37.0) has schemas of; strict: unknown fields (a typo, a field of a newer version) fail.
K8S_VERSIONS = ("1.30.0", "1.37.0")
KUSTOMIZE_KEYS = {"apiVersion", "kind", "namespace", "resources", "images"}
PLACEHOLDER = "REPLACE-ME"
A_REAL_TOKEN = "0123456789abcdef" * 4  # what `openssl rand -hex 32` prints, in shape
GPU = "nvidia.com/gpu"


# ---- the manifests, as the kustomizations list them ----------------------------------------


@dataclass(frozen=True)
class Resource:
    path: Path
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


def kustomization(folder: Path) -> dict[str, Any]:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def listed(folder: Path) -> Iterator[Resource]:
    """The resources ``folder``'s kustomization lists, following listed folders (only
    ``resources`` is followed: the kustomizations use no patches, which a test checks)."""
    for entry in kustomization(folder).get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            yield from listed(path)
        else:
            for body in yaml.safe_load_all(path.read_text()):
                if body:
                    yield Resource(path, body)


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


class Variant:
    def __init__(self, name: str) -> None:
        self.name = name
        self.resources = list(listed(VARIANTS[name]))

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [r.body for r in self.resources if r.kind == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [b for b in self.all(kind) if name is None or b["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name or ''}, got {len(found)}"
        return found[0]

    @property
    def deployment(self) -> dict[str, Any]:
        return self.one("Deployment")

    @property
    def pod(self) -> dict[str, Any]:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def pod_labels(self) -> dict[str, str]:
        return self.deployment["spec"]["template"]["metadata"]["labels"]

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod["containers"]  # one container: loraplex serve
        return container

    def secret_data(self, name: str) -> dict[str, str]:
        secret = self.one("Secret", name)
        data = dict(secret.get("stringData", {}))
        data.update({k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()})
        return data


@pytest.fixture(params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> Variant:
    return Variant(request.param)


# ---- the environment the container gets -----------------------------------------------------


def service_link_env(services: list[dict[str, Any]]) -> dict[str, str]:
    """The variables the kubelet adds for each Service of the namespace (``enableServiceLinks``,
    on by default): ``<NAME>_SERVICE_HOST``/``_PORT`` and the Docker-link ones, ``<NAME>_PORT``
    = ``tcp://<cluster ip>:<port>`` among them. An example cluster IP stands in for the real one."""
    env: dict[str, str] = {}
    ip = "10.96.0.10"
    for service in services:
        name = service["metadata"]["name"].upper().replace("-", "_")
        ports = service["spec"]["ports"]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{name}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
        for port in ports:
            proto, number = port.get("protocol", "TCP"), port["port"]
            if "name" in port:
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(number)
            link = f"{name}_PORT_{number}_{proto}"
            env[link] = f"{proto.lower()}://{ip}:{number}"
            env.update({f"{link}_PROTO": proto.lower(), f"{link}_PORT": str(number)})
            env[f"{link}_ADDR"] = ip
    return env


def container_env(
    variant: Variant, secrets: Mapping[str, str] | None = None, *, service_links: bool = True
) -> dict[str, str]:
    """The container's environment as the kubelet builds it (Service links, then ``envFrom``,
    then ``env``); ``secrets``: Secret values to use instead of the manifests' (replaced
    placeholders)."""
    pod, container = variant.pod, variant.container
    env = {}
    if service_links and pod.get("enableServiceLinks", True):
        env.update(service_link_env(variant.all("Service")))
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            data = variant.one("ConfigMap", source["configMapRef"]["name"])["data"]
        else:
            data = variant.secret_data(source["secretRef"]["name"])
        env.update({prefix + k: str(v) for k, v in data.items()})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]
        if "secretKeyRef" in ref:
            key = ref["secretKeyRef"]["key"]
            stored = variant.secret_data(ref["secretKeyRef"]["name"])[key]
            env[item["name"]] = (secrets or {}).get(key, stored)
        elif "configMapKeyRef" in ref:
            cm = variant.one("ConfigMap", ref["configMapKeyRef"]["name"])
            env[item["name"]] = cm["data"][ref["configMapKeyRef"]["key"]]
        else:
            raise AssertionError(f"{item['name']}: no model here for {sorted(ref)}")
    return env


def parse_serve(
    variant: Variant, env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """The container's ``loraplex serve`` command line parsed as ``loraplex`` parses it, in
    exactly ``env`` (the parser reads its defaults from the environment)."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command = [*variant.container["command"], *variant.container.get("args", [])]
    assert command[:2] == ["loraplex", "serve"], command
    args, extra = build_parser().parse_known_args(command[1:])
    assert not extra, f"loraplex does not take {extra}"
    return args


def accept(args: argparse.Namespace) -> TenancySettings:
    """Build what ``serve`` builds from ``args`` and the environment (each validates itself):
    the engine's config, the server's settings, the platform's (returned) and the admin UI's."""
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    for action in serve._actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value is not None:
            # argparse never checks a default (here: the environment's value) against choices
            assert value in action.choices, f"{action.dest}={value!r}: one of {action.choices}"
    from_args(apply_default_policy(args), model=args.model)
    load_settings(
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        metrics_token=args.metrics_token,
        max_request_bytes=args.max_request_bytes,
        default_max_tokens=args.default_max_tokens,
    )
    overrides = {
        "data_dir": args.data_dir,
        "database_url": args.database_url,
        "shared_state": args.shared_state,
    }
    tenancy = TenancySettings(**{k: v for k, v in overrides.items() if v is not None})
    configured_token(tenancy)
    load_webui_settings()
    return tenancy


def env_names_loraplex_reads() -> set[str]:
    """Every ``serve`` flag as ``LORAPLEX_<FLAG>``, every settings field under its prefix, and
    every ``LORAPLEX_*`` name the source spells out (the cache directory, the kernels' switches)."""
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    names = {ENV_PREFIX + a.dest.upper() for a in serve._actions if a.dest != "help"}
    for settings in (ServerSettings, TenancySettings, WebUISettings):
        prefix = settings.model_config["env_prefix"]
        names |= {prefix + field.upper() for field in settings.model_fields}
    literal = re.compile(r"[\"'](LORAPLEX_[A-Z0-9_]*[A-Z0-9])[\"']")
    for path in SOURCE.rglob("*.py"):
        names |= set(literal.findall(path.read_text()))
    return names


# ---- schemas and kustomizations --------------------------------------------------------------


@pytest.mark.skipif(
    kubernetes_validate is None,
    reason="kubernetes-validate is not installed (pip install kubernetes-validate)",
)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_passes_the_kubernetes_schemas_in_strict_mode(version: str) -> None:
    assert kubernetes_validate is not None
    failures = []
    for path in manifest_files():
        for body in yaml.safe_load_all(path.read_text()):
            if (body["apiVersion"], body["kind"]) in CUSTOM_RESOURCES:
                continue
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except SchemaNotFoundError as exc:  # an unknown kind or apiVersion is a failure too
                failures.append(f"{path.relative_to(REPO)}: {exc.message}")
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                failures.append(f"{path.relative_to(REPO)} {body['kind']}: {where}: {exc.message}")
    assert failures == []


def test_the_kustomizations_list_every_manifest_and_nothing_else() -> None:
    folders = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
    for folder in folders:
        extra = set(kustomization(folder)) - KUSTOMIZE_KEYS
        assert not extra, f"{folder}: {extra} is not modelled by these tests (listed())"
        for entry in kustomization(folder).get("resources", []):
            assert (folder / entry).exists(), f"{folder / entry} is listed but missing"
    reached = {r.path for name in VARIANTS for r in listed(VARIANTS[name])}
    assert reached == {p.resolve() for p in manifest_files()}
    kinds = {name: sorted((r.kind, r.name) for r in Variant(name).resources) for name in VARIANTS}
    assert kinds["cpu"] == kinds["gpu"]  # the same objects: one variant replaces the other
    assert {kind for kind, _ in kinds["cpu"]} == {
        "Namespace", "ConfigMap", "Secret", "Service", "Deployment", "PodDisruptionBudget",
    }  # fmt: skip


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_what_the_tests_read(variant: Variant) -> None:
    done = subprocess.run(
        ["kubectl", "kustomize", str(VARIANTS[variant.name])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rendered = [b for b in yaml.safe_load_all(done.stdout) if b]

    def key(body: dict[str, Any]) -> tuple[str, str]:
        return body["kind"], body["metadata"]["name"]

    ours = {key(r.body): r.body for r in variant.resources}
    assert sorted(map(key, rendered)) == sorted(ours)
    for body in rendered:  # kustomize sets the namespace and the image: nothing else changes
        assert body["metadata"].get("namespace", "loraplex") == "loraplex"
        assert body == ours[key(body)] or body["kind"] == "Deployment"
    image = {i["name"]: i for i in kustomization(VARIANTS[variant.name]).get("images", [])}
    (deployment,) = (b for b in rendered if b["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    want = image["loraplex"]
    assert container["image"] == f"{want['newName']}:{want['newTag']}"
    container["image"] = variant.container["image"]
    assert deployment == variant.deployment


# ---- the command line and the environment ------------------------------------------------


def test_the_container_runs_a_configuration_loraplex_accepts(
    variant: Variant, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {"admin-token": A_REAL_TOKEN}  # the operator replaced the placeholder
    args = parse_serve(variant, container_env(variant, secrets), monkeypatch)
    tenancy = accept(args)
    assert variant.deployment["spec"]["replicas"] > 1
    assert tenancy.shares_state  # quotas and admin sessions hold across the replicas
    assert args.host == "0.0.0.0"  # the kubelet's probes and the Service reach the pod's IP
    assert not args.no_platform and not args.demo  # tenants in the database; no demo tenant
    assert not args.engine_in_process  # the supervisor restarts a crashed engine (liveness)
    assert args.database_url and not args.database_url.startswith("sqlite")  # replicas share it
    ports = {p["name"]: p["containerPort"] for p in variant.container["ports"]}
    assert ports == {
        "http": args.port,
        **({"metrics": args.metrics_port} if args.metrics_port else {}),
    }


def test_service_links_would_set_the_port_so_they_are_off(
    variant: Variant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``enableServiceLinks`` on, the Service named loraplex gives every pod
    ``LORAPLEX_PORT=tcp://<ip>:8000``, which loraplex reads as ``--port``."""
    assert variant.pod.get("enableServiceLinks") is False
    env = container_env(variant, {"admin-token": A_REAL_TOKEN}, service_links=False)
    env.update(service_link_env(variant.all("Service")))
    with pytest.raises(ValueError, match="LORAPLEX_PORT='tcp://"):
        parse_serve(variant, env, monkeypatch)


def test_every_variable_set_is_one_loraplex_reads(variant: Variant) -> None:
    known = env_names_loraplex_reads()
    assert {"LORAPLEX_PORT", "LORAPLEX_MAX_LORAS", "LORAPLEX_CACHE_DIR"} <= known
    assert "LORAPLEX_MAX_LORA" not in known  # a typo is not known
    unknown = sorted(set(container_env(variant, service_links=False)) - known)
    assert unknown == [], f"loraplex reads none of {unknown}"


def test_the_placeholder_secrets_are_refused_and_the_url_is_postgresql(variant: Variant) -> None:
    """An unedited Secret stops the pods at start (a published admin token never serves)."""
    data = variant.secret_data("loraplex-secrets")
    assert all(PLACEHOLDER in value for value in data.values()), data
    with pytest.raises(ValueError, match="LORAPLEX_ADMIN_TOKEN must be at least"):
        configured_token(TenancySettings(admin_token=data["admin-token"]))
    from sqlalchemy.engine import make_url

    url = make_url(data["database-url"])
    assert (url.get_backend_name(), url.get_driver_name()) == ("postgresql", "psycopg")
    assert url.host and url.database


def test_secret_and_configmap_references_resolve(variant: Variant) -> None:
    secrets = {s["metadata"]["name"]: set(variant.secret_data(s["metadata"]["name"])) for s in variant.all("Secret")}  # fmt: skip
    configmaps = {c["metadata"]["name"]: set(c["data"]) for c in variant.all("ConfigMap")}
    used: dict[str, set[str]] = {name: set() for name in secrets}
    container = variant.container
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] in configmaps, source
    for item in container.get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]], ref
            assert not ref.get("optional"), ref  # a missing key must stop the pod, not unset it
            used[ref["name"]].add(ref["key"])
    assert used == secrets  # every key of the Secret is given to the container


# ---- probes, ports, selectors ------------------------------------------------------------


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def probes(variant: Variant) -> dict[str, dict[str, Any]]:
    return {kind: variant.container[kind] for kind in PROBES}


def test_the_probes_and_the_service_reach_the_servers_port(variant: Variant) -> None:
    named = {p["name"]: p["containerPort"] for p in variant.container["ports"]}
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(variant.container)
    for kind, probe in probes(variant).items():
        port = probe["httpGet"]["port"]
        assert named.get(port, port) in named.values(), (kind, port)
        assert probe["httpGet"].get("scheme", "HTTP") == "HTTP"
        if probe["httpGet"]["path"] == "/health":  # it waits up to 5 s for the engine's stats
            assert probe["timeoutSeconds"] > ENGINE_STATS_TIMEOUT_S, kind
    for service in variant.all("Service"):
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert named.get(target, target) in named.values(), (service["metadata"], target)
    # Liveness gives the engine supervisor time to restart a crashed engine itself.
    live = probes(variant)["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    start = probes(variant)["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 120  # a model loads


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def platform_http(tmp_path: Path) -> AsyncIterator[Any]:
    """The multi-tenant app (the scripted engine, a fresh database): what ``serve`` mounts.
    No tokenizer: the app loads it at the first request that needs one, which no probe is."""
    fake = FakeEngineClient(model_dir=str(tmp_path / "no-model"))
    async with tenancy_env(tmp_path, fake, None) as env:
        yield env


@pytest.mark.anyio
async def test_the_probes_ask_public_routes_that_answer_200(platform_http: Any) -> None:
    public = {r.path for r in access.mounted_routes(platform_http.app) if r.audience == "public"}
    for name in sorted(VARIANTS):
        for kind, probe in probes(Variant(name)).items():
            path = probe["httpGet"]["path"]
            assert path in public, f"{name} {kind}: {path} is not a public route ({public})"
            response = await platform_http.http.get(path)  # the kubelet sends no credential
            assert response.status_code == 200, (name, kind, path, response.text)


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_the_selectors_select_the_platform_pods(variant: Variant) -> None:
    labels, spec = variant.pod_labels, variant.deployment["spec"]
    assert selects(spec["selector"]["matchLabels"], labels), (spec["selector"], labels)
    for service in variant.all("Service"):
        selector = service["spec"]["selector"]
        assert selects(selector, labels), (service["metadata"]["name"], selector, labels)
    pdb = variant.one("PodDisruptionBudget")["spec"]
    assert selects(pdb["selector"]["matchLabels"], labels), (pdb["selector"], labels)
    # A budget that allows no disruption blocks every node drain.
    replicas = spec["replicas"]
    allowed = pdb["maxUnavailable"] if "maxUnavailable" in pdb else replicas - pdb["minAvailable"]
    assert isinstance(allowed, int) and allowed >= 1, f"the PDB allows {allowed} disruptions"
    assert replicas >= 2, "one replica: every disruption is an outage"
    for spread in variant.pod.get("topologySpreadConstraints", []):
        selector = spread["labelSelector"]["matchLabels"]
        assert selects(selector, labels), ("topologySpreadConstraints", selector, labels)


# ---- the pod: volumes, users, shutdown, GPU, pod security ----------------------------------


def mounts(variant: Variant) -> dict[PurePosixPath, dict[str, Any]]:
    """Mount path -> the volume mounted there."""
    volumes = {v["name"]: v for v in variant.pod["volumes"]}
    return {
        PurePosixPath(m["mountPath"]): {**volumes[m["name"]], "readOnly": m.get("readOnly", False)}
        for m in variant.container["volumeMounts"]
    }


def volume_of(variant: Variant, path: PurePosixPath) -> dict[str, Any] | None:
    """The volume ``path`` lies on (the deepest mount above it); None: the image's filesystem."""
    found = [m for m in mounts(variant) if path == m or m in path.parents]
    return mounts(variant)[max(found, key=lambda m: len(m.parts))] if found else None


def dockerfile_env(name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", DOCKERFILE)
    assert match, f"the Dockerfile sets no {name}"
    return match.group(1)


def test_what_loraplex_writes_is_on_writable_volumes(
    variant: Variant, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = container_env(variant, service_links=False)
    assert variant.container["securityContext"]["readOnlyRootFilesystem"] is True
    # The image's cache holds the model converted at build time: the pod must look there, and
    # no volume may hide it.
    cache = PurePosixPath(env.get("LORAPLEX_CACHE_DIR", dockerfile_env("LORAPLEX_CACHE_DIR")))
    assert str(cache) == dockerfile_env("LORAPLEX_CACHE_DIR")
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(cache))
    from loraplex.engine.default_model import embedded_model_dir
    from loraplex.kernels import native

    model = PurePosixPath(embedded_model_dir().as_posix())
    assert volume_of(variant, model) is None, "a volume hides the image's converted model"
    writes = {
        "the data directory": PurePosixPath(env["LORAPLEX_DATA_DIR"]),
        "the native kernels": PurePosixPath(native._cache_root().as_posix()),
        "temporary files": PurePosixPath("/tmp"),
    }
    for what, path in writes.items():
        volume = volume_of(variant, path)
        assert volume is not None and not volume["readOnly"], f"{what} ({path}) is read-only"
    data = volume_of(variant, writes["the data directory"])
    assert data is not None and writes["the data directory"] not in mounts(variant)  # 0700 below
    # Each pod has its own: with the state shared, a replica writes the adapters it lacks from
    # the database; a shared directory would have each starting replica empty the others'
    # uploads in flight (the registry's recovery clears <data dir>/tmp).
    assert "emptyDir" in data, data


def test_the_pod_runs_as_the_images_user(variant: Variant) -> None:
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", DOCKERFILE).group(1))  # type: ignore[union-attr]
    security = variant.pod["securityContext"]
    assert security["runAsUser"] == uid and security["runAsNonRoot"] is True
    assert security["fsGroup"] == security["runAsGroup"]  # the data volume is the user's group's


def test_the_grace_period_covers_the_graceful_shutdown(
    variant: Variant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM: the HTTP server drains for up to --shutdown-timeout, then the engine does."""
    args = parse_serve(variant, container_env(variant, service_links=False), monkeypatch)
    command = variant.container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    needed = float(command[1]) + 2 * args.shutdown_timeout
    assert variant.pod["terminationGracePeriodSeconds"] >= needed + 5


def test_gpu_pods_ask_for_the_gpus_their_engines_use(
    variant: Variant, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = container_env(variant, service_links=False)
    limits = variant.container["resources"]["limits"]
    on_gpu = env.get("LORAPLEX_DEVICE") == "cuda"
    assert on_gpu == (variant.name in GPU_VARIANTS)
    engines = parse_serve(variant, env, monkeypatch).data_parallel_size
    # one GPU per engine (--data-parallel-size), none on CPU pods
    assert int(limits.get(GPU, 0)) == (engines if on_gpu else 0)
    assert engines <= int(limits["cpu"])  # each engine takes at least one of the pod's CPUs
    if on_gpu:
        assert env["LORAPLEX_DTYPE"] in ("bfloat16", "float16")
        assert any(t["key"] == GPU for t in variant.pod["tolerations"])
        assert variant.pod["nodeSelector"]
    else:
        assert env.get("LORAPLEX_DEVICE") == "cpu" and "nodeSelector" not in variant.pod
        # The KV cache takes at most a quarter of the memory limit: the rest holds the
        # weights, the adapter pool and two Python processes with torch (platform, engine).
        memory = limits["memory"]
        assert memory.endswith("Gi")
        assert int(env["LORAPLEX_KV_CACHE_MEMORY"]) * 4 <= int(memory[:-2]) * 2**30


def test_the_pods_meet_the_restricted_pod_security_standard(variant: Variant) -> None:
    labels = variant.one("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    pod, container = variant.pod, variant.container
    allowed = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected"}
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= allowed, volume
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    assert not security.get("privileged") and "ports" in container
    assert all("hostPort" not in p for p in container["ports"])
