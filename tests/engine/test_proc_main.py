"""The engine process's side of the pipe, without a process or a model: typed call records are
served by their type, replies (and errors) go back under the call's id, and the records pickle."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from loraplex.engine.client import AdapterInfo
from loraplex.engine.proc_main import (
    AddLoRA,
    Call,
    EngineCall,
    GetStats,
    RemoveLoRA,
    Reply,
    SetTenantWeights,
    _handle,
    call_core,
)


@dataclass
class FakeAdapter:
    content_hash: str
    name: str
    rank: int = 4
    target_modules: tuple[str, ...] = ("q_proj",)
    size_bytes: int = 128


@dataclass
class FakeCore:
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def add_lora(self, name: str, path: str, pinned: bool = False) -> FakeAdapter:
        self.calls.append(("add_lora", name, path, pinned))
        return FakeAdapter(f"hash-of-{path}", name)

    def remove_lora(self, key: str) -> None:
        self.calls.append(("remove_lora", key))
        if key == "busy":
            raise ValueError("adapter busy is in use by 1 request(s)")

    def stats(self) -> dict[str, Any]:
        self.calls.append(("stats",))
        return {"num_running": 0}

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        self.calls.append(("set_tenant_weights", weights))


@dataclass
class FakeConn:
    sent: list[Any] = field(default_factory=list)

    def send(self, msg: Any) -> None:
        pickle.dumps(msg)  # what goes over the pipe must pickle
        self.sent.append(msg)


def test_each_call_is_served_by_its_type() -> None:
    core = FakeCore()
    c = cast(Any, core)
    info = call_core(c, AddLoRA("a", "/p", pinned=True))
    assert info == AdapterInfo("hash-of-/p", "a", 4, ("q_proj",), 128)
    assert call_core(c, RemoveLoRA("k")) is None
    assert call_core(c, GetStats()) == {"num_running": 0}
    assert call_core(c, SetTenantWeights({"t": 2.0})) is None
    assert core.calls == [
        ("add_lora", "a", "/p", True),
        ("remove_lora", "k"),
        ("stats",),
        ("set_tenant_weights", {"t": 2.0}),
    ]


def test_an_unknown_call_is_refused() -> None:
    @dataclass(frozen=True)
    class Reboot(EngineCall[None]):
        pass

    with pytest.raises(TypeError, match="unknown engine call Reboot"):
        call_core(cast(Any, FakeCore()), Reboot())


def test_replies_and_errors_go_back_under_the_call_id() -> None:
    conn, core = FakeConn(), cast(Any, FakeCore())
    _handle(cast(Any, conn), core, Call(7, GetStats()))
    _handle(cast(Any, conn), core, Call(8, RemoveLoRA("busy")))
    ok, failed = conn.sent
    assert isinstance(ok, Reply) and (ok.call_id, ok.value, ok.error) == (
        7,
        {"num_running": 0},
        None,
    )
    assert isinstance(failed, Reply) and failed.call_id == 8
    assert isinstance(failed.error, ValueError) and "in use" in str(failed.error)


@pytest.mark.parametrize(
    "call", [AddLoRA("a", "/p", True), RemoveLoRA("k"), GetStats(), SetTenantWeights({"t": 2.0})]
)
def test_call_records_pickle(call: EngineCall[Any]) -> None:
    wire = pickle.loads(pickle.dumps(Call(3, call)))
    assert wire.call_id == 3 and wire.call == call and type(wire.call) is type(call)
