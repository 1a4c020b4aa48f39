"""Train the built-in ``tiny`` (target) and ``tiny-draft`` (speculative draft) models.

Lifecycle: run once by hand (``python -m engine.assets.train_models``, needs the
``[test]`` extra for ``transformers``); it reads the same Python standard library
sources the tokenizer was trained on (PSF licence, shipped with every interpreter),
holds out every 20th file, trains each model as a ``transformers``
``LlamaForCausalLM`` on random windows of the rest, reports held-out perplexity,
and writes ``engine/assets/models/<name>/{config.json,model.safetensors}`` (weights
stored as float16 to keep the repository small; the engine computes in float32).
The committed files are what ``engine.builtin`` loads; this script documents and
reproduces them. Everything is seeded: on the same interpreter, torch build and
thread count a rerun gives the same weights (thread count changes the order of
floating-point sums, so another machine may differ in the last bits).
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from engine.assets.train_tokenizer import corpus_files

MODELS_DIR = Path(__file__).parent / "models"
HELD_OUT_EVERY = 20


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": 8192, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }


# name -> (HF config, training steps, peak learning rate, seed)
RECIPES = {
    "tiny": (_llama(hidden=384, layers=4, heads=6, kv_heads=2, inter=1024), 700, 2e-3, 1234),
    "tiny-draft": (_llama(hidden=128, layers=2, heads=2, kv_heads=1, inter=384), 1000, 4e-3, 4321),
}
SEQ_LEN = 256
BATCH = 16


def load_corpus(lib_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams: each file as bos + ids + eos, every 20th file held out."""
    from engine.builtin import tokenizer_dir
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    files = corpus_files(lib_dir)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    train, held = [], []
    for i, enc in enumerate(encs):
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend([bos, *enc.ids, eos])
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


@torch.no_grad()
def perplexity(model, held: torch.Tensor, max_tokens: int = 131072) -> float:
    """exp(mean next-token loss) over non-overlapping SEQ_LEN windows of the held-out stream."""
    model.eval()
    n = min(len(held) - 1, max_tokens) // SEQ_LEN
    total, count = 0.0, 0
    for i in range(0, n, BATCH):
        rows = range(i, min(n, i + BATCH))
        x = torch.stack([held[r * SEQ_LEN:(r + 1) * SEQ_LEN] for r in rows])
        y = torch.stack([held[r * SEQ_LEN + 1:(r + 1) * SEQ_LEN + 1] for r in rows])
        logits = model(input_ids=x).logits.float()
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                   reduction="sum").item()
        count += y.numel()
    model.train()
    return math.exp(total / count)


def train_one(name: str, train: torch.Tensor, held: torch.Tensor, steps: int | None = None) -> dict:
    """Train recipe ``name``, write it under MODELS_DIR/name and return its report."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, n_steps, lr, seed = RECIPES[name]
    n_steps = steps or n_steps
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, n_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup
        else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, n_steps - warmup))))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for step in range(n_steps):
        starts = torch.randint(0, len(train) - SEQ_LEN - 1, (BATCH,), generator=gen)
        x = torch.stack([train[s:s + SEQ_LEN] for s in starts.tolist()])
        y = torch.stack([train[s + 1:s + SEQ_LEN + 1] for s in starts.tolist()])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == n_steps - 1:
            el = time.perf_counter() - t0
            print(f"{name} step {step + 1}/{n_steps} loss {loss.item():.3f} "
                  f"{(step + 1) * BATCH * SEQ_LEN / el:.0f} tok/s {el:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    ppl = perplexity(model, held)
    out = MODELS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    report = {"name": name, "parameters": params, "steps": n_steps, "tokens": n_steps * BATCH * SEQ_LEN,
              "seconds": round(seconds), "threads": torch.get_num_threads(), "seed": seed, "peak_lr": lr,
              "train_tokens_available": len(train), "held_out_tokens": min(len(held) - 1, 131072),
              "held_out_perplexity_fp32": round(ppl, 3), "torch": torch.__version__}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--models", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's step count (trial runs)")
    args = ap.parse_args(argv)
    train, held = load_corpus(args.lib)
    print(f"corpus: {len(train)} training tokens, {len(held)} held-out tokens", flush=True)
    for name in args.models:
        train_one(name, train, held, args.steps)


if __name__ == "__main__":
    main()
