"""The public gRPC API fuzzed: hypothesis draws ``GenerateRequest``s (every field, in and out of range, garbage
strings, large repeated fields, structured-output constraints) and raw byte strings (unknown fields, wrong wire
types, truncated messages) and sends them to a real router in front of a real prefill + decode worker pair.

The properties: every call ends (a deadline; nothing hangs); it either streams a reply or fails with a status a
client can act on (never UNKNOWN or INTERNAL); an INVALID_ARGUMENT names what was wrong; after each batch the
cluster still serves a plain greedy request, and the workers hold no running request and every KV block is free
again (nothing leaked). Examples are derandomized so CI sees the same cases every run; ``PDSERVE_FUZZ_EXAMPLES``
raises the count for a soak run (default 150 per property here).
"""
from __future__ import annotations

import os

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.loadtest.test_bench_real_cluster import Cluster
from tests.waiting import wait_until

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.NOT_FOUND}
"""What a fuzzed call may end with. DEADLINE_EXCEEDED is the client's own deadline on a valid long request;
NOT_FOUND a ``model`` the cluster does not serve."""

I32 = st.one_of(st.integers(-3, 40), st.sampled_from([-2**31, 2**31 - 1, 4096, 100_000]))
F32 = st.one_of(st.floats(-3.0, 3.0, width=32), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30,
                                                                  -0.0, 2.0 ** -126]))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "def main(", "🙂" * 50, "a" * 5000]))
TOKENS = st.lists(st.one_of(st.integers(-5, 300), st.sampled_from([2**31 - 1, -2**31])), max_size=64)
SCHEMAS = st.sampled_from(['{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
                           '{"type": "strng"}', "not json", "{}", '{"type": "array", "items": {"$ref": "#/x"}}',
                           '{"type": "string", "pattern": "["}', '{"enum": []}', "[]", "" ])
CONSTRAINTS = st.one_of(
    st.none(),
    st.builds(lambda s: pdserve_pb2.StructuredOutputs(json=s), SCHEMAS),
    st.builds(lambda b: pdserve_pb2.StructuredOutputs(json_object=b), st.booleans()),
    st.builds(lambda r: pdserve_pb2.StructuredOutputs(regex=r),
              st.one_of(TEXT, st.sampled_from(["[0-9]+", "(", "a{99999}", "\\p{Bogus}", "(a|b)*c"]))),
    st.builds(lambda c: pdserve_pb2.StructuredOutputs(choice=pdserve_pb2.StructuredOutputs.Choices(choice=c)),
              st.lists(TEXT, max_size=5)),
    st.builds(lambda g: pdserve_pb2.StructuredOutputs(grammar=g),
              st.one_of(TEXT, st.sampled_from(['start: "a" | "b"', "start: x", 'start: "x" start', "%%%"]))),
)


def _optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


@st.composite
def valid_requests(draw: st.DrawFn) -> pdserve_pb2.GenerateRequest:
    """A request the API accepts (short): each knob either unset or inside its documented range."""
    fields: dict = {"prompt": draw(st.sampled_from(["def main(", "import os\n", "x = 1", "🙂 hello"])),
                    "max_tokens": draw(st.integers(1, 4)), "model": draw(st.sampled_from(["", "tiny"]))}
    knobs = {"temperature": st.floats(0.0, 2.0, width=32), "top_p": st.floats(0.0625, 1.0, width=32),
             "top_k": st.integers(0, 50), "min_p": st.floats(0.0, 1.0, width=32),
             "repetition_penalty": st.floats(0.5, 2.0, width=32), "seed": st.integers(0, 2**63 - 1),
             "logprobs": st.integers(0, 5), "n": st.integers(1, 3), "min_tokens": st.integers(0, 1),
             "frequency_penalty": st.floats(-2.0, 2.0, width=32)}
    for name in draw(st.sets(st.sampled_from(sorted(knobs)), max_size=4)):
        fields[name] = draw(knobs[name])
    if draw(st.booleans()):
        fields["stop"] = draw(st.lists(st.sampled_from(["\n", "main", ")"]), max_size=2))
    if draw(st.booleans()):  # vLLM's extras, inside their ranges
        fields["allowed_token_ids"] = draw(st.lists(st.integers(5, 300), min_size=1, max_size=40))
        fields["bad_words"] = draw(st.lists(st.sampled_from(["main", " os", "🙂", "x = "]), max_size=2))
        fields["truncate_prompt_tokens"] = draw(st.sampled_from([-1, 1, 3, 64]))
        fields["cache_salt"] = draw(st.sampled_from(["", "tenant-a", "🙂"]))
    if draw(st.integers(0, 3)) == 0:
        fields["structured_outputs"] = draw(st.sampled_from([
            pdserve_pb2.StructuredOutputs(choice=pdserve_pb2.StructuredOutputs.Choices(choice=["yes", "no"])),
            pdserve_pb2.StructuredOutputs(regex="[0-9]{1,3}"),
            pdserve_pb2.StructuredOutputs(json_object=True)]))
    return pdserve_pb2.GenerateRequest(**fields)


@st.composite
def mutated_requests(draw: st.DrawFn) -> pdserve_pb2.GenerateRequest:
    """A valid request with one field replaced by what ``requests()`` drew for it (often out of range)."""
    req = draw(valid_requests())
    wild = draw(requests())
    fd = pdserve_pb2.GenerateRequest.DESCRIPTOR.fields_by_name[
        draw(st.sampled_from(sorted(pdserve_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)))]
    req.ClearField(fd.name)
    value = getattr(wild, fd.name)
    if fd.message_type is not None and not fd.is_repeated:  # a message field
        if wild.HasField(fd.name):
            getattr(req, fd.name).CopyFrom(value)
    elif fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        getattr(req, fd.name).update(value)
    elif fd.is_repeated:
        getattr(req, fd.name).extend(value)
    elif not fd.has_presence or wild.HasField(fd.name):
        setattr(req, fd.name, value)
    return req


@st.composite
def requests(draw: st.DrawFn) -> pdserve_pb2.GenerateRequest:
    """A GenerateRequest with any subset of fields set to values inside and outside their ranges."""
    fields: dict = {}
    source = draw(st.sampled_from(["prompt", "tokens", "both", "neither"]))
    if source in ("prompt", "both"):
        fields["prompt"] = draw(TEXT)
    if source in ("tokens", "both"):
        fields["token_ids"] = draw(TOKENS)
    # keep valid requests short: the property is about the answer's status, not long generations
    fields["max_tokens"] = draw(st.one_of(st.integers(-2, 4), st.sampled_from([2**31 - 1, 0])))
    for name, strategy in (("temperature", F32), ("top_p", F32), ("top_k", I32), ("min_p", F32),
                           ("repetition_penalty", F32), ("frequency_penalty", F32), ("presence_penalty", F32),
                           ("logprobs", I32), ("min_tokens", I32), ("typical_p", F32), ("n", I32),
                           ("beam_width", I32), ("length_penalty", F32),
                           ("seed", st.integers(0, 2**64 - 1))):
        v = draw(_optional(strategy))
        if v is not None:
            fields[name] = v
    fields["request_id"] = draw(st.one_of(st.just(""), TEXT))
    fields["stop"] = draw(st.lists(TEXT, max_size=6))
    fields["stop_token_ids"] = draw(st.lists(I32, max_size=6))
    fields["ignore_eos"] = draw(st.booleans())
    fields["skip_special_tokens_off"] = draw(st.booleans())
    fields["early_stopping"] = draw(st.sampled_from(["", "true", "false", "never", "sometimes"]))
    fields["model"] = draw(st.one_of(st.sampled_from(["", "tiny", "tiny ", "py"]), TEXT))
    fields["logit_bias"] = draw(st.dictionaries(I32, F32, max_size=6))
    fields["allowed_token_ids"] = draw(st.one_of(st.just([]), TOKENS))
    fields["bad_words"] = draw(st.lists(TEXT, max_size=4))
    fields["reasoning"] = draw(st.booleans())
    for name, strategy in (("truncate_prompt_tokens", I32), ("priority", I32), ("thinking_token_budget", I32)):
        v = draw(_optional(strategy))
        if v is not None:
            fields[name] = v
    fields["cache_salt"] = draw(st.one_of(st.just(""), TEXT))
    so = draw(CONSTRAINTS)
    if so is not None:
        fields["structured_outputs"] = so
    return pdserve_pb2.GenerateRequest(**fields)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """Bytes for Generate: a valid request cut, spliced or extended with unknown / mistyped fields, or noise."""
    good = pdserve_pb2.GenerateRequest(prompt="def main(", max_tokens=2, temperature=0.0).SerializeToString()
    kind = draw(st.sampled_from(["noise", "truncated", "unknown_field", "wrong_type", "spliced", "huge_repeated"]))
    if kind == "noise":
        return draw(st.binary(max_size=256))
    if kind == "truncated":
        return good[:draw(st.integers(0, len(good)))]
    if kind == "unknown_field":  # field 999, length-delimited: proto3 keeps unknown fields; a valid request
        return good + b"\xba\x3e" + bytes([5]) + draw(st.binary(min_size=5, max_size=5))
    if kind == "wrong_type":  # prompt (field 2) sent as a varint instead of a string
        return b"\x10" + bytes([draw(st.integers(0, 127))]) + good
    if kind == "huge_repeated":  # 50,000 packed token ids (field 3)
        body = b"\x01" * 50_000
        return b"\x1a" + _varint(len(body)) + body + b"\x20\x02"
    cut = draw(st.integers(0, len(good)))
    return good[:cut] + draw(st.binary(max_size=32)) + good[cut:]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.fixture(scope="module")
def cluster(redis_url):
    torch.set_num_threads(1)
    c = Cluster("disaggregated", redis_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.target) as ch:
        yield ch


def _status_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _check(code: grpc.StatusCode, details: str, what: object) -> None:
    assert code in ACCEPTABLE, f"{code.name} ({details!r}) for {what!r}"
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        assert len(details) >= 8, f"{code.name} without an explanation for {what!r}"


def _cluster_is_clean(cluster: Cluster, channel: grpc.Channel) -> None:
    """A plain greedy request is served, then every worker is idle with all its KV blocks free."""
    stub = pdserve_pb2_grpc.PDServeStub(channel)
    resps = list(stub.Generate(pdserve_pb2.GenerateRequest(prompt="import os", max_tokens=3, temperature=0.0),
                               timeout=120))
    assert resps[-1].finish_reason in ("length", "stop")

    def idle() -> bool:
        infos = [w.info() for w in cluster.workers]
        return all(i.num_running == 0 and i.num_waiting == 0 and i.num_free_blocks == i.num_total_blocks
                   for i in infos)

    wait_until(idle, timeout=60, message="every worker idle with all KV blocks free after the fuzz batch")


def test_fuzzed_requests_get_an_actionable_status(cluster, channel):
    stub = pdserve_pb2_grpc.PDServeStub(channel)
    seen: dict[grpc.StatusCode, int] = {}

    @FUZZ
    @given(st.one_of(valid_requests(), mutated_requests(), requests()))
    def one(req: pdserve_pb2.GenerateRequest) -> None:
        code, details = _status_of(stub.Generate(req, timeout=20))
        seen[code] = seen.get(code, 0) + 1
        _check(code, details, req)

    one()
    # the strategies reach both sides of validation: some requests are served, many are refused
    assert seen.get(grpc.StatusCode.OK, 0) > 0 and seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0, seen
    _cluster_is_clean(cluster, channel)


def test_fuzzed_bytes_get_an_actionable_status(cluster, channel):
    call = channel.unary_stream("/pdserve.v1.PDServe/Generate", request_serializer=None,
                                response_deserializer=pdserve_pb2.GenerateResponse.FromString)

    @FUZZ
    @given(payloads())
    def one(payload: bytes) -> None:
        code, details = _status_of(call(payload, timeout=20))
        _check(code, details, payload[:80])

    one()
    _cluster_is_clean(cluster, channel)
