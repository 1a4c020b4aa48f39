"""``python -m engine``: complete a prompt with the offline API and print the text.

Lifecycle: parse arguments, build one ``LLM``, generate once for each
``--prompt`` and print each completion (one block per prompt), then exit. Bad
arguments exit with status 2 and a message naming the option (argparse, or the
ValueError of SamplingParams/EngineConfig).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description="Generate text with the pdserve engine.")
    ap.add_argument("--model", default="tiny", help="'tiny', 'bench' or a Hugging Face model directory")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--show-tokens", action="store_true", help="also print token ids and finish reason")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    # Imported here so --help answers without loading torch.
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
            ignore_eos=args.ignore_eos)
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.num_threads)
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except ValueError as e:
        ap.error(str(e))
    for i, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{i}] {args.prompt[i]!r}")
        print(out.text)
        if args.show_tokens:
            print(f"token_ids={out.token_ids} finish_reason={out.finish_reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
