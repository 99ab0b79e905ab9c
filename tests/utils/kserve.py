"""KServe's ``LLMInferenceServiceConfig`` start script for a LoRA service, run as KServe runs it.

``SCRIPT`` is the container command of KServe's ``config/llmisvcconfig/config-llm-template.yaml``
(kserve/kserve at aaac4e2, August 2026) from its vLLM version checks to its ``eval "exec vllm
serve ..."``, with the Go template rendered by hand for model ``tiny`` in namespace ``ns``, TLS
on (``.GlobalConfig.EnableTLS``), no tensor parallelism and no KV offloading. The RoCE block
before it runs only with ``KSERVE_INFER_ROCE=true`` and is left out. Go's ``{{-`` trims the
whitespace before it, so the rendered line reads ``${KV_TRANSFER_ARGS} \\ \\``. Inside the
eval's double quotes that leaves ``\\ `` in the string, and the eval makes it a word of one
space, which ``vllm`` receives as an argument.

``controller_args`` is what ``addLoRAVLLMArgs`` (``pkg/controller/v1alpha2/llmisvc/
workload_lora.go``) puts first in the container's args for two adapters with every LoRA field
set: each adapter under its name and under ``publishers/<ns>/models/<name>``, each JSON object
single-quoted for the eval. The script gets them as ``$@``.

The script runs in bash, with a ``vllm`` of our own first on ``PATH`` (``vllm_shim``): it is
loraplex, as in loraplex's image, where ``vllm`` links to ``loraplex``. The only changes to
KServe's text are the paths: the model directory and the TLS directory are the test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
# --disable-access-log-for-endpoints landed in vLLM 0.16.0 (vllm-project/vllm#30011).
# Older versions still need the blanket --disable-uvicorn-access-log.
ACCESS_LOG_ARGS="--disable-uvicorn-access-log"
VLLM_VERSION=$(vllm --version 2>/dev/null | tail -1 | awk '{print $NF}')
echo "[access-log-detect] vllm version='${VLLM_VERSION}'"
if [[ "$VLLM_VERSION" =~ ^[0-9]+\.[0-9]+ ]] && [ "$(printf '%s\n%s\n' "0.16.0" "${VLLM_VERSION}" | sort -V | head -1)" = "0.16.0" ]; then
  ACCESS_LOG_ARGS="--disable-access-log-for-endpoints /health,/metrics,/ping"
fi
echo "[access-log-detect] selected ACCESS_LOG_ARGS='${ACCESS_LOG_ARGS}'"

# --shutdown-timeout landed in vLLM 0.18.0 (vllm-project/vllm#36666).
SHUTDOWN_TIMEOUT_ARGS=""
if [[ "$VLLM_VERSION" =~ ^[0-9]+\.[0-9]+ ]] && [ "$(printf '%s\n%s\n' "0.18.0" "${VLLM_VERSION}" | sort -V | head -1)" = "0.18.0" ]; then
  SHUTDOWN_TIMEOUT_ARGS="--shutdown-timeout 15"
fi

# --kv-transfer-config with OffloadingConnector requires vLLM 0.22.0+ (vllm-project/vllm#40020).
KV_TRANSFER_ARGS=""
if [[ "$VLLM_VERSION" =~ ^[0-9]+\.[0-9]+ ]] && [ "$(printf '%s\n%s\n' "0.22.0" "${VLLM_VERSION}" | sort -V | head -1)" = "0.22.0" ]; then
  if [[ "${VLLM_ADDITIONAL_ARGS:-}" != *"--kv-transfer-config"* ]] && [[ "${VLLM_ADDITIONAL_ARGS:-}" != *"--kv_transfer_config"* ]] && [[ "$*" != *"--kv-transfer-config"* ]] && [[ "$*" != *"--kv_transfer_config"* ]]; then
    KV_TRANSFER_ARGS=""
  fi
fi

eval "exec vllm serve /mnt/models \
  --served-model-name "tiny" "publishers/ns/models/tiny" \
  --port 8000 \
  ${ACCESS_LOG_ARGS} \
  ${SHUTDOWN_TIMEOUT_ARGS} \
  ${KV_TRANSFER_ARGS} \ \
  --enable-ssl-refresh \
  --ssl-certfile /var/run/kserve/tls/tls.crt \
  --ssl-keyfile /var/run/kserve/tls/tls.key \
  ${VLLM_ADDITIONAL_ARGS} \
  $@"
"""


def controller_args(adapters: dict[str, str]) -> list[str]:
    """``addLoRAVLLMArgs`` with MaxRank 64, MaxAdapters 2, MaxCpuAdapters 4."""
    modules = []
    for name, path in sorted(adapters.items()):
        for served in (name, f"publishers/ns/models/{name}"):
            module = json.dumps({"name": served, "path": path}, separators=(",", ":"))
            modules.append(f"'{module}'")
    return [
        "--enable-lora",
        "--max-lora-rank=64",
        "--max-loras=2",
        "--max-cpu-loras=4",
        "--lora-modules",
        *modules,
    ]


def script(model: str, tls_dir: str) -> str:
    return SCRIPT.replace("/mnt/models", model).replace("/var/run/kserve/tls", tls_dir)


def vllm_shim(folder: Path, argv_file: Path | None = None) -> dict[str, str]:
    """A ``vllm`` command in ``folder`` that is loraplex (with ``argv_file``: ``vllm serve``
    writes its arguments there, NUL-separated, instead of serving); the environment that puts
    it first on ``PATH``."""
    folder.mkdir(parents=True, exist_ok=True)
    run = f'exec "{sys.executable}" -m loraplex.cli "$@"'
    body = f"#!/bin/sh\n{run}\n"
    if argv_file is not None:
        body = (
            "#!/bin/sh\n"
            f'if [ "$1" = --version ]; then {run}; fi\n'
            f"printf '%s\\0' \"$@\" > '{argv_file}'\n"
        )
    shim = folder / "vllm"
    shim.write_text(body)
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}


def kserve_command(model: str, tls_dir: str, adapters: dict[str, str]) -> list[str]:
    """The container's command and args: bash running the script, the controller's as ``$@``."""
    return ["bash", "-c", script(model, tls_dir), "--", *controller_args(adapters)]


def kserve_argv(folder: Path, model: str, tls_dir: str, adapters: dict[str, str]) -> list[str]:
    """The words ``vllm`` receives (without the program name), KServe's script run in bash."""
    argv_file = folder / "argv"
    env = vllm_shim(folder / "bin", argv_file)
    subprocess.run(
        kserve_command(model, tls_dir, adapters), env=env, check=True, capture_output=True
    )
    return argv_file.read_text().split("\0")[:-1]
