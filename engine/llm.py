"""The offline API: ``LLM(model).generate(prompts, params)`` -> ``list[RequestOutput]``.

Lifecycle: ``LLM(...)`` builds one ``LLMEngine`` (model, tokenizer, KV cache)
and keeps it for its own life. Each ``generate`` call tokenizes the prompts,
adds one core request per prompt with an ``OutputProcessor`` beside it, steps
the engine until every request has finished, and returns the outputs in input
order. Text, stop strings and logprob bookkeeping happen in the output
processor, exactly as the router does it, so offline text equals cluster text;
when a stop string ends a request the core request is aborted so its blocks go
back at once. If anything fails mid-way, every request this call added is
aborted before the error propagates, so the engine is left clean.
``embed`` adds each prompt as an embedding request (engine/pooling.py) and returns its vector.
``beam_search`` drives the same engine through ``engine.beam_search`` (no
scheduler; the prompts' KV blocks are shared by their beams) and frees every
block it took before it returns or raises.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from engine.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from engine.config import EngineConfig
from engine.detokenizer import OutputProcessor
from engine.llm_engine import LLMEngine
from engine.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                            EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from engine.pooling import check_dimensions, classify_probs, cross_encoder_score, finish_embedding
from engine.sampling_params import SamplingParams, truncated_prompt
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict]
PromptsType = Union[str, list[int], Sequence[PromptType]]


class LLM:
    """An engine for offline batched generation (the vLLM ``LLM`` shape, n=1)."""

    def __init__(self, model: str = "tiny", dtype: str = "float32", device: str = "cpu",
                 **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, **engine_kwargs))
        self._next_id = 0

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        """None for a model directory without tokenizer files (token-id prompts only)."""
        return self.llm_engine.tokenizer

    def get_tokenizer(self) -> Optional[Tokenizer]:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``LLM.reset_prefix_cache``: forget every cached prompt block (between ``generate`` calls, when no
        request holds one); False when some block is still held."""
        return self.llm_engine.reset_prefix_cache()[0]

    def generate(self, prompts: PromptsType,
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False, priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of ``prompts``.

        ``prompts``: a string, a list of strings, one prompt as a list of token ids,
        a list of such lists, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` dicts.
        ``params``: one SamplingParams for all, or one per prompt (None: defaults).
        ``priority``: vLLM's, one per prompt (lower first; ``SamplingParams.priority`` of each prompt's params).
        """
        texts, token_lists = self._normalize_prompts(prompts)
        plist = self._normalize_params(params, len(token_lists))
        if priority is not None:
            if len(priority) != len(plist):
                raise ValueError(f"priority has {len(priority)} entries for {len(plist)} prompts")
            plist = [dataclasses.replace(p, priority=q) for p, q in zip(plist, priority)]
        eng = self.llm_engine
        rids: list[str] = []
        procs: dict[str, OutputProcessor] = {}
        prompt_lps: dict[str, list] = {}
        pending: set[str] = set()
        try:
            for k, (ids, p) in enumerate(zip(token_lists, plist)):
                ids = token_lists[k] = p.truncate_prompt(list(ids), eng.max_model_len)
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                proc = OutputProcessor(eng.tokenizer, ids, p)
                eng.add_request(rid, ids, p)
                rids.append(rid)
                pending.add(rid)
                procs[rid] = proc
            bar = tqdm(total=len(rids), desc="generate", unit="req", disable=not use_tqdm)
            with bar:
                while pending:
                    if not eng.has_unfinished_requests():
                        # The core finished requests we never saw finish: a bug, not a hang.
                        raise RuntimeError(f"engine idle with {len(pending)} unfinished requests")
                    for out in eng.step():
                        proc = procs.get(out.request_id)
                        if proc is None or out.request_id not in pending:
                            continue
                        if out.prompt_logprobs is not None:
                            prompt_lps[out.request_id] = out.prompt_logprobs
                        delta = proc.process(out.new_token_ids, out.logprobs, out.finish_reason)
                        if delta.finish_reason is None:
                            continue
                        if out.finish_reason is None:
                            # A stop string ended it here; the core does not know yet.
                            eng.abort_request(out.request_id)
                        pending.discard(out.request_id)
                        bar.update(1)
                        logger.debug("request %s finished: %s", out.request_id, delta.finish_reason)
        finally:
            for rid in pending:
                eng.abort_request(rid)
        results = []
        for rid, text, ids in zip(rids, texts, token_lists):
            proc = procs[rid]
            results.append(RequestOutput(
                request_id=rid, prompt=text, prompt_token_ids=list(ids), token_ids=list(proc.token_ids),
                text=proc.text, finish_reason=proc.finish_reason, stop_reason=proc.stop_reason, logprobs=proc.logprobs,
                finished=True,
                prompt_logprobs=prompt_lps.get(rid)))
        return results

    def embed(self, prompts: PromptsType, *, normalize: Optional[bool] = None, dimensions: Optional[int] = None,
              lora_name: Optional[str] = None, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's embedding (pooled as the model says: engine/pooling.py), cut to
        ``dimensions`` for a Matryoshka model and L2-normalised unless ``normalize`` is False (None: the model's
        default), in the order of ``prompts`` (the forms ``generate`` takes). ``truncate_prompt_tokens`` keeps a
        decoder's last tokens, an encoder's first (its tokenizer's truncation, special tokens kept)."""
        eng = self.llm_engine
        if eng.pooling.num_labels:
            raise ValueError("this model is a " + ("cross-encoder: it scores text pairs (LLM.score)"
                                                   if eng.pooling.num_labels == 1 else "classifier (LLM.classify)")
                             + ", it has no embeddings")
        check_dimensions(eng.pooling, dimensions, eng.model_config.hidden_size)
        norm = eng.pooling.normalize if normalize is None else bool(normalize)
        if eng.model_config.is_encoder and truncate_prompt_tokens is not None:
            texts, token_lists = self._encoder_inputs(prompts, truncate_prompt_tokens)
            truncate_prompt_tokens = None
        else:
            texts, token_lists = self._normalize_prompts(prompts)
        params = SamplingParams(lora_name=lora_name)  # (truncated here: -1 keeps the whole context)
        token_lists = [truncated_prompt(list(ids), truncate_prompt_tokens, 0, eng.max_model_len)
                       for ids in token_lists]
        rids, got = self._pool(token_lists, params, use_tqdm, "embed")
        return [EmbeddingRequestOutput(rid, list(ids), EmbeddingOutput(finish_embedding(got[rid], norm, dimensions)),
                                       text) for rid, text, ids in zip(rids, texts, token_lists)]

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]], *,
              truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one ``text_1`` against each ``text_2``, or the two lists pairwise. A cross-encoder
        (engine/encoder.py) reads each pair as one input and scores it (``cross_encoder_score``); an embedding
        model scores the cosine similarity of the two texts' normalised embeddings. ``truncate_prompt_tokens``: a
        cross-encoder's pair cut to that many tokens, longest text first."""
        left = [text_1] if isinstance(text_1, str) else list(text_1)
        right = [text_2] if isinstance(text_2, str) else list(text_2)
        if not left or not right:
            raise ValueError(f"{'text_1' if not left else 'text_2'} must not be empty")
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as many "
                             "as text_2")
        pairs = [(left[0], b) for b in right] if len(left) == 1 else list(zip(left, right))
        eng = self.llm_engine
        if eng.pooling.num_labels > 1:
            raise ValueError(f"this model is a {eng.pooling.num_labels}-label classifier: it classifies texts "
                             "(LLM.classify); a pair's score needs a one-label cross-encoder or an embedding model")
        if not eng.pooling.num_labels:
            a = self.embed([p[0] for p in pairs], normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
            b = self.embed([p[1] for p in pairs], normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
            return [ScoringRequestOutput(y.request_id, y.prompt_token_ids, ScoringOutput(
                math.fsum(u * v for u, v in zip(x.outputs.embedding, y.outputs.embedding))))
                for x, y in zip(a, b)]
        tok = eng.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer: a cross-encoder scores text pairs")
        limit = eng.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        token_lists = [tok.encode_encoder(a, b, limit) for a, b in pairs]
        rids, got = self._pool(token_lists, SamplingParams(), use_tqdm, "score")
        return [ScoringRequestOutput(rid, ids, ScoringOutput(cross_encoder_score(got[rid])))
                for rid, ids in zip(rids, token_lists)]

    def classify(self, prompts: PromptsType, *, truncate_prompt_tokens: Optional[int] = None,
                 use_tqdm: bool = False) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``: each prompt's label probabilities from a sequence classifier (engine/encoder.py:
        softmax over its labels; sigmoid each for a one-label or ``multi_label`` model) and its best label, in the
        order of ``prompts``. ``truncate_prompt_tokens``: its first tokens kept, special tokens too."""
        eng = self.llm_engine
        if not eng.pooling.num_labels:
            raise ValueError("this model is not a classifier (a ...ForSequenceClassification encoder): it has no "
                             "labels to classify into")
        if truncate_prompt_tokens is not None:
            texts, token_lists = self._encoder_inputs(prompts, truncate_prompt_tokens)
        else:
            texts, token_lists = self._normalize_prompts(prompts)
        rids, got = self._pool(token_lists, SamplingParams(), use_tqdm, "classify")
        out = []
        for rid, text, ids in zip(rids, texts, token_lists):
            probs = classify_probs(got[rid], eng.pooling.multi_label)
            out.append(ClassificationRequestOutput(rid, list(ids), ClassificationOutput(probs),
                                                   eng.pooling.labels[probs.index(max(probs))], text))
        return out

    def _encoder_inputs(self, prompts: PromptsType, keep: int) -> tuple[list[Optional[str]], list[list[int]]]:
        """An encoder's prompts cut to ``keep`` tokens (-1: the context) from their end: texts by the tokenizer
        (special tokens kept), token ids as given."""
        eng = self.llm_engine
        keep = eng.max_model_len if keep == -1 else keep
        if keep < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {keep}")
        texts, token_lists = self._normalize_prompts(prompts)
        tok = eng.tokenizer
        return texts, [tok.encode_encoder(t, max_tokens=keep) if t is not None and tok is not None else list(ids)[:keep]
                       for t, ids in zip(texts, token_lists)]

    def _pool(self, token_lists: list[list[int]], params: SamplingParams, use_tqdm: bool,
              desc: str) -> tuple[list[str], dict[str, Any]]:
        """Each token list as a pooling request: (their ids, request id -> the raw pooled output)."""
        eng = self.llm_engine
        rids: list[str] = []
        got: dict[str, Any] = {}
        try:
            for ids in token_lists:
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                eng.add_request(rid, list(ids), params, pooling=True)
                rids.append(rid)
            with tqdm(total=len(rids), desc=desc, unit="req", disable=not use_tqdm) as bar:
                while len(got) < len(rids):
                    if not eng.has_unfinished_requests():
                        raise RuntimeError(f"engine idle with {len(rids) - len(got)} pooling requests unfinished")
                    for out in eng.step():
                        if out.embedding is not None:
                            got[out.request_id] = out.embedding
                            bar.update(1)
        finally:
            for rid in rids:
                if rid not in got:
                    eng.abort_request(rid)
        return rids, got

    def beam_search(self, prompts: PromptsType, params: BeamSearchParams,
                    lora_name: Optional[str] = None) -> list[BeamSearchOutput]:
        """Beam-search every prompt (vLLM's ``LLM.beam_search``; transformers' beam search semantics), under LoRA
        adapter ``lora_name`` (vLLM's ``lora_request``; None: the base model).

        ``prompts`` as for ``generate``. Returns one ``BeamSearchOutput`` per prompt, in order, each with
        ``params.beam_width`` sequences ranked best first. ValueError if the engine is busy (requests of
        another caller still unfinished), for bad prompts, or when one prompt's beams cannot fit the KV cache.
        """
        texts, token_lists = self._normalize_prompts(prompts)
        results = run_beam_search(self.llm_engine, token_lists, params, lora_name=lora_name)
        return [BeamSearchOutput(seqs, text, list(ids)) for seqs, text, ids in zip(results, texts, token_lists)]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """Generate replies to one conversation ([{role, content}, ...]) or a list of them.

        Each conversation is rendered with the model's chat template (which carries
        its own bos) and encoded without adding special tokens, as transformers does;
        ``chat_template_kwargs`` (vLLM's) are extra template variables, e.g.
        ``{"enable_thinking": False}`` for Qwen3.
        """
        extra = dict(chat_template_kwargs or {})
        if not all(isinstance(k, str) and k.isidentifier() for k in extra):
            raise ValueError("chat_template_kwargs keys must be template variable names")
        tok = self.tokenizer
        if tok is None:
            raise ValueError("messages need a tokenizer with a chat_template; this model has none")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            messages = [messages]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation (list of dicts) or a list of conversations")
        texts = [tok.apply_chat_template(conv, add_generation_prompt=True, **extra) for conv in messages]
        outs = self.generate([tok.encode(t, add_special_tokens=False) for t in texts], params, use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    # -- input normalisation --------------------------------------------------------------------

    def _normalize_prompts(self, prompts: PromptsType) -> tuple[list[Optional[str]], list[list[int]]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of strings or token-id lists, "
                             f"got {type(prompts).__name__}")
        if prompts and all(_is_token_id(t) for t in prompts):
            prompts = [list(prompts)]  # a single prompt given as token ids
        texts: list[Optional[str]] = []
        ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValueError(f"prompts[{i}] dict needs 'prompt' or 'prompt_token_ids'")
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"prompts[{i}] is an empty string")
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is text but this model has no tokenizer.json; "
                                     "pass token ids")
                texts.append(p)
                ids.append(self.tokenizer.encode(p))
            elif isinstance(p, (list, tuple)) and p and all(_is_token_id(t) for t in p):
                texts.append(None)
                ids.append([int(t) for t in p])
            else:
                raise ValueError(f"prompts[{i}] must be a non-empty string or a non-empty list of "
                                 f"non-negative token ids, got {p!r:.80}")
        return texts, ids

    @staticmethod
    def _normalize_params(params: Union[SamplingParams, Sequence[SamplingParams], None],
                          n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        if isinstance(params, (list, tuple)):
            if len(params) != n:
                raise ValueError(f"params has {len(params)} entries for {n} prompts")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
            return list(params)
        raise ValueError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0
