"""Stored responses of the Responses API (router/response_store.py) through the official ``openai`` client over
real routers, prefill and decode workers (gloo KV) and a real Redis: a response kept by default continues with
``previous_response_id`` exactly as if the whole conversation had been sent (the offline engine's greedy answer to
it), whole and streamed, through chains and tool calls; ``store: false``, another API key, a deleted or unknown id
are "not found"; two routers sharing the cluster's Redis continue each other's responses, whose keys expire; an
unreachable store answers 503 for a lookup and still answers a new request (``store: false``)."""
from __future__ import annotations

import openai
import pytest
import redis
import torch

from engine import SamplingParams
from router.config import RouterConfig
from router.server import RouterServer
from router.worker_source import StaticWorkerSource
from tests.roles.harness import offline, start_roles

KEY, OTHER = "store-test-key-0123456789", "store-other-key-0123456789"
N = 6


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="store-", router=dict(http_port=0, api_keys=(KEY, OTHER), responses_store_ttl_s=600,
                                              tool_call_parser="hermes"))
    yield r
    r.close()


def _client(router, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(roles):
    return _client(roles.router)


def _reference(roles, msgs: list[dict], n: int = N) -> str:
    """The offline engine's greedy answer to ``msgs`` rendered with the model's chat template."""
    tok = roles.router.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    return offline([ids], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)])[0][1]


def _ask(client, **kw):
    return client.responses.create(model="tiny", temperature=0, max_output_tokens=N,
                                   extra_body={"ignore_eos": True}, **kw)


def test_a_kept_response_continues_as_the_whole_conversation_would(roles, client):
    first = _ask(client, instructions="You write Python.", input="A loop, please.")
    assert first.store is True
    assert first.output_text == _reference(roles, [{"role": "system", "content": "You write Python."},
                                                   {"role": "user", "content": "A loop, please."}])
    # the follow-up: the earlier turns (OpenAI's rule: not the earlier instructions) and the new input
    second = _ask(client, previous_response_id=first.id, input="Shorter.")
    turns = [{"role": "user", "content": "A loop, please."}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "Shorter."}]
    assert second.previous_response_id == first.id and second.output_text == _reference(roles, turns)
    # a chain: the third continues the second, which continued the first (one read: the conversation is kept)
    third = _ask(client, previous_response_id=second.id, instructions="Be terse.",
                 input=[{"role": "user", "content": "Again."}])
    assert third.output_text == _reference(roles, [{"role": "system", "content": "Be terse."}, *turns,
                                                   {"role": "assistant", "content": second.output_text},
                                                   {"role": "user", "content": "Again."}])
    # the stored object is the answered one
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.status, got.usage.output_tokens) == \
        (first.id, first.output_text, first.status, N)
    # its input items, as client.responses.input_items.list pages them (newest first by default): the second's are
    # the first's input, the first's answer, then its own
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [(i.type, i.role, "".join(c.text for c in i.content)) for i in items] == [
        ("message", "user", "A loop, please."), ("message", "assistant", first.output_text),
        ("message", "user", "Shorter.")]
    assert all(i.id for i in items) and len({i.id for i in items}) == 3
    paged = list(client.responses.input_items.list(second.id, limit=1))  # three pages of one, newest first
    assert [i.id for i in paged] == [i.id for i in reversed(items)]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(second.id, limit=0)
    assert e.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        _client(roles.router, OTHER).responses.input_items.list(second.id)


def test_streamed_responses_are_kept_before_their_last_event(roles, client):
    events = list(client.responses.create(model="tiny", input="Count.", temperature=0, max_output_tokens=N,
                                          stream=True, extra_body={"ignore_eos": True}))
    done = events[-1].response
    assert done.store is True
    got = client.responses.retrieve(done.id)  # at once: it was kept before the event went out
    assert got.output_text == done.output_text == "".join(e.delta for e in events
                                                         if e.type == "response.output_text.delta")
    follow = list(client.responses.create(model="tiny", input="More.", previous_response_id=done.id,
                                          temperature=0, max_output_tokens=N, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert follow[-1].response.output_text == _reference(roles, [
        {"role": "user", "content": "Count."}, {"role": "assistant", "content": done.output_text},
        {"role": "user", "content": "More."}])


def test_what_is_not_kept_or_not_yours_is_not_found(roles, client):
    unkept = _ask(client, input="x", store=False)
    assert unkept.store is False
    for rid in (unkept.id, "resp_" + "0" * 32, "nope"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.retrieve(rid)
        assert e.value.body["param"] == "response_id"
        with pytest.raises(openai.NotFoundError) as e:
            _ask(client, input="y", previous_response_id=rid)
        assert e.value.body["param"] == "previous_response_id"
    kept = _ask(client, input="z")
    other = _client(roles.router, OTHER)  # another API key: as if it did not exist
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        _ask(other, input="y", previous_response_id=kept.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(kept.id)
    client.responses.delete(kept.id)
    for fn in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id),
               lambda: _ask(client, input="y", previous_response_id=kept.id)):
        with pytest.raises(openai.NotFoundError):
            fn()


def test_a_kept_call_is_answered_by_its_output(roles, client):
    """An agent's loop with stored responses: the call comes back kept, and the next request sends only the
    call's output under previous_response_id (its call_id is known from the kept conversation)."""
    weather = {"type": "function", "name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                              "required": ["city"], "additionalProperties": False}}
    call = client.responses.create(model="tiny", input="Weather in Paris?", tools=[weather], temperature=0,
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=30)
    (item,) = call.output
    answer = _ask(client, previous_response_id=call.id, tools=[weather], tool_choice="none",
                  input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
    tok = roles.router.tokenizer
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": item.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": __import__("json").loads(item.arguments)}}]},
            {"role": "tool", "tool_call_id": item.call_id, "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather["parameters"]}}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tools=tools), add_special_tokens=False)
    want = offline([ids], [SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)])[0][1]
    assert answer.output_text == want and answer.usage.input_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:  # an output for a call the conversation does not have
        _ask(client, previous_response_id=call.id,
             input=[{"type": "function_call_output", "call_id": "call_unknown", "output": "x"}])
    assert e.value.body["param"] == "input"


class _ClusterSource(StaticWorkerSource):
    """The roles' workers, in a cluster whose Redis is ``redis_url`` (as the Redis registry a deployed router has)."""

    def __init__(self, workers, redis_url: str, namespace: str) -> None:
        super().__init__(workers)
        self.redis_url, self.namespace = redis_url, namespace


def _router(roles, source) -> RouterServer:
    return RouterServer(RouterConfig(http_port=0, api_keys=(KEY,), responses_store_ttl_s=60, kv_events=False,
                                     serve_metrics=False), source).start()


def test_routers_sharing_redis_continue_each_others_responses(roles, redis_url, redis_namespace):
    workers = [w.info for w in (*roles.prefills, *roles.decodes)]
    a = _router(roles, _ClusterSource(workers, redis_url, redis_namespace))
    b = _router(roles, _ClusterSource(workers, redis_url, redis_namespace))
    try:
        first = _ask(_client(a), input="Hello.")
        second = _ask(_client(b), input="And?", previous_response_id=first.id)
        assert second.output_text == _reference(roles, [{"role": "user", "content": "Hello."},
                                                        {"role": "assistant", "content": first.output_text},
                                                        {"role": "user", "content": "And?"}])
        r = redis.Redis.from_url(redis_url)
        try:
            keys = sorted(k.decode() for k in r.scan_iter(match=f"{redis_namespace}:response:*"))
            assert keys == sorted(f"{redis_namespace}:response:{x.id}" for x in (first, second))
            assert all(0 < r.pttl(k) <= 60_000 for k in keys)  # they expire
        finally:
            r.close()
        _client(b).responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            _client(a).responses.retrieve(first.id)
    finally:
        a.stop()
        b.stop()


def test_an_unreachable_store_answers_503_for_a_lookup_and_still_serves(roles):
    workers = [w.info for w in (*roles.prefills, *roles.decodes)]
    down = _router(roles, _ClusterSource(workers, "redis://127.0.0.1:1/0", "gone"))
    try:
        c = _client(down)
        r = _ask(c, input="Hello.")  # answered; not kept, and it says so
        assert r.store is False and r.output_text == _reference(roles, [{"role": "user", "content": "Hello."}])
        with pytest.raises(openai.InternalServerError) as e:
            _ask(c, input="x", previous_response_id=r.id)
        assert e.value.status_code == 503 and "unreachable" in e.value.body["message"]
    finally:
        down.stop()


def test_a_router_without_a_store_names_its_flag(roles):
    bare = RouterServer(RouterConfig(http_port=0, serve_metrics=False),
                        StaticWorkerSource([w.info for w in (*roles.prefills, *roles.decodes)])).start()
    try:
        c = openai.OpenAI(base_url=f"http://{bare.http_address}/v1", api_key="x", max_retries=0, timeout=60)
        r = _ask(c, input="Hello.")
        assert r.store is False
        with pytest.raises(openai.BadRequestError) as e:
            _ask(c, input="x", previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id" and "--responses-store-ttl-s" in \
            e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
    finally:
        bare.stop()


def test_truncation_auto_drops_the_earliest_turns_until_the_conversation_fits(roles, client):
    """``truncation: "auto"`` (OpenAI's): a conversation longer than the context drops whole turns from its start
    (the instructions stay) until it leaves room for max_output_tokens; the answer is the offline engine's to what
    was kept. "disabled" (the default) refuses it naming the input."""
    ctx = roles.router.core.limits.max_context_length
    tok = roles.router.tokenizer
    para = "the quick brown fox jumps over the lazy dog while " * 8
    turns: list[dict] = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Turn {i}: {para}"}, {"role": "assistant", "content": f"Noted {i}."}]
    turns.append({"role": "user", "content": "Summarise."})
    system = [{"role": "system", "content": "Be brief."}]

    def length(msgs: list[dict]) -> int:
        return len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False))

    room = 120  # max_output_tokens: the room the kept turns must leave (a few turns' worth)
    assert length(system + turns) + room > ctx  # (else there is nothing to truncate)
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, instructions="Be brief.", input=turns)
    assert e.value.body["param"] in ("input", "max_output_tokens"), e.value.body
    start = 0  # the reference: whole turns off the front, one at a time, until it fits
    while length(system + turns[start:]) + room > ctx:
        start += 2
    kept = system + turns[start:]
    assert length(system + turns[start - 2:]) + room > ctx >= length(kept) + room
    r = client.responses.create(model="tiny", temperature=0, max_output_tokens=room, extra_body={"ignore_eos": True},
                                instructions="Be brief.", input=turns, truncation="auto")
    assert r.truncation == "auto" and 0 < start < len(turns) - 1
    assert r.output_text == _reference(roles, kept, room) and r.usage.input_tokens == length(kept)
    # a conversation that fits is not touched
    short = _ask(client, input=turns[-3:], truncation="auto")
    assert short.output_text == _reference(roles, turns[-3:])
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, input="x", truncation="sometimes")
    assert e.value.body["param"] == "truncation"
