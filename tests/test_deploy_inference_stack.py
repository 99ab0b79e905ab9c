"""``deploy/kubernetes/inference-stack``: what the inference stack's components read from the
manifests agrees with what loraplex serves. (The overlay is also a variant of
``tests/test_deploy_manifests.py``: schemas, the command line, probes, pod security.)

* the pod labels the pickers read: ``llm-d.ai/engine-type: vllm`` (vLLM's metric names, which
  loraplex serves), AIBrix's ``model.aibrix.ai/*`` naming the served model, the API port and
  the metrics port the server really listens on;
* one engine per pod, with the metrics port and gateway-mode adapter names on;
* the InferencePool (a custom resource, which kubernetes-validate has no schema for): checked
  field by field against the v1 API (``inference.networking.k8s.io``): the pods it selects,
  its one target port, its endpoint picker reference;
* the endpoint picker's configuration: a well-formed ``EndpointPickerConfig`` whose profile
  scores LoRA affinity, queue and KV cache and refers only to plugins it defines;
* the NetworkPolicy leaves the API port open and fences the metrics port.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraplex.cli import build_parser
from loraplex.engine_args import ENV_PREFIX

OVERLAY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "inference-stack"
POOL_API = "inference.networking.k8s.io/v1"
EPP_API = "inference.networking.x-k8s.io/v1alpha1"
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def resources(folder: Path = OVERLAY) -> list[dict[str, Any]]:
    """The objects the kustomization lists (following listed folders)."""
    out: list[dict[str, Any]] = []
    for entry in yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]:
        path = (folder / entry).resolve()
        if path.is_dir():
            out += resources(path)
        else:
            out += [b for b in yaml.safe_load_all(path.read_text()) if b]
    return out


def one(kind: str) -> dict[str, Any]:
    (found,) = (r for r in resources() if r["kind"] == kind)
    return found


def config_map(name: str) -> dict[str, str]:
    (found,) = (
        r for r in resources() if r["kind"] == "ConfigMap" and r["metadata"]["name"] == name
    )
    return dict(found["data"])


def pod_labels() -> dict[str, str]:
    return dict(one("Deployment")["spec"]["template"]["metadata"]["labels"])


def container() -> dict[str, Any]:
    (found,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(found)


def ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container()["ports"]}


def serve_args(monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The container's command line as loraplex parses it, with its ConfigMaps' environment."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name in ("loraplex-platform", "loraplex-engine"):
        for key, value in config_map(name).items():
            monkeypatch.setenv(key, value)
    command = [*container()["command"], *container()["args"]]
    args, extra = build_parser().parse_known_args(command[1:])
    assert not extra
    return args


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_the_pod_labels_name_what_the_server_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    labels, args = pod_labels(), serve_args(monkeypatch)
    assert all(LABEL_VALUE.fullmatch(v) and len(v) <= 63 for v in labels.values()), labels
    served = config_map("loraplex-platform")["LORAPLEX_SERVED_MODEL_NAME"]
    assert labels["llm-d.ai/engine-type"] == "vllm"  # the metric names loraplex serves
    assert labels["llm-d.ai/model"] == labels["model.aibrix.ai/name"] == served
    assert labels["model.aibrix.ai/engine"] == "vllm"  # AIBrix's lora client: vLLM's routes
    assert labels["adapter.model.aibrix.ai/enabled"] == "true"
    assert int(labels["model.aibrix.ai/port"]) == ports()["http"] == args.port
    assert int(labels["model.aibrix.ai/metric-port"]) == ports()["metrics"] == args.metrics_port


def test_one_engine_per_pod_with_the_metrics_port_and_gateway_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = serve_args(monkeypatch)
    assert args.data_parallel_size == 1
    assert int(container()["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert args.metrics_port not in (None, args.port)
    assert args.gateway_mode and not args.no_platform


def test_the_inference_pool_is_a_valid_v1_pool_of_these_pods() -> None:
    pool = one("InferencePool")
    assert pool["apiVersion"] == POOL_API
    assert set(pool) == {"apiVersion", "kind", "metadata", "spec"}
    assert pool["metadata"]["namespace"] == one("Deployment")["metadata"]["namespace"]
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}  # all three required
    assert set(spec["selector"]) == {"matchLabels"}  # v1 takes labels only
    assert selects(spec["selector"]["matchLabels"], pod_labels())
    assert spec["targetPorts"] == [{"number": ports()["http"]}]  # exactly one, the API's
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", ref["name"])
    assert set(ref["port"]) == {"number"} and 1 <= ref["port"]["number"] <= 65535
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_the_endpoint_picker_scores_lora_affinity() -> None:
    (text,) = config_map("loraplex-epp-config").values()
    config = yaml.safe_load(text)
    assert (config["apiVersion"], config["kind"]) == (EPP_API, "EndpointPickerConfig")
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    used = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert set(used) <= defined
    for scorer in ("lora-affinity-scorer", "queue-scorer", "kv-cache-utilization-scorer"):
        assert used[scorer] > 0, scorer
    assert "max-score-picker" in used


def test_the_metrics_port_is_fenced_and_the_api_port_is_not() -> None:
    policy = one("NetworkPolicy")["spec"]
    assert selects(policy["podSelector"]["matchLabels"], pod_labels())
    by_port = {port["port"]: rule for rule in policy["ingress"] for port in rule["ports"]}
    assert set(by_port) == {"http", "metrics"} and set(by_port) == set(ports())
    assert "from" not in by_port["http"]  # every client, as without the policy
    assert by_port["metrics"]["from"]  # the picker and Prometheus only
