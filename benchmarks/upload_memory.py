"""Resident memory of the API process around concurrent refused adapter uploads (issue 12, #5).

    python -m benchmarks.upload_memory [--model DIR] [--size-mb 400] [--uploads 3] [--kinds K,...]

Starts ``loraplex serve`` in a subprocess (platform on, a fresh data directory, a free port,
``LORAPLEX_MAX_CONCURRENT_UPLOADS`` = ``--uploads`` so that every upload is validated at once),
creates a tenant and a key, sends small refused uploads first (so torch and the validator are
loaded), then ``--uploads`` concurrent uploads of ``--size-mb`` MiB each and prints one JSON
object: the server's VmRSS before and after, its peak during the uploads (VmHWM, reset before
them, and VmRSS sampled every few milliseconds), and each answer's status and error code.

The uploads take turns among ``--kinds`` (default: all three), realistic refusals:

* ``wrong_shapes``: an adapter trained on a bigger model (its fan-in is not the base model's
  hidden size): refused from the header, before any tensor data is needed;
* ``lying_header``: a safetensors header whose first tensor claims twice its bytes (the ranges
  overlap): refused from the header;
* ``nan_weights``: shapes valid for the base model (every linear module of every layer) and a
  NaN in the last tensor read: refused only after every byte of tensor data was read and
  checked. Its size is what the base model allows at the highest rank the registry accepts
  (64; e.g. 78 MiB for SmolLM2-135M), or ``--size-mb`` if that is less.

Without ``--model`` the server serves the embedded SmolLM2-135M-Instruct. Body bytes are
generated on the fly: this script holds no upload in memory either.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MiB = 1 << 20
ADMIN = "lpx-admin-upload-memory-0123456789"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = ("wrong_shapes", "lying_header", "nan_weights")
WRONG_RANK = 8  # the wrong-shape adapter's rank: any rank the server accepts
MAX_RANK = 64  # the registry's rank limit (it does not learn the engine's --max-lora-rank)


@dataclass(frozen=True)
class Geometry:
    layers: int
    hidden: int
    intermediate: int
    q: int  # heads * head_dim
    kv: int  # key/value heads * head_dim

    @classmethod
    def of(cls, model_dir: Path) -> Geometry:
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        return cls(
            cfg["num_hidden_layers"],
            cfg["hidden_size"],
            cfg["intermediate_size"],
            heads * head_dim,
            kv_heads * head_dim,
        )

    def fans(self, module: str) -> tuple[int, int]:
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q),
            "k_proj": (h, self.kv),
            "v_proj": (h, self.kv),
            "o_proj": (self.q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]

    def bytes_per_rank(self) -> int:
        """float32 bytes of a full adapter (every module of every layer) per unit of rank."""
        return 4 * self.layers * sum(sum(self.fans(m)) for m in MODULES)


@dataclass(frozen=True)
class Payload:
    """An adapter's two files: the config, the safetensors header (with its length prefix),
    ``data_bytes`` of tensor data (zeros) ending with ``tail``."""

    kind: str
    config: bytes
    prefix: bytes
    data_bytes: int
    tail: bytes = b""

    @property
    def weights_bytes(self) -> int:
        return len(self.prefix) + self.data_bytes


def _name(layer: int, module: str, which: str) -> str:
    parent = "self_attn" if module in MODULES[:4] else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"


def _config(rank: int) -> bytes:
    return json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES),
         "bias": "none", "base_model_name_or_path": "some-org/some-model"}
    ).encode()  # fmt: skip


def _header(shapes: dict[str, tuple[int, int]], lie: bool = False) -> tuple[bytes, int]:
    """The header of ``shapes`` (F32, laid out in the dict's order); ``lie``: the first tensor
    claims twice its bytes. Returns (length prefix + header, data bytes)."""
    header: dict[str, Any] = {}
    offset = 0
    for name in shapes:
        size = 4 * math.prod(shapes[name])
        header[name] = {"dtype": "F32", "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    if lie:
        first = header[next(iter(header))]
        begin, end = first["data_offsets"]
        first["data_offsets"] = [begin, begin + 2 * (end - begin)]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offset


def payload(kind: str, geo: Geometry, size: int, rank: int) -> Payload:
    """A refused adapter of about ``size`` bytes (see the module docstring); ``rank`` is the
    rank of the valid-shape kinds (the server's max rank must allow it)."""
    if kind in ("wrong_shapes", "lying_header"):  # shapes of another model; the lie comes first
        pairs = geo.layers * len(MODULES)
        fan = max(geo.hidden + 1, size // (pairs * 2 * WRONG_RANK * 4))  # any fan-in but hidden
        shapes = {}
        for layer in range(geo.layers):
            for m in MODULES:
                shapes[_name(layer, m, "A")] = (WRONG_RANK, fan)
                shapes[_name(layer, m, "B")] = (fan, WRONG_RANK)
        prefix, data = _header(shapes, lie=kind == "lying_header")
        return Payload(kind, _config(WRONG_RANK), prefix, data)
    shapes = {}
    for layer in range(geo.layers):  # the validator's order: (layer, module name), A then B
        for m in sorted(MODULES):
            fan_in, fan_out = geo.fans(m)
            shapes[_name(layer, m, "A")] = (rank, fan_in)
            shapes[_name(layer, m, "B")] = (fan_out, rank)
    prefix, data = _header(shapes)
    # Laid out in that order, the last tensor read (the last layer's v_proj B) ends the file.
    tail = struct.pack("<f", float("nan")) if kind == "nan_weights" else b""
    return Payload(kind, _config(rank), prefix, data, tail)


BOUNDARY = "loraplex-upload-memory-boundary"


def _parts(p: Payload, name: str) -> tuple[bytes, bytes]:
    def file_part(filename: str) -> bytes:
        return (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()

    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'
    ).encode()
    head += file_part("adapter_config.json") + p.config + b"\r\n"
    head += file_part("adapter_model.safetensors") + p.prefix
    return head, f"\r\n--{BOUNDARY}--\r\n".encode()


def body_length(p: Payload, name: str) -> int:
    head, end = _parts(p, name)
    return len(head) + p.data_bytes + len(end)


async def body(p: Payload, name: str) -> AsyncIterator[bytes]:
    """The multipart body, generated a MiB at a time."""
    head, end = _parts(p, name)
    yield head
    zeros = bytes(MiB)
    remaining = p.data_bytes - len(p.tail)
    while remaining > 0:
        n = min(remaining, MiB)
        yield zeros if n == MiB else zeros[:n]
        remaining -= n
    yield p.tail + end


async def send(http: httpx.AsyncClient, key: str, p: Payload, name: str) -> tuple[int, str]:
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
        "Content-Length": str(body_length(p, name)),
    }
    r = await http.post("/v1/adapters", content=body(p, name), headers=headers)
    try:
        error = r.json().get("error") or {}
    except ValueError:
        error = {}
    return r.status_code, str(error.get("code"))


# ---- the server's memory ---------------------------------------------------------------------


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0; False where not allowed)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Sampler:
    """VmRSS of ``pid`` every ``interval`` s in a thread; ``peak_kb`` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, status_kb(self.pid, "VmRSS"))
            time.sleep(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---- the server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, data_dir: Path, uploads: int) -> tuple[Any, str]:
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "LORAPLEX_ADMIN_TOKEN": ADMIN,
        "LORAPLEX_MAX_CONCURRENT_UPLOADS": str(uploads),
    }
    args = [
        sys.executable, "-m", "loraplex.cli", "serve", str(model), "--served-model-name", "base",
        "--port", str(port), "--data-dir", str(data_dir), "--max-model-len", "64",
        "--num-blocks", "32", "--max-loras", "1", "--max-cpu-loras", "1",
        "--max-lora-rank", str(MAX_RANK), "--log-level", "warning",
    ]  # fmt: skip
    log = (data_dir.parent / "server.log").open("w")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{(data_dir.parent / 'server.log').read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not become healthy in 180 s")


def tenant_key(base: str) -> str:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{base}/admin/api/tenants", headers=admin, json={"name": "mem"}, timeout=30)
    r.raise_for_status()
    r = httpx.post(f"{base}/admin/api/tenants/mem/keys", headers=admin, json={}, timeout=30)
    r.raise_for_status()
    return str(r.json()["key"])


async def _measure(
    base: str, pid: int, key: str, warmups: list[Payload], payloads: list[Payload]
) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        for p in warmups:  # loads torch and the validator: their memory is not the uploads'
            await send(http, key, p, "warmup")
        before = status_kb(pid, "VmRSS")
        hwm_reset = reset_peak(pid)
        started = time.monotonic()
        with Sampler(pid) as sampler:
            answers = await asyncio.gather(
                *(send(http, key, p, f"big{i}") for i, p in enumerate(payloads))
            )
        seconds = time.monotonic() - started
        after = status_kb(pid, "VmRSS")
        hwm = status_kb(pid, "VmHWM")
    peak = max(sampler.peak_kb, hwm if hwm_reset else 0, after)
    return {
        "uploads": len(payloads),
        "upload_mb": [round(p.weights_bytes / MiB, 1) for p in payloads],
        "kinds": [p.kind for p in payloads],
        "answers": [list(a) for a in answers],
        "rss_before_mb": round(before / 1024, 1),
        "rss_after_mb": round(after / 1024, 1),
        "rss_peak_mb": round(peak / 1024, 1),
        "growth_mb": round((after - before) / 1024, 1),
        "peak_growth_mb": round((peak - before) / 1024, 1),
        "peak_from": "VmHWM and sampled VmRSS" if hwm_reset else "sampled VmRSS",
        "seconds": round(seconds, 2),
    }


def measure(
    model: Path | None, size_mb: float, uploads: int, kinds: list[str], work: Path
) -> dict[str, Any]:
    if model is None:
        from loraplex.engine.default_model import resolve_model_dir

        model = Path(resolve_model_dir(None))
    geo = Geometry.of(model)
    size = int(size_mb * MiB)
    rank = max(1, min(MAX_RANK, size // geo.bytes_per_rank()))
    warmups = [payload(k, geo, MiB, 1) for k in KINDS]
    payloads = [payload(kinds[i % len(kinds)], geo, size, rank) for i in range(uploads)]
    proc, base = start_server(model, work / "data", uploads)
    try:
        result = asyncio.run(_measure(base, proc.pid, tenant_key(base), warmups, payloads))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    result["model"] = model.name
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a Hugging Face model directory (default: embedded)")
    p.add_argument("--size-mb", type=float, default=400.0, help="MiB per upload")
    p.add_argument("--uploads", type=int, default=3, help="concurrent uploads")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds takes a comma-separated list drawn from {', '.join(KINDS)}")
    work = Path(tempfile.mkdtemp(prefix="loraplex-upload-memory-"))
    try:
        print(json.dumps(measure(args.model, args.size_mb, args.uploads, kinds, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
