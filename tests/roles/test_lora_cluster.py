"""LoRA adapters through the cluster: a request's ``model`` picks the adapter, the prefill worker computes the
prompt under it, the KV goes to the decode worker over gloo and decoding goes on under the same adapter.

Two adapters for the built-in ``tiny`` model, made by PEFT (random A and B, so each changes the answers), serve
beside the base model on a real prefill worker, decode worker and router (gRPC and the OpenAI HTTP API). The
reference is the offline engine with the same adapters (tests/engine/test_lora.py checks that engine against
PEFT): greedy answers through the cluster, base and adapters mixed and concurrent, each equal to it; a prompt
first cached under one adapter does not serve another (the decode worker's delta transfer reuses only the
request's own adapter's blocks). A model no worker serves is NOT_FOUND / 404 naming what is served.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch

from engine import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import counter_values, start_colocated, start_roles
from tests.waiting import wait_until


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():\n    path = os.path.join(",
           "class Stack:\n    def __init__(self):", "for i in range(10):\n    print("]
MODELS = ["", "py", "alt"]


def make_tiny_adapters(root) -> dict[str, str]:
    """Two PEFT adapters of the built-in tiny model: ``py`` (every projection, r=8) and ``alt`` (q, v, r=4)."""
    import transformers

    from engine.builtin import builtin_spec

    peft = pytest.importorskip("peft")  # (here, not at collection: it imports triton; see tests/engine/test_lora.py)

    out = {}
    for seed, (name, kw) in enumerate({"py": dict(r=8, lora_alpha=16, target_modules="all-linear"),
                                       "alt": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])}.items()):
        torch.manual_seed(seed)
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**builtin_spec("tiny").hf_config))
        pm = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, 0.5)
        pm.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return make_tiny_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def reference(adapters):
    from engine import LLM

    return LLM(model="tiny", num_kv_blocks=256, num_threads=1, lora_modules=adapters)


def _offline(reference, prompt: str, model: str, n: int) -> tuple[list[int], str]:
    (o,) = reference.generate([prompt], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                        lora_name=model or None)])
    return list(o.token_ids), o.text


@pytest.fixture(scope="module")
def roles(adapters):
    torch.set_num_threads(1)
    r = start_roles(tag="lora-", engine=dict(lora_modules=adapters), router=dict(http_port=0))
    yield r
    r.close()


def _generate(stub, prompt: str, model: str, n: int = 16) -> list[int]:
    resps = stub.Generate(pdserve_pb2.GenerateRequest(prompt=prompt, model=model, max_tokens=n, temperature=0.0,
                                                      ignore_eos=True), timeout=120)
    return [t for r in resps for t in r.token_ids]


def test_grpc_greedy_per_adapter_equals_offline(roles, reference):
    before = counter_values(roles.router.metrics, "pdserve:lora_requests", "lora_name")
    calls = [(p, m) for p in PROMPTS for m in MODELS]
    want = [_offline(reference, p, m, 16)[0] for p, m in calls]
    assert len({tuple(w) for w in want}) == len(want)  # the adapters change every answer
    for _ in range(2):  # the second round finds every prompt cached (per adapter) on both workers
        with ThreadPoolExecutor(len(calls)) as pool:
            got = list(pool.map(lambda c: _generate(roles.stub, *c), calls))
        assert got == want
    after = counter_values(roles.router.metrics, "pdserve:lora_requests", "lora_name")
    assert {k: after[k] - before.get(k, 0.0) for k in after} == {"py": 8, "alt": 8}  # the base model's: not here
    info = roles.stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10)
    assert list(info.lora_adapters) == ["alt", "py"]
    wait_until(roles.idle, 60, message=lambda: f"blocks still held: {roles.busy()}")
    assert list(roles.prefills[0].info().lora_adapters) == ["alt", "py"]


def test_n_choices_sample_under_the_adapter(roles, reference):
    """n = 3 seeded choices of an adapter's request (one prefill, one KV transfer, two siblings started on the decode
    worker) each equal the offline engine's draw with seed + i under that adapter."""
    prompt = PROMPTS[2]
    resps = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt=prompt, model="alt", n=3, max_tokens=12,
                                                                  temperature=0.9, seed=7, ignore_eos=True),
                                     timeout=120))
    got: dict[int, list[int]] = {}
    for r in resps:
        got.setdefault(r.index, []).extend(r.token_ids)
    want = [list(o.token_ids) for o in reference.generate(
        [prompt] * 3, [SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i, ignore_eos=True, lora_name="alt")
                       for i in range(3)])]
    base = [list(o.token_ids) for o in reference.generate(
        [prompt] * 3, [SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(3)])]
    assert [got[i] for i in range(3)] == want and want != base


def test_prompt_cached_under_one_adapter_does_not_serve_another(roles, reference):
    """A 3-block prompt under 'py' first (both workers cache it), then the base model and 'alt' on the same
    prompt: each equals its own offline answer (a delta transfer of 'py''s blocks would not)."""
    prompt = PROMPTS[1] * 3
    for model in ["py", "", "alt", "py"]:
        assert _generate(roles.stub, prompt, model, 12) == _offline(reference, prompt, model, 12)[0], model


def test_openai_client_picks_the_adapter_by_model(roles, reference):
    client = openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="none", max_retries=0,
                           timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "py", "alt"}
    assert cards["py"].parent == "tiny" and cards["tiny"].parent is None
    for model in ["py", "alt", "tiny"]:
        _, text = _offline(reference, PROMPTS[0], "" if model == "tiny" else model, 10)
        r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert (r.choices[0].text, r.model) == (text, model)
    streamed = client.completions.create(model="alt", prompt=PROMPTS[2], max_tokens=10, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == _offline(reference, PROMPTS[2], "alt", 10)[1]
    # a chat under an adapter: the rendered prompt continues as the offline engine continues it under 'py'
    tok = roles.router.tokenizer
    msgs = [{"role": "user", "content": "A loop, please."}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    (want,) = reference.generate([ids], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora_name="py")])
    chat = client.chat.completions.create(model="py", messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert (chat.choices[0].message.content, chat.model) == (want.text, "py")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "model 'nope' does not exist; this server serves 'tiny', 'alt', 'py'" in str(e.value)


def test_embeddings_under_an_adapter_are_its_own(roles, reference):
    """``model`` names the adapter of an embedding request too: its vectors are the offline engine's under that
    adapter (and not the base model's, which an adapter that changes the answers must change)."""
    client = openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="none", max_retries=0,
                           timeout=60)
    for model in ["py", "tiny"]:
        want = reference.embed(PROMPTS[:2], lora_name=None if model == "tiny" else model)
        got = client.embeddings.create(model=model, input=PROMPTS[:2])
        assert got.model == model
        for d, w in zip(got.data, want):
            assert max(abs(a - b) for a, b in zip(d.embedding, w.outputs.embedding)) < 1e-5
    base, py = (reference.embed(PROMPTS[:1], lora_name=n)[0].outputs.embedding for n in (None, "py"))
    assert max(abs(a - b) for a, b in zip(base, py)) > 1e-3
    assert roles.wait_idle(10.0)


def test_unknown_model_refused_by_name(roles):
    with pytest.raises(grpc.RpcError) as e:
        _generate(roles.stub, "x", "nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "model 'nope' does not exist" in e.value.details()


def test_beam_search_under_an_adapter_equals_the_offline_search(roles, reference):
    """A beam search naming an adapter (gRPC ``beam_width`` + ``model``; OpenAI ``use_beam_search``): every
    sub-request the router sends scores its beam under the adapter, on the prefill and the decode workers; the
    ranked answer is the offline engine's ``beam_search(..., lora_name=)`` (tests/engine/test_lora.py checks that
    against PEFT), and differs from the base model's."""
    from engine import BeamSearchParams

    ids = roles.router.tokenizer.encode(PROMPTS[1])
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    (want,) = reference.beam_search([ids], params, lora_name="py")
    (base,) = reference.beam_search([ids], params)
    assert [s.tokens for s in want.sequences] != [s.tokens for s in base.sequences]
    resps = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=ids, model="py", beam_width=3, max_tokens=6,
                                                                 ignore_eos=True), timeout=120))
    assert [r.index for r in resps] == [0, 1, 2]
    for r, w in zip(resps, want.sequences):
        assert list(r.token_ids) == w.tokens[len(ids):]
        assert r.score == pytest.approx(w.score, abs=1e-4)
    client = openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="none", max_retries=0,
                           timeout=60)
    r = client.completions.create(model="py", prompt=ids, max_tokens=6, n=3,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in r.choices] == [w.text for w in want.sequences] and r.model == "py"


def test_colocated_worker_serves_adapters(adapters, reference):
    r = start_colocated(tag="lora-c-", engine=dict(lora_modules=adapters))
    try:
        for model in MODELS:
            assert _generate(r.stub, PROMPTS[3], model, 12) == _offline(reference, PROMPTS[3], model, 12)[0]
    finally:
        r.close()


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_sends_each_request_under_a_drawn_adapter(roles, tmp_path, capsys, backend):
    """`pdserve bench --lora-modules py nope`: each request names one of them (drawn, seeded): the 'py' ones
    complete, the 'nope' ones are refused by the router as a model it does not serve (NOT_FOUND / 404), and the
    counts printed are what happened."""
    import json

    from loadtest.cli import main

    target = (["--target", roles.router.address] if backend == "grpc"
              else ["--backend", "openai", "--base-url", f"http://{roles.router.http_address}", "--vocab-size",
                    "4096"])
    out = tmp_path / "r.json"
    rc = main([*target, "--num-prompts", "12", "--input-len", "8", "--output-len", "3", "--seed", "3",
               "--lora-modules", "py", "nope", "--disable-tqdm", "--save-result", str(out)])
    printed = capsys.readouterr().out
    counts = dict(part.rsplit(" ", 1) for part in printed.split("LoRA adapters, requests each: ")[1]
                  .splitlines()[0].split(", "))
    res = json.loads(out.read_text())
    assert rc == 0 and res["lora_modules"] == ["py", "nope"]
    assert 0 < int(counts["nope"]) < 12 and res["completed"] == int(counts["py"])
    assert res["failed"] == int(counts["nope"])
    assert all(("NOT_FOUND" if backend == "grpc" else "404") in e for e in res["errors"] if e), res["errors"]


def test_runtime_lora_calls_are_off_unless_the_router_allows_them(roles, adapters):
    """Without ``allow_runtime_lora_updating`` the load and unload calls change nothing: HTTP 404 and gRPC
    UNIMPLEMENTED, both naming the flag (vLLM, without VLLM_ALLOW_RUNTIME_LORA_UPDATING, has no such routes). A router
    allowed them but fed by a static worker list (no Redis registry to hold the cluster's set) is UNIMPLEMENTED too,
    naming why. The e2e test (tests/e2e/test_lora_runtime.py) runs them on a whole cluster."""
    import httpx

    r = httpx.post(f"http://{roles.router.http_address}/v1/load_lora_adapter",
                   json={"lora_name": "extra", "lora_path": adapters["alt"]}, timeout=30)
    assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"], r.text
    for call, req in ((roles.stub.LoadLoRAAdapter, pdserve_pb2.LoadLoRAAdapterRequest(lora_name="extra",
                                                                                        lora_path=adapters["alt"])),
                      (roles.stub.UnloadLoRAAdapter, pdserve_pb2.UnloadLoRAAdapterRequest(lora_name="py"))):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--allow-runtime-lora-updating" in e.value.details()
    assert _generate(roles.stub, PROMPTS[0], "py", 4)  # still served: the unload did nothing
    allowed = start_colocated(n=1, tag="lora-static-", engine=dict(lora_modules=adapters),
                              router=dict(allow_runtime_lora_updating=True))
    try:
        with pytest.raises(grpc.RpcError) as e:
            allowed.stub.LoadLoRAAdapter(pdserve_pb2.LoadLoRAAdapterRequest(lora_name="extra",
                                                                           lora_path=adapters["alt"]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "registry" in e.value.details()
    finally:
        allowed.close()


def test_a_worker_retries_a_refused_runtime_load_once_its_files_arrive(roles, adapters, tmp_path, monkeypatch):
    """A worker following the cluster's runtime set (worker_common/lora_sync.py) whose load is refused (the
    directory is not on its host yet) publishes why (``LoRAStatus.error``) and does not hammer the disk: the same
    load is tried again only after ``RETRY_FAILED_S``; then, the files there, it loads it. An entry gone from the set
    is unloaded."""
    import shutil

    from proto.worker_pb2 import LoRARuntimeEntry
    from worker_common import lora_sync

    w = roles.prefills[0]
    path = tmp_path / "late"
    want = {"late": LoRARuntimeEntry(path=str(path), load_id="l1", state="serving")}

    def status() -> dict:
        return {s.name: s for s in w.info().lora_status}

    w.sync_lora(want, wait=True)
    assert "adapter_config.json" in status()["late"].error and "late" not in w.info().lora_adapters
    shutil.copytree(adapters["alt"], path)
    w.sync_lora(want, wait=True)  # within RETRY_FAILED_S: not tried again
    assert status()["late"].error and "late" not in w.info().lora_adapters
    monkeypatch.setattr(lora_sync, "RETRY_FAILED_S", 0.0)
    w.sync_lora(want, wait=True)
    assert not status()["late"].error and status()["late"].load_id == "l1" and "late" in w.info().lora_adapters
    w.sync_lora({}, wait=True)
    assert "late" not in status() and "late" not in w.info().lora_adapters


def test_a_workers_lora_requests_info_names_the_adapter_while_it_runs(roles):
    """vLLM's ``lora_requests_info`` on the decode worker (what a LoRA-aware scheduler scrapes): while a request
    under ``py`` decodes, the series names it among the running adapters, with the two adapters held; once it is
    done, none."""
    render = roles.decodes[0].metrics.render
    stream = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt=PROMPTS[0], model="py", max_tokens=400,
                                                             temperature=0.0, ignore_eos=True), timeout=120)
    next(stream)  # the first token: the request is on the decode worker
    wait_until(lambda: 'max_lora="2",' in render().decode() and 'running_lora_adapters="py"' in render().decode(),
               30, message=lambda: render().decode()[-3000:])
    assert sum(len(r.token_ids) for r in stream) >= 1
    wait_until(lambda: 'running_lora_adapters="",waiting_lora_adapters=""' in render().decode(), 30,
               message=lambda: render().decode()[-3000:])
