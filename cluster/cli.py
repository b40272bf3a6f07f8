"""`pdserve` command line. Each subcommand imports only what it needs, lazily."""
from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--draft-model", default=None, help="draft checkpoint for speculative decoding")
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.add_argument("--speculative-method", default=None, choices=["draft", "ngram"])


def engine_options(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, kernel_backend=args.kernel_backend,
                max_model_len=args.max_model_len, draft_model=args.draft_model,
                num_speculative_tokens=args.num_speculative_tokens, speculative_method=args.speculative_method)


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [])
    llm = LLM(args.model, **engine_options(args))
    llm.engine.tokenize(args.prompt)  # fail before printing anything
    print(args.prompt, end="", flush=True)
    last = None
    for out in llm.stream(args.prompt, params):
        print(out.new_text, end="", flush=True)
        last = out
    print()
    if last is not None:
        print(f"[{len(last.token_ids)} tokens, finish_reason={last.finish_reason_str}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run the offline engine on one prompt, streaming to stdout")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
