"""Train the built-in byte-level BPE tokenizer shared by the ``tiny`` and ``bench`` models.

Lifecycle: run once by hand (``python -m engine.assets.train_tokenizer``); it reads
the Python standard library's own source files (PSF licence, shipped with every
interpreter), trains a 8192-token byte-level BPE with ``tokenizers``, and writes
``tokenizer.json`` and ``tokenizer_config.json`` into ``engine/assets/tokenizer/``.
The committed files are what the engine loads; this script only documents and
reproduces them. The corpus is a sorted, size-capped list of files, so a run on
the same interpreter version gives byte-identical output.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
# A ChatML-like template: each message framed by <|im_start|>role ... <|im_end|>. It opens
# with bos because chat prompts are encoded without special tokens (as transformers does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Top-level stdlib sources only keep training to seconds while still covering
# code, prose docstrings and punctuation; tests/ and vendored trees are skipped.
MAX_CORPUS_BYTES = 12 * 1024 * 1024


def corpus_files(lib_dir: Path, max_bytes: int = MAX_CORPUS_BYTES) -> list[Path]:
    """Sorted stdlib ``.py`` files up to ``max_bytes`` in total (deterministic)."""
    files = []
    total = 0
    for p in sorted(lib_dir.rglob("*.py")):
        rel = p.relative_to(lib_dir).parts
        if any(part in ("test", "tests", "site-packages", "idlelib", "lib2to3") for part in rel):
            continue
        size = p.stat().st_size
        if total + size > max_bytes:
            continue
        files.append(p)
        total += size
    return files


def iter_texts(files: list[Path]) -> Iterator[str]:
    for p in files:
        yield p.read_text(encoding="utf-8", errors="replace")


def train(out_dir: Path, lib_dir: Path) -> Tokenizer:
    """Train the tokenizer on ``lib_dir`` and write both files into ``out_dir``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = corpus_files(lib_dir)
    tok.train_from_iterator(iter_texts(files), trainer=trainer, length=len(files))
    # bos is added by the post-processor (as Llama 3's tokenizer.json does), so every
    # reader of tokenizer.json (ours, transformers, vLLM) agrees on the prompt ids.
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "pdserve_training": {
            "corpus": "CPython standard library sources (PSF licence)",
            "python_version": sys.version.split()[0],
            "num_files": len(files),
            "vocab_size": VOCAB_SIZE,
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "tokenizer")
    ap.add_argument("--lib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = ap.parse_args(argv)
    tok = train(args.out, args.lib)
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
