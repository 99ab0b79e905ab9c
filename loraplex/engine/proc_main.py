"""The engine process: build an ``EngineCore``, then serve the client's commands and step while
there is work, sending each step's outputs back in one message.

Both ends of the pipe are ours, so messages are pickled dataclasses; tenant data never crosses as
pickle from outside (adapters cross as paths and are read with safetensors in this process).
Calls the client waits on are typed records (``AddLoRA``, ``RemoveLoRA``, ``GetStats``,
``SetTenantWeights``), each naming its reply type, served by type (``call_core``). This module imports torch only inside the
engine process.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from loraplex.config import EngineConfig
from loraplex.engine.info import AdapterInfo, EngineInfo, EngineStats
from loraplex.engine.records import EngineCoreOutput
from loraplex.engine.request import Request

if TYPE_CHECKING:
    from loraplex.engine.core import EngineCore

logger = logging.getLogger(__name__)
R = TypeVar("R")


# ---- client -> engine ----------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter to load at startup (re-added after a restart under the same key)."""

    name: str
    path: str
    pinned: bool
    key: str


@dataclass(frozen=True)
class Placement:
    """Where one engine process runs (a data-parallel replica's share of the machine): the CPUs
    it may use (its affinity, set before torch loads; empty: all) and, on CUDA, the
    ``CUDA_VISIBLE_DEVICES`` it sees (None: the parent's)."""

    cpus: tuple[int, ...] = ()
    cuda_visible_devices: str | None = None

    def apply(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if self.cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices


@dataclass
class AddRequests:
    requests: list[Request]


@dataclass
class AbortRequests:
    request_ids: list[str]


class EngineCall(Generic[R]):
    """A request the client waits on; ``R`` is the type of its reply (``Reply.value``)."""


@dataclass(frozen=True)
class AddLoRA(EngineCall[AdapterInfo]):
    """Load and validate the adapter at ``path`` (``AdapterError`` when bad)."""

    name: str
    path: str
    pinned: bool = False


@dataclass(frozen=True)
class RemoveLoRA(EngineCall[None]):
    """Forget an adapter (``ValueError`` while requests still use it)."""

    key: str


@dataclass(frozen=True)
class RetryLoRA(EngineCall[bool]):
    """Forget an adapter's load failure: its next request loads it again."""

    key: str


@dataclass(frozen=True)
class GetStats(EngineCall[EngineStats]):
    """``EngineCore.stats()``."""


@dataclass(frozen=True)
class SetTenantWeights(EngineCall[None]):
    """``EngineCore.set_tenant_weights``: tenant id -> share weight, from the next step on."""

    weights: dict[str, float]


@dataclass
class Call:
    """A call on the wire: ``Reply.call_id`` matches the reply to it."""

    call_id: int
    call: EngineCall[Any]


@dataclass
class Shutdown:
    pass


Command = AddRequests | AbortRequests | Call | Shutdown


# ---- engine -> client ----------------------------------------------------------------------


@dataclass
class Ready:
    info: EngineInfo
    adapters: list[tuple[AdapterSpec, AdapterInfo | str]]  # re-added adapter, or why it failed


@dataclass
class StartupFailed:
    message: str


@dataclass
class Outputs:
    outputs: list[EngineCoreOutput]


@dataclass
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass
class RequestFailed:
    request_id: str  # an engine-core (sample) id
    message: str


Message = Ready | StartupFailed | Outputs | Reply | RequestFailed


# ---- the engine side -----------------------------------------------------------------------


def _add_lora(core: EngineCore, call: AddLoRA) -> AdapterInfo:
    return AdapterInfo.from_adapter(core.add_lora(call.name, call.path, call.pinned))


def _remove_lora(core: EngineCore, call: RemoveLoRA) -> None:
    core.remove_lora(call.key)


def _retry_lora(core: EngineCore, call: RetryLoRA) -> bool:
    return core.retry_lora(call.key)


def _get_stats(core: EngineCore, call: GetStats) -> EngineStats:
    return core.stats()


def _set_tenant_weights(core: EngineCore, call: SetTenantWeights) -> None:
    core.set_tenant_weights(call.weights)


# each call record -> what serves it
_HANDLERS: dict[type[EngineCall[Any]], Callable[[EngineCore, Any], Any]] = {
    AddLoRA: _add_lora,
    RemoveLoRA: _remove_lora,
    RetryLoRA: _retry_lora,
    GetStats: _get_stats,
    SetTenantWeights: _set_tenant_weights,
}


def call_core(core: EngineCore, call: EngineCall[R]) -> R:
    """Serve one call record; its reply has the record's reply type."""
    handler = _HANDLERS.get(type(call))
    if handler is None:
        raise TypeError(f"unknown engine call {type(call).__name__}")
    reply: R = handler(core, call)
    return reply


def run_engine(
    conn: Connection,
    config: EngineConfig,
    model_dir: str,
    adapters: list[AdapterSpec],
    num_threads: int,
    tenant_weights: dict[str, float] | None = None,
    placement: Placement | None = None,
) -> None:
    """Entry point of the engine process (``multiprocessing`` spawn target). ``adapters`` and
    ``tenant_weights`` are the client's, given again to an engine that restarts."""
    # Ctrl-C reaches the whole process group; the client decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 1
    try:
        if placement is not None:  # before torch starts its threads
            placement.apply()
        code = _run(conn, config, model_dir, adapters, num_threads, tenant_weights or {})
    except (EOFError, OSError):
        code = 0  # the client went away: nothing left to serve
    except BaseException:
        traceback.print_exc()  # a bug in the engine: the client sees EOF and restarts it
    finally:
        conn.close()
        # Only the standard streams need flushing; skipping interpreter teardown (torch's is
        # slow) makes a clean stop take milliseconds instead of about a second.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(
    conn: Connection,
    config: EngineConfig,
    model_dir: str,
    adapters: list[AdapterSpec],
    num_threads: int,
    tenant_weights: dict[str, float],
) -> int:
    try:
        import torch

        torch.set_num_threads(num_threads)
        from loraplex.engine.core import EngineCore

        core, info = EngineCore.build(config, model_dir)
        call_core(core, SetTenantWeights(tenant_weights))
    except Exception as exc:
        conn.send(StartupFailed(f"{type(exc).__name__}: {exc}"))
        return 1
    loaded: list[tuple[AdapterSpec, AdapterInfo | str]] = []
    for spec in adapters:
        try:
            loaded.append((spec, call_core(core, AddLoRA(spec.name, spec.path, spec.pinned))))
        except Exception as exc:
            loaded.append((spec, f"{type(exc).__name__}: {exc}"))
    # The model, tokenizer and caches live as long as the process: out of the collector's way,
    # so that a full collection, which the steps' garbage triggers, no longer walks them.
    gc.collect()
    gc.freeze()
    conn.send(Ready(info, loaded))
    try:
        _serve(conn, core)
    finally:
        core.close()  # tensor-parallel workers (they also exit on their own once we are gone)
    return 0


def _serve(conn: Connection, core: EngineCore) -> None:
    while True:
        # Idle: block on the pipe (no busy loop). Busy: take what arrived, then step.
        commands: list[Command] = [] if core.has_unfinished_requests() else [conn.recv()]
        while conn.poll():
            commands.append(conn.recv())
        for cmd in commands:
            if isinstance(cmd, Shutdown):
                return
            _handle(conn, core, cmd)
        if core.has_unfinished_requests():
            outputs = core.step()
            if outputs:
                conn.send(Outputs(outputs))


def _handle(conn: Connection, core: EngineCore, cmd: Command) -> None:
    if isinstance(cmd, AddRequests):
        for req in cmd.requests:
            try:
                core.add_request(req)
            except Exception as exc:
                conn.send(RequestFailed(req.request_id, f"{type(exc).__name__}: {exc}"))
    elif isinstance(cmd, AbortRequests):
        core.abort_requests(cmd.request_ids)
    elif isinstance(cmd, Call):
        try:
            reply = Reply(cmd.call_id, value=call_core(core, cmd.call))
        except Exception as exc:
            reply = Reply(cmd.call_id, error=exc)
        try:
            conn.send(reply)
        except OSError:
            raise
        except Exception as exc:  # a value or exception that does not pickle: send its text
            why = reply.error if reply.error is not None else exc
            conn.send(Reply(cmd.call_id, error=RuntimeError(f"{type(why).__name__}: {why}")))


def default_num_threads() -> int:
    """All cores this process may use (affinity, capped by a cgroup quota): the server process
    mostly waits on I/O."""
    from loraplex.cpu_threads import usable_cpus

    return usable_cpus()
