from proto import pdserve_pb2 as _pdserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "kv_name", "metrics_address", "model_name", "num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "queued_prompt_tokens", "ready", "block_size", "updated_at", "node_id", "kv_cache_dtype", "requests_total", "prompt_tokens_total", "output_tokens_total", "requests_finished_total", "tensor_parallel_size", "max_model_len", "lora_adapters", "lora_status")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_NAME_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_STATUS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    grpc_address: str
    kv_name: str
    metrics_address: str
    model_name: str
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    ready: bool
    block_size: int
    updated_at: float
    node_id: str
    kv_cache_dtype: str
    requests_total: int
    prompt_tokens_total: int
    output_tokens_total: int
    requests_finished_total: int
    tensor_parallel_size: int
    max_model_len: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_status: _containers.RepeatedCompositeFieldContainer[LoRAStatus]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., grpc_address: _Optional[str] = ..., kv_name: _Optional[str] = ..., metrics_address: _Optional[str] = ..., model_name: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., ready: _Optional[bool] = ..., block_size: _Optional[int] = ..., updated_at: _Optional[float] = ..., node_id: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., requests_total: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., output_tokens_total: _Optional[int] = ..., requests_finished_total: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_status: _Optional[_Iterable[_Union[LoRAStatus, _Mapping]]] = ...) -> None: ...

class LoRARuntimeEntry(_message.Message):
    __slots__ = ("path", "load_id", "state")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    path: str
    load_id: str
    state: str
    def __init__(self, path: _Optional[str] = ..., load_id: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class LoRAStatus(_message.Message):
    __slots__ = ("name", "key_root", "load_id", "error", "running")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_ROOT_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    name: str
    key_root: int
    load_id: str
    error: str
    running: int
    def __init__(self, name: _Optional[str] = ..., key_root: _Optional[int] = ..., load_id: _Optional[str] = ..., error: _Optional[str] = ..., running: _Optional[int] = ...) -> None: ...

class WireSamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens", "logit_bias", "structured_outputs", "prompt_logprobs", "lora_name", "lora_root", "allowed_token_ids", "bad_words_token_ids", "priority", "cache_salt", "reasoning_end_token_ids", "reasoning_start_token_ids", "thinking_token_budget")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ROOT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_START_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    typical_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    logit_bias: _containers.ScalarMap[int, float]
    structured_outputs: _pdserve_pb2.StructuredOutputs
    prompt_logprobs: int
    lora_name: str
    lora_root: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    priority: int
    cache_salt: str
    reasoning_end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reasoning_start_token_ids: _containers.RepeatedScalarFieldContainer[int]
    thinking_token_budget: int
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_outputs: _Optional[_Union[_pdserve_pb2.StructuredOutputs, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_root: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., reasoning_end_token_ids: _Optional[_Iterable[int]] = ..., reasoning_start_token_ids: _Optional[_Iterable[int]] = ..., thinking_token_budget: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class AbortChoiceRequest(_message.Message):
    __slots__ = ("request_id", "choice_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choice_index: int
    def __init__(self, request_id: _Optional[str] = ..., choice_index: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "prefill_kv_name", "kv_timeout_s", "prefill_kv_cache_dtype", "prefill_tensor_parallel_size", "accept_cached_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KV_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_CACHED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WireSamplingParams
    prefill_kv_name: str
    kv_timeout_s: float
    prefill_kv_cache_dtype: str
    prefill_tensor_parallel_size: int
    accept_cached_prefix: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WireSamplingParams, _Mapping]] = ..., prefill_kv_name: _Optional[str] = ..., kv_timeout_s: _Optional[float] = ..., prefill_kv_cache_dtype: _Optional[str] = ..., prefill_tensor_parallel_size: _Optional[int] = ..., accept_cached_prefix: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_ids", "block_size", "kv_name", "tensor_parallel_size", "num_cached_tokens")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    kv_name: str
    tensor_parallel_size: int
    num_cached_tokens: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., kv_name: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "siblings", "output_stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: _pdserve_pb2.TokenLogprob
    siblings: _containers.RepeatedCompositeFieldContainer[WireSamplingParams]
    output_stream: str
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_pdserve_pb2.TokenLogprob, _Mapping]] = ..., siblings: _Optional[_Iterable[_Union[WireSamplingParams, _Mapping]]] = ..., output_stream: _Optional[str] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "kv_wait_s", "queue_s", "prefill_s", "num_cached_tokens", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenLogprob]
    finish_reason: str
    kv_wait_s: float
    queue_s: float
    prefill_s: float
    num_cached_tokens: int
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., kv_wait_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class SendPrefixRequest(_message.Message):
    __slots__ = ("request_id", "dest_kv_name", "first_token", "num_tokens", "dest_tensor_parallel_size", "kv_timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_KV_NAME_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEST_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dest_kv_name: str
    first_token: int
    num_tokens: int
    dest_tensor_parallel_size: int
    kv_timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., dest_kv_name: _Optional[str] = ..., first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., dest_tensor_parallel_size: _Optional[int] = ..., kv_timeout_s: _Optional[float] = ...) -> None: ...

class SendPrefixResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset", "blocks_in_use")
    RESET_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    blocks_in_use: int
    def __init__(self, reset: _Optional[bool] = ..., blocks_in_use: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "dest_kv_name", "dest_block_ids", "dest_block_size", "dest_tensor_parallel_size", "dest_cached_tokens", "fetch_min_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEST_KV_NAME_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEST_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCH_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WireSamplingParams
    dest_kv_name: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dest_block_size: int
    dest_tensor_parallel_size: int
    dest_cached_tokens: int
    fetch_min_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WireSamplingParams, _Mapping]] = ..., dest_kv_name: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., dest_block_size: _Optional[int] = ..., dest_tensor_parallel_size: _Optional[int] = ..., dest_cached_tokens: _Optional[int] = ..., fetch_min_tokens: _Optional[int] = ...) -> None: ...

class PrefixFetch(_message.Message):
    __slots__ = ("first_token", "num_tokens", "kv_name", "tensor_parallel_size", "kv_timeout_s")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_tokens: int
    kv_name: str
    tensor_parallel_size: int
    kv_timeout_s: float
    def __init__(self, first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., kv_name: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., kv_timeout_s: _Optional[float] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "queue_s", "prefill_s", "num_cached_tokens", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _pdserve_pb2.TokenLogprob
    queue_s: float
    prefill_s: float
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_pdserve_pb2.TokenLogprob, _Mapping]] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_pdserve_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("kv_transfer_s",)
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    kv_transfer_s: float
    def __init__(self, kv_transfer_s: _Optional[float] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer_done", "prefix_fetch")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FETCH_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    prefix_fetch: PrefixFetch
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ..., prefix_fetch: _Optional[_Union[PrefixFetch, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WireSamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WireSamplingParams, _Mapping]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embedding", "num_prompt_tokens", "num_cached_tokens")
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    num_prompt_tokens: int
    num_cached_tokens: int
    def __init__(self, embedding: _Optional[_Iterable[float]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class ColocatedRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "resume_token_ids", "siblings", "output_stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: WireSamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    siblings: _containers.RepeatedCompositeFieldContainer[WireSamplingParams]
    output_stream: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[WireSamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., siblings: _Optional[_Iterable[_Union[WireSamplingParams, _Mapping]]] = ..., output_stream: _Optional[str] = ...) -> None: ...

class OutputStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "chunk", "last", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: DecodeChunk
    last: bool
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[DecodeChunk, _Mapping]] = ..., last: _Optional[bool] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ...) -> None: ...
