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
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="per-sequence speculation depth from acceptance and step costs (default on)")


def engine_options(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, kernel_backend=args.kernel_backend,
                max_model_len=args.max_model_len, draft_model=args.draft_model,
                num_speculative_tokens=args.num_speculative_tokens, speculative_method=args.speculative_method,
                spec_adaptive=args.spec_adaptive)


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

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
        summary = f"[{len(last.token_ids)} tokens, finish_reason={last.finish_reason_str}"
        spec = llm.engine.speculator
        if spec is not None and spec.stats.num_drafts:
            summary += (f", speculative: {spec.stats.num_accepted_tokens}/{spec.stats.num_draft_tokens} draft tokens "
                        f"accepted, {spec.stats.mean_accepted_length:.2f} tokens per step")
        print(summary + "]", file=sys.stderr)
    return 0


def _add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (default: off)")


def _add_worker_args(p: argparse.ArgumentParser, default_port: int) -> None:
    _add_engine_args(p)
    _add_server_args(p, default_port)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: sized by memory)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget (chunked prefill)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds a KV transfer may take")
    p.add_argument("--no-prefix-caching", action="store_true")


def _setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")


def _worker_engine_config(args: argparse.Namespace):
    from pdserve.engine.config import EngineConfig

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    return EngineConfig(model=args.model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        seed=args.seed, enable_prefix_caching=not args.no_prefix_caching, **engine_options(args))


def _decode_worker(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from pdserve.decode_worker.main import run
    from pdserve.decode_worker.server import DecodeServerConfig

    config = DecodeServerConfig(kv_transfer_timeout_s=args.kv_transfer_timeout, stream_timeout_s=args.stream_timeout)
    return run(_worker_engine_config(args), config, args.host, args.port, args.metrics_port)


def _prefill_worker(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from pdserve.prefill_worker.main import run
    from pdserve.prefill_worker.server import PrefillServerConfig

    config = PrefillServerConfig(kv_transfer_timeout_s=args.kv_transfer_timeout, max_chunk_bytes=args.max_chunk_bytes)
    return run(_worker_engine_config(args), config, args.host, args.port, args.metrics_port)


def _router(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from pdserve.router.main import RouterConfig, run

    split = lambda s: [a for a in (s or "").split(",") if a]  # noqa: E731
    config = RouterConfig(model=args.model, prefill_addresses=tuple(split(args.prefill)),
                          decode_addresses=tuple(split(args.decode)), rpc_timeout_s=args.rpc_timeout,
                          connect_timeout_s=args.connect_timeout, health_interval_s=args.health_interval,
                          max_queued_requests=args.max_queued_requests, queue_timeout_s=args.queue_timeout,
                          max_prompt_chars=args.max_prompt_chars)
    return run(config, args.host, args.port, args.http_port, args.metrics_port)


def _profile(args: argparse.Namespace) -> int:
    from pdserve.cluster.profile import profile_main

    return profile_main(args)


def _add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure step costs on a model (and draft): the cost profile for pdserve plan")
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="k, for speculative steps at fixed depth")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads (as the workers will run)")
    p.add_argument("--cpus", default=None, help="pin to these cores first, taskset's form: 0 or 0,2 or 0-3")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0, help="of the speculative steps (acceptance depends on it)")
    p.add_argument("--transfer-bandwidth", type=float, default=None, help="bytes/s (default: measure loopback gRPC)")
    p.add_argument("--transfer-overlap", type=float, default=0.0, help="share of the KV transfer hidden by compute")
    p.add_argument("--request-overhead", type=float, default=0.0, help="seconds from router arrival to the workers")
    p.add_argument("--quick", action="store_true", help="a smaller grid (a minute or so)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True, help="profile JSON to write")
    p.set_defaults(func=_profile)


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

    dec = sub.add_parser("decode-worker", help="serve the decode pool's worker (gRPC)")
    _add_worker_args(dec, 50052)
    dec.add_argument("--stream-timeout", type=float, default=120.0, help="seconds between token deltas at most")
    dec.set_defaults(func=_decode_worker)

    pre = sub.add_parser("prefill-worker", help="serve the prefill pool's worker (gRPC)")
    _add_worker_args(pre, 50051)
    pre.add_argument("--max-chunk-bytes", type=int, default=1 << 20, help="KV bytes per PushKV message at most")
    pre.set_defaults(func=_prefill_worker)

    rt = sub.add_parser("router", help="serve the public Generation API (gRPC) and OpenAI HTTP")
    rt.add_argument("--model", required=True, help="checkpoint directory: its tokenizer is used")
    _add_server_args(rt, 50050)
    rt.add_argument("--http-port", type=int, default=None, help="serve OpenAI /v1/completions (and /metrics) here too")
    rt.add_argument("--prefill", default="", help="prefill worker addresses, comma separated (omit: colocated)")
    rt.add_argument("--decode", required=True, help="decode worker addresses, comma separated")
    rt.add_argument("--rpc-timeout", type=float, default=300.0, help="seconds one request may take end to end")
    rt.add_argument("--connect-timeout", type=float, default=120.0, help="seconds to wait for workers at start")
    rt.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
    rt.add_argument("--max-queued-requests", type=int, default=1024)
    rt.add_argument("--queue-timeout", type=float, default=30.0, help="seconds a request may wait for admission")
    rt.add_argument("--max-prompt-chars", type=int, default=1 << 20)
    rt.set_defaults(func=_router)

    from pdserve.loadgen.cli import add_bench_parser, add_plan_parser  # argparse only; commands import the rest

    add_bench_parser(sub)
    add_plan_parser(sub)
    _add_profile_parser(sub)
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
