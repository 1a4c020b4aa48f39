"""LoRA adapters loaded and unloaded while a whole cluster runs (Ray actors, the Redis registry, gRPC on loopback,
KV over gloo), as vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` do it for one server.

One cluster for the module: one prefill and one decode worker started without adapters (each runs its engine in a
process of its own, so a load goes through the engine process's calls), a router with
``allow_runtime_lora_updating`` and its HTTP API. Two PEFT adapters of the tiny model
(tests/roles/test_lora_cluster.py makes them). The reference for every answer is the offline engine given the same
adapter at start. In order:

1. a load through HTTP answers once every worker serves the adapter: /v1/models lists it at once and its greedy
   answer, through gRPC and the OpenAI client, is the offline engine's with that adapter;
2. a bad load (a directory with no adapter) is 400 naming the worker and the reason, and leaves nothing behind
   (no Redis entry, nothing served); a name loaded twice is 400, an unknown one unloaded 404;
3. a worker started after the load (the decode pool scaled to 2) loads it from the cluster's set by itself and
   serves it (the router serves an adapter only once every live worker publishes it);
4. an unload while a request streams under the adapter waits for that request, which ends with the offline
   engine's answer; then the model is 404 and the cluster's set is empty; the gRPC calls do the same;
5. the same name loaded from other files answers as the other adapter (no K/V of the old weights reused);
6. the router's resolver (``lora_resolver_dir``, vLLM's filesystem LoRA resolver): a request naming an adapter found
   there is served by it on first use (two at once: one loads, the other waits for that load), one naming nothing
   there is NOT_FOUND and leaves nothing behind;
7. ``max_loras=2``: a third adapter loaded (by the resolver or by a call) then unloads the least recently used one;
8. ``pdserve lora list / load / unload`` (the CLI client of those calls) against the same router.
"""
from __future__ import annotations

import shutil
import threading

import grpc
import httpx
import openai
import pytest
import torch

from cluster.launcher import Cluster, ClusterConfig
from engine import SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.helpers import generate, run_concurrently
from tests.roles.test_lora_cluster import adapters, reference  # noqa: F401 - the module's fixtures
from tests.waiting import wait_until

PROMPT = "def fibonacci(n):"


def _offline(reference, name, n: int = 12) -> tuple[list[int], str]:
    (o,) = reference.generate([PROMPT], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                        lora_name=name)])
    return list(o.token_ids), o.text


@pytest.fixture(scope="module")
def resolver_dir(adapters, tmp_path_factory):
    """What the router's LoRA resolver loads from: alt's files under two other names."""
    root = tmp_path_factory.mktemp("resolvable")
    for name in ("auto", "auto2", "auto3"):
        shutil.copytree(adapters["alt"], root / name)
    return str(root)


@pytest.fixture(scope="module")
def cluster(ray_local, redis_url, resolver_dir):
    torch.set_num_threads(1)
    # heartbeats every 0.25 s (1 s by default): workers follow the runtime set at each, so every load and unload here
    # waits a quarter of what it would (the suite's time)
    cfg = ClusterConfig(model="tiny", num_prefill=1, num_decode=1, redis_url=redis_url, engine_process=True,
                        heartbeat_interval_s=0.25,
                        engine_overrides=dict(num_kv_blocks=256, max_num_batched_tokens=256),
                        router_overrides=dict(allow_runtime_lora_updating=True, http_port=0,
                                              lora_update_timeout_s=120.0, lora_resolver_dir=resolver_dir,
                                              max_loras=2),
                        start_timeout_s=600)
    c = Cluster(cfg).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://{cluster.router.http_address}", timeout=180) as client:
        yield client


def _models(http) -> list[str]:
    return [m["id"] for m in http.get("/v1/models").json()["data"]]


def _ids(cluster, model: str, n: int = 12) -> list[int]:
    return generate(cluster.router_address, prompt=PROMPT, max_tokens=n, temperature=0.0, ignore_eos=True,
                    model=model)[0]


def test_load_over_http_serves_the_adapters_answers_everywhere(cluster, http, adapters, reference):
    assert _models(http) == ["tiny"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "py", "lora_path": adapters["py"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'py' added successfully.", r.text
    assert _models(http) == ["tiny", "py"]  # at once: the call answered after every worker served it
    ids, text = _offline(reference, "py")
    assert ids != _offline(reference, None)[0]
    assert _ids(cluster, "py") == ids
    oai = openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="none", max_retries=0,
                        timeout=120)
    done = oai.completions.create(model="py", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert done.choices[0].text == text and done.model == "py"
    assert _ids(cluster, "") == _offline(reference, None)[0]  # the base model is still the base model
    entries = cluster.registry.lora_entries()
    assert list(entries) == ["py"] and entries["py"].path == adapters["py"] and entries["py"].state == "serving"


def test_bad_loads_and_unloads_are_refused_by_name_and_leave_nothing(cluster, http, adapters, tmp_path):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "nothing", "lora_path": str(tmp_path)})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("lora_path: worker ") and "adapter_config.json" in msg, msg
    assert "nothing" not in cluster.registry.lora_entries() and "nothing" not in _models(http)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "py", "lora_path": adapters["alt"]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"], r.text
    for body, field in [({"lora_name": "a b", "lora_path": adapters["alt"]}, "lora_name"),
                        ({"lora_name": "alt", "lora_path": "relative/dir"}, "lora_path"),
                        ({"lora_name": "tiny", "lora_path": adapters["alt"]}, "lora_name")]:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text
        assert r.json()["error"]["param"] == field, r.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "alt"})
    assert r.status_code == 400, r.text  # (lora_path missing: the body's own check)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"], r.text
    assert list(cluster.registry.lora_entries()) == ["py"]


def test_a_worker_started_later_loads_the_clusters_adapters(cluster, reference):
    cluster.scale_pool("decode", 2)
    wait_until(lambda: len([w for w in cluster.registry.list("decode") if "py" in w.lora_adapters]) == 2, 120,
               message="the new decode worker did not load the cluster's adapter")
    ids = _offline(reference, "py")[0]
    # both decode workers serve it: several requests land on each (the router balances the pool)
    got = [_ids(cluster, "py") for _ in range(4)]
    assert got == [ids] * 4


def test_unload_waits_for_the_running_request_then_stops_serving(cluster, http, adapters, reference):
    ids = _offline(reference, "py", 48)[0]
    out: dict = {}
    started = threading.Event()

    def stream() -> None:
        with grpc.insecure_channel(cluster.router_address) as ch:
            got = []
            for r in pdserve_pb2_grpc.PDServeStub(ch).Generate(pdserve_pb2.GenerateRequest(
                    prompt=PROMPT, max_tokens=48, temperature=0.0, ignore_eos=True, model="py"), timeout=180):
                got += r.token_ids
                started.set()
            out["ids"] = got

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "py"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'py' removed successfully.", r.text
    assert "ids" in out, "the unload answered before the request running under the adapter had finished"
    t.join(60)
    assert out["ids"] == ids
    assert _models(http) == ["tiny"] and cluster.registry.lora_entries() == {}
    with pytest.raises(grpc.RpcError) as e:
        _ids(cluster, "py")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    wait_until(lambda: not any(w.lora_adapters for w in cluster.registry.list()), 30,
               message="a worker still serves the unloaded adapter")


def test_grpc_calls_and_a_name_reloaded_from_other_files(cluster, adapters, reference):
    with grpc.insecure_channel(cluster.router_address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        got = stub.LoadLoRAAdapter(pdserve_pb2.LoadLoRAAdapterRequest(lora_name="py", lora_path=adapters["alt"]),
                                   timeout=180)
        assert got.message == "Success: LoRA adapter 'py' added successfully."
        # "py" now has alt's weights: its answers are alt's, none of the old py blocks reused
        assert _ids(cluster, "py") == _offline(reference, "alt")[0]
        assert "py" in stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10).lora_adapters
        with pytest.raises(grpc.RpcError) as e:
            stub.UnloadLoRAAdapter(pdserve_pb2.UnloadLoRAAdapterRequest(lora_name="alt"), timeout=60)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            stub.LoadLoRAAdapter(pdserve_pb2.LoadLoRAAdapterRequest(lora_name="", lora_path=adapters["alt"]),
                                 timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_name" in e.value.details()
        got = stub.UnloadLoRAAdapter(pdserve_pb2.UnloadLoRAAdapterRequest(lora_name="py"), timeout=180)
        assert got.message == "Success: LoRA adapter 'py' removed successfully."
        assert list(stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10).lora_adapters) == []


def test_the_resolver_loads_an_adapter_on_its_first_request(cluster, http, reference):
    alt = _offline(reference, "alt")[0]
    assert _ids(cluster, "auto") == alt  # loaded from resolver_dir/auto on every worker, then served
    assert "auto" in _models(http) and cluster.registry.lora_entries()["auto"].path.endswith("/auto")
    oai = openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="none", max_retries=0,
                        timeout=120)

    def first_use(_: int) -> str:
        return oai.completions.create(model="auto2", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text

    texts = run_concurrently(first_use, [(0,), (1,)])
    assert texts == [_offline(reference, "alt")[1]] * 2
    for _ in range(2):  # (the second time from the resolver's memory of the miss)
        with pytest.raises(grpc.RpcError) as e:
            _ids(cluster, "not-there")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "not-there" in e.value.details()
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="not-there", prompt=PROMPT, max_tokens=2)
    assert sorted(cluster.registry.lora_entries()) == ["auto", "auto2"]


def test_max_loras_unloads_the_least_recently_used_adapter_to_load_another(cluster, http, adapters, reference):
    assert sorted(cluster.registry.lora_entries()) == ["auto", "auto2"]  # (auto2 used last, by the test before)
    alt = _offline(reference, "alt")[0]
    assert _ids(cluster, "auto3") == alt  # a third: auto (least recently used) goes to make room
    assert sorted(cluster.registry.lora_entries()) == ["auto2", "auto3"]
    assert sorted(_models(http)) == ["auto2", "auto3", "tiny"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "py", "lora_path": adapters["py"]})
    assert r.status_code == 200, r.text  # auto2 is now the least recently used
    assert sorted(cluster.registry.lora_entries()) == ["auto3", "py"]
    assert _ids(cluster, "py") == _offline(reference, "py")[0] and _ids(cluster, "auto3") == alt


def test_pdserve_lora_lists_loads_and_unloads_from_the_command_line(cluster, adapters, capsys):
    from cluster.cli import main

    target = ["--target", cluster.router_address]
    assert main(["lora", "list", *target]) == 0
    assert capsys.readouterr().out.split() == ["auto3", "py"]
    assert main(["lora", "unload", "auto3", *target]) == 0
    assert capsys.readouterr().out == "Success: LoRA adapter 'auto3' removed successfully.\n"
    assert main(["lora", "load", "again", adapters["alt"], *target]) == 0  # (max_loras=2: py and again)
    assert capsys.readouterr().out == "Success: LoRA adapter 'again' added successfully.\n"
    assert main(["lora", "load", "missing", "/nonexistent/adapter", *target]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: lora_path: worker ") and "adapter_config.json" in err, err
    assert main(["lora", "unload", *target]) == 2  # (no NAME: refused before any call)
    assert sorted(cluster.registry.lora_entries()) == ["again", "py"]
