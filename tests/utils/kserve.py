"""The argv KServe's ``LLMInferenceServiceConfig`` gives ``vllm serve`` for a LoRA service.

``TEMPLATE`` is the ``eval`` line of KServe's ``config/llmisvcconfig/config-llm-template.yaml``
(kserve/kserve at aaac4e2, August 2026) with its Go template rendered for model ``tiny`` in
namespace ``ns``, TLS on (``.GlobalConfig.EnableTLS``), and the shell variables its script sets
when ``vllm --version`` does not print a vLLM version (``ACCESS_LOG_ARGS`` =
``--disable-uvicorn-access-log``, no shutdown-timeout and no KV-transfer arguments).
``controller_args`` is what ``addLoRAVLLMArgs`` (``pkg/controller/v1alpha2/llmisvc/
workload_lora.go``) appends for two adapters with every LoRA field set: each adapter under its
name and under ``publishers/<ns>/models/<name>``, each JSON object single-quoted for the eval.
``kserve_argv`` runs the template's own ``eval`` in bash (printing the words instead of
``exec vllm``), so the quoting is bash's, not ours. Paths are the test's own.
"""

from __future__ import annotations

import json
import subprocess

TEMPLATE = (
    'serve {model} --served-model-name "tiny" "publishers/ns/models/tiny" --port 8000 '
    "${{ACCESS_LOG_ARGS}} ${{SHUTDOWN_TIMEOUT_ARGS}} ${{KV_TRANSFER_ARGS}}  "
    "--enable-ssl-refresh --ssl-certfile {cert} --ssl-keyfile {key} "
    "${{VLLM_ADDITIONAL_ARGS}} $@"
)


def controller_args(adapters: dict[str, str]) -> list[str]:
    """``addLoRAVLLMArgs`` with MaxRank 64, MaxAdapters 2, MaxCpuAdapters 4."""
    modules = []
    for name, path in sorted(adapters.items()):
        for served in (name, f"publishers/ns/models/{name}"):
            modules.append(
                "'" + json.dumps({"name": served, "path": path}, separators=(",", ":")) + "'"
            )
    return [
        "--enable-lora",
        "--max-lora-rank=64",
        "--max-loras=2",
        "--max-cpu-loras=4",
        "--lora-modules",
        *modules,
    ]


def kserve_argv(model: str, cert: str, key: str, adapters: dict[str, str]) -> list[str]:
    """The words ``vllm`` receives (without the program name): bash's own ``eval`` of the
    template with the controller's arguments as ``$@``."""
    line = TEMPLATE.format(model=model, cert=cert, key=key)
    script = (
        'ACCESS_LOG_ARGS="--disable-uvicorn-access-log"; SHUTDOWN_TIMEOUT_ARGS=""; '
        'KV_TRANSFER_ARGS=""; eval "printf \'%s\\0\' ' + line + '"'
    )
    done = subprocess.run(
        ["bash", "-c", script, "--", *controller_args(adapters)],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    return done.stdout.split("\0")[:-1]
