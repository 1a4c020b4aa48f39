from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "kv_name", "metrics_address", "model_name", "num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "queued_prompt_tokens", "ready", "block_size", "updated_at", "node_id")
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
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., grpc_address: _Optional[str] = ..., kv_name: _Optional[str] = ..., metrics_address: _Optional[str] = ..., model_name: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., ready: _Optional[bool] = ..., block_size: _Optional[int] = ..., updated_at: _Optional[float] = ..., node_id: _Optional[str] = ...) -> None: ...
