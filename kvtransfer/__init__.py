"""kvtransfer: moving paged KV caches between worker processes over torch.distributed.

Lifecycle: each worker creates one ``KVEndpoint`` (its unique name, a rendezvous
store, a backend by name); the prefill side calls ``send`` + ``layer_ready``, the
decode side ``recv``; both poll handles until DONE or FAILED. See
docs/interfaces.md (section kvtransfer) for the contract.
"""
from kvtransfer.endpoint import KVEndpoint
from kvtransfer.sharding import KVShards, head_pieces, rank_heads
from kvtransfer.store import InprocStore, RedisStore, StoreConfig, open_store
from kvtransfer.transfer import TransferGroup, TransferHandle, TransferState, TransferStats

__all__ = ["KVEndpoint", "StoreConfig", "RedisStore", "InprocStore", "open_store", "TransferHandle",
           "TransferState", "TransferStats", "TransferGroup", "KVShards", "head_pieces", "rank_heads"]
