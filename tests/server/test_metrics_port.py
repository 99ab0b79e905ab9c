"""The model server protocol's contract, as the Kubernetes inference stack's endpoint picker reads
it (Gateway API Inference Extension / llm-d): a real ``loraplex serve`` with the platform on, in
gateway mode, two tenants each with an adapter named ``bot``; ``--metrics-port`` scraped with no
credentials and parsed with ``prometheus_client``'s parser; the picker's rules applied."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils.serve import Serve

ADMIN = "lpx-admin-metrics-port-0123456789"
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PickerView:
    """What the endpoint picker takes from one scrape (its rules, not ours)."""

    def __init__(self, text: str) -> None:
        samples: dict[str, list[Any]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)
        self.samples = samples

    def gauge(self, name: str) -> float:
        (sample,) = self.samples[name]
        assert sample.labels.get("model_name") == MODEL, sample.labels
        return float(sample.value)

    @property
    def kv_usage(self) -> float:
        return self.gauge("vllm:kv_cache_usage_perc")

    def lora(self) -> tuple[int, list[str], list[str]]:
        """``lora_requests_info``: the series with the largest value; lists split on ',' and
        trimmed; max_lora an integer."""
        latest = max(self.samples["vllm:lora_requests_info"], key=lambda s: s.value)
        labels = latest.labels

        def split(text: str) -> list[str]:
            return [name.strip() for name in text.split(",") if name.strip()]

        return (
            int(labels["max_lora"]),
            split(labels["running_lora_adapters"]),
            split(labels["waiting_lora_adapters"]),
        )


def _scrape(base: str) -> PickerView:
    r = httpx.get(f"{base}/metrics", timeout=5)  # no credentials
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return PickerView(r.text)


def _tenant_with_adapter(base: str, tenant: str, adapter: str) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{base}/admin/api/tenants", headers=admin, json={"name": tenant})
    assert r.status_code in (200, 201), r.text
    r = httpx.post(f"{base}/admin/api/tenants/{tenant}/keys", headers=admin, json={})
    assert r.status_code in (200, 201), r.text
    key = {"Authorization": f"Bearer {r.json()['key']}"}
    files = [
        ("files", (f, Path(adapter, f).read_bytes()))
        for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    r = httpx.post(
        f"{base}/v1/adapters", headers=key, data={"name": "bot"}, files=files, timeout=60
    )
    assert r.status_code in (200, 201), r.text
    return key


@pytest.mark.slow
def test_endpoint_picker_reads_the_metrics_port(tiny_model: str, tmp_path: Path) -> None:
    from tests.utils.models import make_adapter

    adapters = [
        make_adapter(tiny_model, tmp_path / f"a{i}", 4, 8, ["q_proj", "v_proj"], seed=i)
        for i in range(2)
    ]
    metrics_port = _free_port()
    server = Serve(
        [tiny_model, "--served-model-name", MODEL, "--max-model-len", "128", "--max-num-seqs", "1",
         "--data-dir", str(tmp_path / "data"), "--metrics-port", str(metrics_port),
         "--gateway-mode"],
        env={"LORAPLEX_ADMIN_TOKEN": ADMIN, "LORAPLEX_MAX_LORAS": "2"},
    ).start()  # fmt: skip
    metrics = f"http://127.0.0.1:{metrics_port}"
    try:
        keys = {
            t: _tenant_with_adapter(server.base, t, a)
            for t, a in zip(("acme", "globex"), adapters, strict=True)
        }

        # Gateway mode: one string per adapter, the same in /v1/models and in the metrics.
        listed = httpx.get(f"{server.base}/v1/models", headers=keys["acme"]).json()["data"]
        assert {m["id"] for m in listed} == {MODEL, "acme/bot", "acme/bot@1"}
        chat = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2}
        for other in ("bot", "globex/bot"):  # a bare name, another tenant's: no such model
            r = httpx.post(f"{server.base}/v1/chat/completions", headers=keys["acme"],
                           json={**chat, "model": other}, timeout=60)  # fmt: skip
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

        idle = _scrape(metrics)
        assert idle.lora() == (2, [], [])  # adapters enabled: the series is there, lists empty
        assert 0.0 <= idle.kv_usage <= 1.0
        (config,) = idle.samples["vllm:cache_config_info"]
        assert int(config.labels["block_size"]) > 0 and int(config.labels["num_gpu_blocks"]) > 0

        # One seat: each tenant's four long requests run one at a time, the rest wait.
        done: list[int] = []

        def generate(tenant: str) -> None:
            body = {"model": f"{tenant}/bot", "prompt": "t1 t2 t3", "max_tokens": 100,
                    "ignore_eos": True, "temperature": 0}  # fmt: skip
            r = httpx.post(f"{server.base}/v1/completions", headers=keys[tenant], json=body,
                           timeout=120)  # fmt: skip
            done.append(r.status_code)

        threads = [
            threading.Thread(target=generate, args=(t,))
            for _ in range(4)
            for t in ("acme", "globex")
        ]
        for t in threads:
            t.start()
        running_seen: set[str] = set()
        waiting_seen: set[str] = set()
        busy = 0.0
        while any(t.is_alive() for t in threads):
            view = _scrape(metrics)
            _, running, waiting = view.lora()
            running_seen.update(running)
            waiting_seen.update(waiting)
            busy = max(busy, view.gauge("vllm:num_requests_running"))
            assert view.gauge("vllm:num_requests_running") <= 1  # requests, one seat
            assert 0.0 <= view.kv_usage <= 1.0
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert done == [200] * 8
        assert busy == 1
        # The picker's affinity key (the request's model) is listed while it runs and waits:
        # with one seat, every snapshot taken while both tenants have requests out lists one
        # running and the other waiting (which one runs at a 0.5 s snapshot is timing: a fast
        # runner finished all of one tenant's requests between two snapshots).
        names = {"acme/bot", "acme/bot@1", "globex/bot", "globex/bot@1"}
        assert running_seen & {"acme/bot", "globex/bot"}, running_seen
        assert running_seen <= names and waiting_seen <= names, (running_seen, waiting_seen)
        assert {"acme/bot", "globex/bot"} <= running_seen | waiting_seen, (
            running_seen,
            waiting_seen,
        )

        deadline = time.monotonic() + 5  # the next snapshot: nothing runs or waits
        while True:
            after = _scrape(metrics)
            if after.lora()[1:] == ([], []) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert after.lora() == (2, [], [])
        assert (
            after.gauge("vllm:num_requests_running")
            == after.gauge("vllm:num_requests_waiting")
            == 0
        )

        # The metrics port serves /metrics and nothing else; the main port keeps its token.
        assert httpx.get(f"{metrics}/v1/models", headers=keys["acme"]).status_code == 404
        assert httpx.get(f"{metrics}/health").status_code == 404
        assert httpx.get(f"{metrics}/admin/login").status_code == 404
        assert httpx.post(f"{metrics}/metrics").status_code == 405
        assert httpx.get(f"{server.base}/metrics").status_code == 401
        assert httpx.get(f"{server.base}/metrics", headers=keys["acme"]).status_code == 403
        main = httpx.get(f"{server.base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert main.status_code == 200 and "vllm:lora_requests_info" in main.text
        assert "loraplex_requests_total" in main.text  # beside our own families
    finally:
        assert server.stop() == 0
