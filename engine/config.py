"""Engine and model configuration.

Lifecycle: the caller builds an ``EngineConfig`` (validated in ``__post_init__``);
``engine.loader`` turns ``EngineConfig.model`` into a ``ModelConfig`` (from a
built-in name or a Hugging Face ``config.json``) once, at engine start; both are
read-only afterwards and are what the model, the KV cache and the scheduler size
themselves from.

No torch here: dtypes are kept as names ('float32', 'bfloat16', 'float16') and mapped to torch dtypes
on first use (``torch_dtype``, ``cache_dtype``, ``parse_dtype``), so the router, which builds an
``EngineConfig`` and a ``ModelConfig`` to read the model's limits, never imports torch
(tests/router/test_router_without_torch.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    import torch

DTYPES = ("bfloat16", "float16", "float32")
"""The model dtypes, by name (``torch.<name>``)."""
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8", "fp8")
"""``EngineConfig.quantization`` values (the formats: engine/quant.py, which re-exports this)."""
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
"""``EngineConfig.kv_cache_dtype`` values."""
ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel", "BertForSequenceClassification",
                         "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification")
"""Bidirectional encoders (engine/encoder.py): embedding models (bge, e5, all-MiniLM, bge-m3, ...) and sequence
classifiers (``...ForSequenceClassification``: one label, a cross-encoder reranker such as bge-reranker; more, a
sentiment or intent classifier); no generation."""


def classifier_labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A ``...ForSequenceClassification`` config.json's label names, by output: ``id2label``'s, else transformers'
    default (``num_labels``, 2 when absent) named ``LABEL_i``."""
    names = {str(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    n = len(names) if names else int(cfg.get("num_labels", 2))
    return tuple(names.get(str(i), f"LABEL_{i}") for i in range(n))
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "GraniteForCausalLM", "Gemma3ForCausalLM", *ENCODER_ARCHITECTURES)


def dtype_name(dtype: Union[str, "torch.dtype"]) -> str:
    """The canonical name ('float32' | 'bfloat16' | 'float16') of a dtype name, alias ('fp32', 'bf16', 'fp16',
    'half', 'float') or torch dtype; ValueError naming ``dtype`` otherwise. Needs no torch."""
    name = str(dtype).removeprefix("torch.")
    key = _DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return key


def parse_dtype(name: Union[str, "torch.dtype"]) -> "torch.dtype":
    """'float32' | 'bfloat16' | 'float16' (also 'fp32', 'bf16', 'fp16', 'half') -> torch dtype (imports torch)."""
    key = dtype_name(name)
    import torch

    return getattr(torch, key)


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's shape of bucket list: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and it itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


TOKEN_BUCKETS = (8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
"""The default token-count buckets of the piecewise graphs: up to 512 tokens (vLLM's largest capture size), each
at most 1.5x the one before past 64 (a step pads at most half again)."""


def default_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """The piecewise graphs' buckets (``TOKEN_BUCKETS``) up to ``max_num_batched_tokens``, which ends the list
    where it is smaller than 512 (every step then has a bucket)."""
    return sorted({s for s in TOKEN_BUCKETS if s < max_num_batched_tokens} | {min(max_num_batched_tokens, 512)})


def check_token_sizes(sizes: Any, max_num_batched_tokens: int) -> list[int]:
    """The buckets sorted, or ValueError naming ``cuda_graph_token_sizes``: positive integers, none past
    ``max_num_batched_tokens`` (no step holds more tokens); empty turns the piecewise graphs off."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"cuda_graph_token_sizes must be a list of token counts, got {sizes!r}")
    out = list(sizes)
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in out):
        raise ValueError(f"cuda_graph_token_sizes must be positive integers, got {out!r}")
    out = sorted(set(out))
    if out and out[-1] > max_num_batched_tokens:
        raise ValueError(f"cuda_graph_token_sizes has {out[-1]}, past max_num_batched_tokens="
                         f"{max_num_batched_tokens}: no step holds that many tokens")
    return out


def check_graph_sizes(sizes: Any, max_num_seqs: int) -> list[int]:
    """The buckets sorted, or ValueError naming ``cuda_graph_sizes``: positive integers whose largest covers
    ``max_num_seqs`` (a decode batch of the scheduler's largest size must have a graph)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"cuda_graph_sizes must be a list of batch sizes, got {sizes!r}")
    out = list(sizes)
    if not out or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in out):
        raise ValueError(f"cuda_graph_sizes must be positive integers, got {list(sizes)!r}")
    out = sorted(set(out))
    if out[-1] < max_num_seqs:
        raise ValueError(f"cuda_graph_sizes does not cover max_num_seqs={max_num_seqs}: its largest bucket is "
                         f"{out[-1]} (add {max_num_seqs}, or leave cuda_graph_sizes unset)")
    return out


@dataclass
class EngineConfig:
    """Everything an ``LLMEngine`` needs to start."""

    model: str = "tiny"
    """'tiny' | 'bench' | path to a Hugging Face model directory."""
    dtype: str = "float32"
    """Weights, activations and KV cache dtype: float32 | bfloat16 | float16."""
    device: str = "cpu"
    """torch device string ('cpu', 'cuda', 'cuda:1')."""
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: Optional[int] = None
    """Number of KV blocks; None sizes the cache from kv_cache_memory_bytes."""
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    """KV cache budget (K and V of all layers) when num_kv_blocks is None."""
    max_num_seqs: int = 64
    """Most sequences in the running batch."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget; longer prompts are prefilled in chunks."""
    max_model_len: Optional[int] = None
    """Longest prompt + output; None uses the model's max_position_embeddings."""
    seed: int = 0
    """Seed of the engine RNG used for unseeded sampling."""
    num_threads: Optional[int] = None
    """torch.set_num_threads at engine start (None leaves torch's setting)."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of full blocks whose token prefix was computed before (vLLM's automatic prefix
    caching); freed blocks keep their content until reused, least recently freed first."""
    cpu_gemm: str = "onednn"
    """CPU linear layers: 'onednn' (weights prepacked once for oneDNN's blocked GEMM, 1.2-3x faster
    than MKL sgemm here; products of up to 64 rows, i.e. decode, run pdserve's panel kernel on the same
    packed bytes where oneDNN's layout allows, and decode layers run fused; falls back to 'torch' where
    oneDNN lacks the dtype) | 'onednn_only' (the same packing, every product on oneDNN) | 'pdserve' (float32 weights
    kept dense, pdserve's CPU kernel for up to 32 rows, MKL above; 'onednn' where the kernels are not
    built) | 'torch' (torch.mm)."""
    quantization: Optional[str] = None
    """Weight-only quantization at load, from the floating-point checkpoint (engine/quant.py): None |
    'int8' (per output channel) | 'int4' (group-wise, ``quantization_group_size`` inputs per scale;
    the LM head stays int8) | 'w8a8' / 'w4a8' (the same weights, and every linear's input rounded to
    int8 per 32 values so decode runs integer dot products; the LM head stays w8a8). Decode runs
    pdserve's CPU kernels (engine/kernels.py)."""
    quantization_group_size: int = 128
    """Inputs per int4 scale: a multiple of 32 dividing every layer's input width."""
    kv_cache_dtype: str = "auto"
    """vLLM's knob: 'auto' (the model dtype) | 'int8' (per-token, per-head scales stored in each
    cached row; ~4x the tokens of a float32 cache, ~2x of a 16-bit one in the same memory) | 'fp8' (float8 e4m3,
    vLLM's default scale of 1: values saturate at +-448; 2x the tokens of a 16-bit cache; the GPU counterpart of
    int8: a CUDA engine needs compute capability 8.9+ (Ada, Hopper); on CPU a storage format read through torch)."""
    tensor_parallel_size: int = 1
    """Ranks this engine's model is split over (engine/tensor_parallel.py): Megatron-style heads, MLP columns and
    vocabulary rows, one all-reduce after attention and one after the MLP, rank 0 scheduling and sampling.
    Each rank is a process on this node (gloo on CPU); it must divide the attention heads and the MLP width, and
    divide or be divided by the KV heads. ``kv_cache_memory_bytes`` and ``num_threads`` are per rank."""
    kv_cache_shared: bool = False
    """Allocate the KV cache in memory a process on this host can map (``transport.shared_memory`` on CPU,
    ``transport.cuda_ipc`` on CUDA: one device allocation): a KV transfer peer there then reads it in place
    (kvtransfer/shm.py). One rank; a cluster's prefill workers set it where ``ClusterConfig.kv_shm`` is on. Such memory gets no transparent huge pages where the host's shmem setting is
    ``never`` (the usual default), which matters to a cache decode steps read whole."""
    enforce_eager: bool = False
    """vLLM's knob: never capture CUDA graphs; every step runs eagerly. By default a CUDA engine of one rank captures
    its pure decode steps, one graph per ``cuda_graph_sizes`` bucket (engine/cuda_graphs.py), and the other steps of
    up to 512 tokens piecewise (``cuda_graph_token_sizes``, engine/piecewise_graphs.py); other devices and split
    engines always run eagerly."""
    cuda_graph_sizes: Optional[list[int]] = None
    """Decode batch sizes with a graph of their own (a batch is padded to the next): None is 1, 2, 4, then every
    multiple of 8 up to ``max_num_seqs``; a list must reach ``max_num_seqs``."""
    cuda_graph_token_sizes: Optional[list[int]] = None
    """Token counts with piecewise graphs of their own (engine/piecewise_graphs.py: every step the decode graphs do
    not take, a prefill chunk's included, replays everything but attention from graphs, padded to the next
    count; attention runs eagerly): None is ``default_token_sizes`` (8, 16, 32, 64, 96, ... up to 512 or
    ``max_num_batched_tokens``); [] turns them off. Steps with more tokens run eagerly."""
    batch_invariant: bool = False
    """A row's logits get the same bits whatever else is in its batch and however its prompt was chunked (SGLang's
    deterministic inference, vLLM's batch-invariant mode), so a cluster's greedy output equals the offline engine's
    under any load. On CUDA: every dense linear through pdserve's fixed-tile Triton GEMM (not cuBLAS, whose
    algorithm depends on the row count) and every prefill chunk through the Triton paged kernel with one tile shape;
    the decode kernel, norms, RoPE and the sampler already work row by row. Needs Triton, float weights and a float
    KV cache of the model's dtype (a ValueError names what is not). On CPU pdserve's default kernels already are
    batch-invariant; the flag changes nothing there. Not yet timed on a GPU: invariance, not speed."""
    async_scheduling: bool = False
    """vLLM's async scheduling: while the device runs step N, the host schedules and launches step N + 1 (the input
    ids of N's sampled rows are read on the device) and only then reads N back, so the host's per-step work
    (scheduling, inputs, output bookkeeping) overlaps the GPU instead of adding to every step. Any step may run
    ahead (decode graphs, piecewise or eager) unless a sequence that sampled in N may end by length there, a running
    sequence would have to be preempted, or one is prefill-only; such a step waits for N first. Where a sequence that
    sampled in N has a grammar or a penalty over its history, N + 1's forward runs ahead and its draw waits for N.
    A sequence that stops at N has N + 1 compute one token that is thrown away (its blocks are freed once N + 1 is
    done). Needs a CUDA engine of one rank (``static_decode_buffers`` runs it on CPU, for
    tests) and no speculative decoding. Off by default: not yet timed on a GPU."""
    static_decode_buffers: bool = False
    """Run decode steps, and the steps the piecewise graphs take, through the graphs' static buffers and bucket
    padding without capturing them (any device): how the graph paths are tested on CPU, and a way to tell a
    capture problem from a padding one on a GPU."""
    lora_modules: Optional[Any] = None
    """LoRA adapters served beside the base model (engine/lora.py; vLLM's ``--lora-modules``): a mapping name ->
    PEFT adapter directory, or a list of ``name=path``; normalised to a dict here. Every adapter is loaded at
    start; a request picks one by ``SamplingParams.lora_name``. CPU engines (each tensor-parallel rank its shard)."""
    speculative_config: Optional[Any] = None
    """Speculative decoding (``engine.speculative``): vLLM's dict, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}``, or a
    ``SpeculativeConfig``; parsed into a ``SpeculativeConfig`` here. None: off."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        dtype_name(self.dtype)
        if self.device != "cpu":  # the default needs no check, so a router's config never imports torch
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device is not a valid torch device: {self.device!r}") from e
        for name, lo in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                         ("kv_cache_memory_bytes", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {v!r}")
        if not isinstance(self.kv_cache_shared, bool):
            raise ValueError(f"kv_cache_shared must be a bool, got {self.kv_cache_shared!r}")
        if self.kv_cache_shared and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"kv_cache_shared is for CPU and CUDA caches, not device {self.device!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.cpu_gemm not in ("onednn", "onednn_only", "torch", "pdserve"):
            raise ValueError(f"cpu_gemm must be 'onednn', 'onednn_only', 'pdserve' or 'torch', got {self.cpu_gemm!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, "
                             f"got {self.quantization!r}")
        g = self.quantization_group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < 32 or g % 32:
            raise ValueError(f"quantization_group_size must be a positive multiple of 32, got {g!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {self.kv_cache_dtype!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("enforce_eager", "static_decode_buffers", "batch_invariant", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = check_graph_sizes(self.cuda_graph_sizes, self.max_num_seqs)
        if self.cuda_graph_token_sizes is not None:
            self.cuda_graph_token_sizes = check_token_sizes(self.cuda_graph_token_sizes, self.max_num_batched_tokens)
        if self.batch_invariant and str(self.device).startswith("cuda"):
            if self.quantization is not None or self.kv_cache_dtype != "auto":
                raise ValueError("batch_invariant covers float weights and a float KV cache on CUDA (pdserve's Triton "
                                 f"GEMM and attention), not quantization={self.quantization!r} / "
                                 f"kv_cache_dtype={self.kv_cache_dtype!r}")
        from engine.lora import parse_lora_modules

        self.lora_modules = parse_lora_modules(self.lora_modules) or None
        if self.lora_modules:
            if not str(self.device).startswith("cpu"):
                raise ValueError(f"lora_modules do not work with device {self.device!r} (LoRA adapters run on CPU "
                                 "engines; not yet on a GPU)")
        from engine.speculative import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.async_scheduling:
            why = None
            if self.speculative_config is not None:
                why = "speculative decoding (a verification's accepted count is known only once it is read back)"
            elif self.tensor_parallel_size > 1:
                why = "tensor_parallel_size > 1 (its ranks are CPU processes that take each step's inputs from rank 0)"
            elif not str(self.device).startswith("cuda") and not self.static_decode_buffers:
                why = (f"device {self.device!r}: a CPU forward runs on the thread that schedules, so there is nothing "
                       "to overlap (static_decode_buffers runs the path for tests)")
            if why is not None:
                raise ValueError(f"async_scheduling does not work with {why}")

    @property
    def torch_dtype(self) -> "torch.dtype":
        """The model dtype as a torch dtype (imports torch)."""
        return parse_dtype(self.dtype)

    @property
    def cache_dtype(self) -> "torch.dtype":
        """The KV cache tensors' dtype: the model dtype, or int8 (imports torch)."""
        if self.kv_cache_dtype == "int8":
            import torch

            return torch.int8
        if self.kv_cache_dtype == "fp8":
            import torch

            return torch.float8_e4m3fn
        return self.torch_dtype


@dataclass
class ModelConfig:
    """Shape and numerics of one Llama-family decoder (the subset of HF config.json we use)."""

    architecture: str = "LlamaForCausalLM"
    """HF architecture name."""
    vocab_size: int = 8192
    """Rows of the embedding / LM head."""
    hidden_size: int = 128
    """Residual stream width."""
    intermediate_size: int = 256
    """SwiGLU inner width."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """KV heads (GQA when fewer than query heads)."""
    head_dim: int = 32
    """Per-head width."""
    max_position_embeddings: int = 2048
    """Longest sequence the positions table covers."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Optional[dict] = None
    """None or {'rope_type': 'llama3'|'linear'|'default', ...} as in HF."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections have biases (Qwen2)."""
    qk_norm: bool = False
    """Each query and key head is RMS-normalised (its own weight, shared by the heads) before RoPE (Qwen3)."""
    num_experts: int = 0
    """Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): experts per MoE layer; 0: every MLP is dense."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k of the router's softmax)."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU inner width."""
    norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen3-MoE by its config)."""
    embedding_multiplier: float = 1.0
    """Granite's scalars: the embeddings are multiplied by this, ..."""
    residual_multiplier: float = 1.0
    """... each block's attention and MLP outputs by this before the residual add, ..."""
    attention_multiplier: Optional[float] = None
    """... attention scores by this instead of 1 / sqrt(head_dim) (None: that), ..."""
    logits_scaling: float = 1.0
    """... and the logits divided by this. The engine folds them into the weights at load (``CausalLM``)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (every token, gated by a sigmoid), its SwiGLU width; 0: none."""
    moe_layers: list = field(default_factory=list)
    """Per layer: True where its MLP is the MoE block (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``
    keep some dense); empty: none."""
    sliding_windows: list = field(default_factory=list)
    """Per layer: None (full attention) or the window size W (keys with q - k < W)."""
    dtype: str = "float32"
    """Runtime dtype, by name ('float32' | 'bfloat16' | 'float16'; aliases and torch dtypes are normalized);
    ``torch_dtype`` is the torch dtype."""
    bos_token_id: Optional[int] = None
    """From config.json; the tokenizer's wins when present."""
    eos_token_ids: list = field(default_factory=list)
    """From config.json; the tokenizer's wins when present."""
    hidden_act: str = "silu"
    """The MLP's activation: 'silu' (SwiGLU) or 'gelu_pytorch_tanh' (Gemma's GeGLU, tanh-approximated)."""
    gemma_norms: bool = False
    """Gemma 3's norms: every RMSNorm scales by (1 + weight) in float32 before rounding to the model dtype, and the
    attention and MLP outputs are normalised again before their residual adds (four norms a layer)."""
    rope_local_theta: Optional[float] = None
    """RoPE base of the sliding-window layers, unscaled (Gemma 3's local layers); None: every layer the model's."""
    final_logit_softcapping: Optional[float] = None
    """Logits become cap * tanh(logits / cap) (Gemma's); None: as they are."""
    is_encoder: bool = False
    """A bidirectional encoder (``ENCODER_ARCHITECTURES``, engine/encoder.py): learned absolute positions,
    post-LayerNorm blocks, GELU MLP; it serves embeddings or pair scores, never generates."""
    layer_norm_eps: float = 1e-12
    """An encoder's LayerNorm epsilon."""
    type_vocab_size: int = 0
    """An encoder's token-type (segment) embeddings: 2 for BERT (a pair's second text is type 1), 1 for RoBERTa."""
    position_offset: int = 0
    """An encoder's first position id: RoBERTa / XLM-R count positions from ``pad_token_id + 1`` (a pad token
    inside a prompt takes ``pad_token_id`` and does not advance the count, as transformers does); 0 for BERT."""
    pad_token_id: Optional[int] = None
    """config.json's ``pad_token_id`` (RoBERTa's positions)."""
    num_labels: int = 0
    """A sequence classifier's (``...ForSequenceClassification``) outputs (1: a cross-encoder); 0: an embedding
    model."""

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures: unsupported {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 and not self.is_encoder:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_hidden_layers
        if len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError("sliding_windows must have one entry per layer")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts "
                                 f"({self.num_experts})] and moe_intermediate_size >= 1")
            if len(self.moe_layers) != self.num_hidden_layers:
                raise ValueError("moe_layers must have one entry per layer")
        else:
            self.moe_layers = [False] * self.num_hidden_layers
        if self.hidden_act not in (("gelu",) if self.is_encoder else ("silu", "gelu_pytorch_tanh")):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_pytorch_tanh' ('gelu' for an encoder), got "
                             f"{self.hidden_act!r}")
        rt = (self.rope_scaling or {}).get("rope_type", "default")
        if rt not in ("default", "llama3", "linear", "yarn"):
            raise ValueError(f"rope_scaling.rope_type {rt!r} is not supported (default, linear, llama3, yarn)")
        if rt == "yarn" and not self.rope_scaling.get("original_max_position_embeddings"):
            # (from_hf_dict supplies it from max_position_embeddings, as transformers does; factor may then be
            # derived from the two, DeepSeek-V3's rule)
            raise ValueError("rope_scaling: yarn needs original_max_position_embeddings")

    @property
    def torch_dtype(self) -> "torch.dtype":
        """The runtime dtype as a torch dtype (imports torch)."""
        return parse_dtype(self.dtype)

    @property
    def num_params(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        qkv = h * d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        per_layer = (qkv + self.num_attention_heads * d * h + (4 if self.gemma_norms else 2) * h
                     + (2 * d if self.qk_norm else 0))
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)
        moe += (3 * self.shared_expert_intermediate_size + 1) * h if self.shared_expert_intermediate_size else 0
        mlps = sum(moe if sparse else 3 * h * i for sparse in self.moe_layers)
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + mlps + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], dtype: Union[str, "torch.dtype"] = "float32") -> "ModelConfig":
        """Read a HF ``config.json`` dict (transformers 4.x and 5.x rope layouts); ``dtype`` is the runtime dtype
        (a name or a torch dtype), not config.json's."""
        archs = cfg.get("architectures") or []
        arch = _BASE_MODELS.get(archs[0], archs[0]) if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                       "qwen2": "Qwen2ForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM",
                                       "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                       "mixtral": "MixtralForCausalLM",
                                       "qwen2_moe": "Qwen2MoeForCausalLM",
                                       "granite": "GraniteForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                                       "gemma3": "Gemma3ForConditionalGeneration",
                                       "gemma2": "Gemma2ForCausalLM"}.get(cfg.get("model_type", ""), "")
        if arch in ENCODER_ARCHITECTURES:
            return cls._encoder(cfg, arch, dtype)
        if arch == "Gemma2ForCausalLM":
            raise ValueError("architectures: Gemma2ForCausalLM soft-caps its attention scores, which pdserve's "
                             "attention kernels do not do; Gemma 3 (Gemma3ForCausalLM) is supported")
        if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
            cfg, arch = _gemma3_text(cfg), "Gemma3ForCausalLM"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures: unsupported {arch or cfg.get('model_type')!r}; "
                             f"supported: {SUPPORTED_ARCHITECTURES}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_pytorch_tanh', got {act!r}")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // n_heads
        n_layers = int(cfg["num_hidden_layers"])
        # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        params = {k: v for k, v in {**scaling, **rope}.items() if k != "rope_theta"}
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        if params.get("rope_type", "default") == "default":
            params = None
        if params and params.get("rope_type") in ("llama3", "yarn"):
            params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        partial = float((params or {}).pop("partial_rotary_factor", None) or rope.get("partial_rotary_factor")
                        or cfg.get("partial_rotary_factor") or 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
        windows = _sliding_windows(arch, cfg, n_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(x) for x in eos] if isinstance(eos, list) else [int(eos)])
        return cls(
            architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim), max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=params,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("Qwen2ForCausalLM",
                                                                                      "Qwen2MoeForCausalLM")))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"), **_moe_fields(arch, cfg, n_layers),
            **({k: float(cfg[k]) for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                          "logits_scaling") if cfg.get(k) is not None}
               if arch == "GraniteForCausalLM" else {}),
            **cfg.get("_gemma", {}), hidden_act=act,
            sliding_windows=windows, dtype=dtype_name(dtype), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids)

    @classmethod
    def _encoder(cls, cfg: dict[str, Any], arch: str, dtype: Union[str, "torch.dtype"]) -> "ModelConfig":
        """A BERT / RoBERTa / XLM-R config.json (engine/encoder.py); ValueError naming what it cannot compute."""
        pos_type = cfg.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(f"position_embedding_type {pos_type!r} is not supported (absolute only)")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError("is_decoder / add_cross_attention: only plain encoders are supported")
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"hidden_act {act!r} is not supported for an encoder ('gelu' only)")
        roberta = arch.startswith(("Roberta", "XLMRoberta"))
        pad = cfg.get("pad_token_id", 1 if roberta else 0)
        num_labels = len(classifier_labels(cfg)) if arch.endswith("ForSequenceClassification") else 0
        n_heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        if hidden % n_heads:
            raise ValueError(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({n_heads})")
        offset = int(pad) + 1 if roberta else 0
        positions = int(cfg.get("max_position_embeddings", 512)) - offset
        if positions < 1:
            raise ValueError(f"max_position_embeddings leaves no position after the pad offset {offset}")
        return cls(
            architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=hidden // n_heads,
            max_position_embeddings=positions, is_encoder=True, hidden_act=act,
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)), position_offset=offset,
            pad_token_id=None if pad is None else int(pad), num_labels=num_labels, dtype=dtype_name(dtype),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=[])


_BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
                "Qwen3Model": "Qwen3ForCausalLM", "Phi3Model": "Phi3ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM"}
"""Base models (no LM head: how embedding models such as e5-mistral are saved) -> the causal LM the engine builds;
their checkpoints' tensor names have no ``model.`` prefix and no ``lm_head`` (engine/model.py loads them)."""

_GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                        bos_token_id=2, eos_token_id=1)
"""transformers' ``Gemma3TextConfig`` defaults: the Hub's multimodal checkpoints' ``text_config`` leaves some out."""


def _gemma3_text(cfg: dict) -> dict:
    """A Gemma 3 config.json (``Gemma3ForCausalLM``'s, or the text part of ``Gemma3ForConditionalGeneration``'s: the
    engine serves its language model, without the vision tower) as the plain layout ``from_hf_dict`` reads: the
    global layers' RoPE as the model's, the local layers' base in ``_gemma``, with HF's defaults and rules (the
    sliding-window pattern, transformers 4.x's ``rope_local_base_freq`` and 5.x's per-layer-type
    ``rope_parameters``). ValueError for what the engine cannot compute (soft-capped attention, bidirectional
    attention)."""
    text = dict(cfg.get("text_config") or cfg) if "text_config" in cfg else dict(cfg)
    for k, v in _GEMMA3_DEFAULTS.items():
        text.setdefault(k, cfg.get(k, v) if k in ("bos_token_id", "eos_token_id") else v)
    if text.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping={text['attn_logit_softcapping']}: soft-capped attention scores "
                         "are not supported by pdserve's attention kernels")
    if text.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: bidirectional (embedding) Gemma 3 models are not supported")
    if not text.get("layer_types"):  # (HF's rule: every pattern-th layer global, the rest sliding)
        pattern = int(text.get("sliding_window_pattern") or 6)
        text["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                               for i in range(int(text["num_hidden_layers"]))]
    rope = dict(text.get("rope_parameters") or {})
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: one dict per layer type
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:  # transformers 4.x: rope_theta and rope_scaling are the global layers', rope_local_base_freq the local's
        full = {**(text.get("rope_scaling") or {}), **rope}
        full.setdefault("rope_theta", text.get("rope_theta"))
        local = {"rope_theta": text.get("rope_local_base_freq")}
    if full.get("rope_theta") is None:
        full["rope_theta"] = 1_000_000.0
    if local.get("rope_theta") is None:
        local["rope_theta"] = 10_000.0
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"rope_parameters.sliding_attention: rope_type {local.get('rope_type')!r} is not supported "
                         "on Gemma 3's local layers (default only)")
    text.pop("rope_scaling", None)
    text.pop("rope_theta", None)
    text["rope_parameters"] = full
    text["architectures"] = ["Gemma3ForCausalLM"]
    text["hidden_act"] = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    head_dim, qpas = int(text["head_dim"]), float(text["query_pre_attn_scalar"])
    cap = text.get("final_logit_softcapping")
    text["_gemma"] = dict(
        gemma_norms=True, rope_local_theta=float(local["rope_theta"]),
        final_logit_softcapping=None if cap is None else float(cap),
        # scores scaled by query_pre_attn_scalar ** -0.5 (folded into the query norm where it is not head_dim's)
        attention_multiplier=None if qpas == head_dim else qpas ** -0.5,
        embedding_multiplier=float(int(text["hidden_size"]) ** 0.5))
    return text


def _moe_fields(arch: str, cfg: dict, n_layers: int) -> dict:
    """The MoE fields of a Qwen2/3-MoE or Mixtral config.json (HF's rules for which layers are sparse); {} else."""
    if arch == "MixtralForCausalLM":
        return dict(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=[True] * n_layers)
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        # (the Hub's checkpoints say num_experts; transformers 5 writes num_local_experts)
        e = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        return dict(num_experts=e, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                    moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                    moe_layers=[e > 0 and i not in dense and (i + 1) % step == 0 for i in range(n_layers)])
    return {}


def _sliding_windows(arch: str, cfg: dict, n_layers: int) -> list:
    """Per-layer window sizes, following each architecture's HF rules."""
    w = cfg.get("sliding_window")
    if arch == "LlamaForCausalLM" or w is None:
        return [None] * n_layers
    w = int(w)
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [w if t == "sliding_attention" else None for t in layer_types]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            return [None] * n_layers
        first = int(cfg.get("max_window_layers", n_layers))
        return [w if i >= first else None for i in range(n_layers)]
    return [w] * n_layers


def rope_attention_factor(mc: ModelConfig) -> float:
    """What the cos/sin tables are scaled by: YaRN's attention factor (HF's ``_compute_yarn_parameters``: given, or
    from ``factor`` and DeepSeek's ``mscale`` / ``mscale_all_dim``); 1 for every other scaling."""
    sc = mc.rope_scaling or {}
    if sc.get("rope_type") != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = _yarn_factor(mc)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all_dim = sc.get("mscale"), sc.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim)))
    return get_mscale(factor)


def _yarn_factor(mc: ModelConfig) -> float:
    sc = mc.rope_scaling or {}
    if sc.get("factor") is not None:
        return float(sc["factor"])
    return mc.max_position_embeddings / float(sc["original_max_position_embeddings"])  # (DeepSeek-V3's rule)


def rope_inv_freq(mc: ModelConfig) -> "torch.Tensor":
    """Inverse frequencies [head_dim/2] in float32, with HF's default/linear/llama3/yarn scaling (the model's, at
    load); YaRN also scales the tables (``rope_attention_factor``)."""
    import torch

    d = mc.head_dim
    inv = 1.0 / (mc.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = mc.rope_scaling or {}
    rt = sc.get("rope_type", "default")
    if rt == "linear":
        inv = inv / float(sc["factor"])
    elif rt == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    elif rt == "yarn":  # HF's _compute_yarn_parameters: interpolated where the ramp says, extrapolated elsewhere
        base, factor = mc.rope_theta, _yarn_factor(mc)
        old = float(sc["original_max_position_embeddings"])
        fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(fast), correction_dim(slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
        extrapolation = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv

