"""The CUDA benchmark's run context: the device, the checkpoint, loaded models cached across phases, and the
report, rewritten to ``cuda_engine.json`` after every phase.

Lifecycle: ``main`` builds one ``Ctx``; each phase loads what it needs through it and records into ``report``;
``Ctx.drop`` frees models between phases.
"""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


from engine.config import ModelConfig

from benchmarks.cuda.checkpoint import Workload


# -- the run's context: device, caches of loaded models, the report ----------------------------------

@dataclass
class Ctx:
    device: str
    ckpt: Path
    shape: dict
    work: Workload
    out: Path
    report: dict
    _hf: dict = field(default_factory=dict)
    _eng: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "cuda_engine.json").write_text(json.dumps(self.report, indent=2, default=str))

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(json.loads((self.ckpt / "config.json").read_text()), torch.bfloat16)

    # at most one transformers model and one engine per dtype are kept; drop() frees them
    def hf(self, dtype: str):
        if dtype not in self._hf:
            import transformers

            dt = getattr(torch, dtype)
            try:
                m = transformers.AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=dt, attn_implementation="sdpa")
            except TypeError:  # transformers 4.x spelling
                m = transformers.AutoModelForCausalLM.from_pretrained(self.ckpt, torch_dtype=dt,
                                                                      attn_implementation="sdpa")
            m = m.to(self.device).eval()
            m.generation_config.eos_token_id = None  # never stop early: the engine runs with ignore_eos
            m.generation_config.pad_token_id = 2
            self._hf[dtype] = m
        return self._hf[dtype]

    def engine(self, dtype: str, eager: bool = False):
        """pdserve's offline ``LLM`` on this checkpoint, sized for every workload of the run; ``eager``: with
        ``enforce_eager`` (no decode graphs; cached as ``dtype + "-eager"``)."""
        key = dtype + ("-eager" if eager else "")
        if key not in self._eng:
            from engine import LLM

            mc = self.model_config()
            w = self.work
            elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem
            tokens = max(max(w.decode_batches) * (w.decode_prompt + w.decode_new + 32),
                         max(b * (n + 32) for b, n in w.prefill), sum(w.parity_lens) + 64 * len(w.parity_lens) * 2)
            step_tokens = max(max(b * n for b, n in w.prefill), sum(w.parity_lens), 2048)
            self._eng[key] = LLM(model=str(self.ckpt), dtype=dtype, device=self.device,
                                 kv_cache_memory_bytes=int(tokens * per_token * 1.25),
                                 max_num_seqs=max(max(w.decode_batches), len(w.parity_lens), 8),
                                 # (no max_model_len: the checkpoint's positions, cut to what this cache holds;
                                 # an explicit one the cache cannot hold is refused)
                                 max_num_batched_tokens=step_tokens, enable_prefix_caching=False,
                                 enforce_eager=eager)
        return self._eng[key]

    def drop(self, hf: tuple = (), eng: tuple = ()) -> None:
        for k in hf:
            self._hf.pop(k, None)
        for k in eng:
            self._eng.pop(k, None)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def log(phase: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] [{phase}] {msg}", flush=True)
