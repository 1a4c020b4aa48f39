"""router/lora_admin.py's bound on runtime adapters (``max_loras``), one layer on its own: which adapter goes to make
room, and the refusal when every one has requests running. The registry and the router core are small in-process
stand-ins here (what ``_make_room`` reads of them: the runtime set, the workers' per-adapter running counts, this
router's in-flight counts); tests/e2e/test_lora_runtime.py runs the bound on a whole cluster."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from proto.worker_pb2 import LoRARuntimeEntry, LoRAStatus, WorkerInfo
from router.lora_admin import LoRAAdmin, LoRAAdminError, pick_lru


class _Registry:
    def __init__(self, names: list[str], running: dict[str, int]) -> None:
        self.entries = {n: LoRARuntimeEntry(path=f"/a/{n}", load_id=n) for n in names}
        self.running = running

    def lora_entries(self) -> dict:
        return dict(self.entries)

    def list(self) -> list[WorkerInfo]:
        w = WorkerInfo(worker_id="d0", role="decode", grpc_address="x:1")
        w.lora_status.extend(LoRAStatus(name=n, running=c) for n, c in self.running.items())
        return [w]


def _admin(reg: _Registry, in_flight: dict[str, int]) -> tuple[LoRAAdmin, list[str]]:
    core = SimpleNamespace(cfg=SimpleNamespace(max_loras=2), lora_in_flight=lambda n: in_flight.get(n, 0))
    admin = LoRAAdmin(core)  # type: ignore[arg-type]
    unloaded: list[str] = []

    def unload(name: str) -> str:
        unloaded.append(name)
        del reg.entries[name]
        return "ok"

    admin.unload = unload  # type: ignore[method-assign]
    return admin, unloaded


def test_pick_lru_takes_the_never_used_then_the_oldest():
    assert pick_lru([], {}) is None
    assert pick_lru(["b", "a", "c"], {"a": 5.0, "b": 1.0, "c": 2.0}) == "b"
    assert pick_lru(["b", "a", "c"], {"a": 5.0}) == "b"  # never used here: by name among those


def test_room_is_made_by_unloading_the_least_recently_used_idle_adapter():
    reg = _Registry(["a", "b", "c"], {"a": 0, "b": 0})  # c just loaded: one over the bound
    admin, unloaded = _admin(reg, {})
    admin.touch("a")
    admin.touch("b")
    admin._make_room(reg, "c")
    assert unloaded == ["a"]
    admin._make_room(reg, "c")  # room already: nothing more goes
    assert unloaded == ["a"]


def test_an_adapter_in_use_is_not_unloaded_and_all_in_use_is_resource_exhausted():
    reg = _Registry(["a", "b", "c"], {"a": 1, "b": 0})  # a worker runs a request under a
    admin, unloaded = _admin(reg, {"b": 1})  # and this router has one in flight under b
    for n in ("a", "b"):
        admin.touch(n)
    with pytest.raises(LoRAAdminError) as e:
        admin._make_room(reg, "c")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.message.startswith("lora_name")
    assert "max_loras=2" in e.value.message and unloaded == []
    reg.running["a"] = 0  # a's request ended: a goes (b still has one in flight here)
    admin._make_room(reg, "c")
    assert unloaded == ["a"]


def test_the_resolver_loads_only_from_inside_its_directory():
    """A model name may hold '/' (vLLM's adapter names do), so the resolver normalizes ``DIR/<model>`` and takes only
    what stays inside DIR: '..' parts never lead a request's name to another directory of the workers' hosts."""
    core = SimpleNamespace(cfg=SimpleNamespace(lora_resolver_dir="/srv/adapters", allow_runtime_lora_updating=True),
                           limits=SimpleNamespace(model_name="tiny", lora_adapters=("served",)))
    admin = LoRAAdmin(core)  # type: ignore[arg-type]
    assert admin.resolvable("team/sql-v2") and admin._resolver_path("team/sql-v2") == "/srv/adapters/team/sql-v2"
    for name in ("a/../../etc", "a/..", "x/../../srv/adapters-other/y", "tiny", "served", "", "bad name"):
        assert not admin.resolvable(name), name
    core.cfg.allow_runtime_lora_updating = False
    assert not admin.resolvable("team/sql-v2")
