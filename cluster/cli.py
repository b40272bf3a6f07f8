"""`pdserve` command line. Each subcommand imports only what it needs, lazily."""
from __future__ import annotations

import argparse
import sys

from pdserve.cluster.cli_options import (HelpFormatter, add, add_cluster_security_args, add_engine_args,
                                         add_logging_args, add_profile_args, add_public_security_args, add_serve_args,
                                         add_server_args, add_worker_args, speculation_depth)


def engine_options(args: argparse.Namespace, speculates: bool = True) -> dict:
    return dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
                kernel_backend=args.kernel_backend,
                cpu_attention=args.cpu_attention, cpu_linear=args.cpu_linear, graph_capture=args.graph_capture,
                max_model_len=args.max_model_len,
                draft_model=args.draft_model,
                num_speculative_tokens=speculation_depth(args, speculates),
                speculative_method=args.speculative_method, spec_adaptive=args.spec_adaptive,
                spec_verifier=args.spec_verifier)


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


def _worker_engine_config(args: argparse.Namespace, speculates: bool):
    from pdserve.engine.config import EngineConfig

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    return EngineConfig(model=args.model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_chunk_tokens=args.prefill_chunk_tokens, seed=args.seed,
                        enable_prefix_caching=not args.no_prefix_caching,
                        **engine_options(args, speculates))


def _serve(name: str, serve) -> int:
    """Run a server coroutine factory until SIGTERM/SIGINT; print one ready line with the
    addresses it bound. `serve(until, on_ready)` is the component's whole life."""
    import asyncio

    from pdserve.serving.grpc_server import wait_for_signal

    def ready(addresses: dict) -> None:
        words = " ".join(f"{k}={v}" for k, v in addresses.items() if v is not None)
        print(f"pdserve {name + ' ' if name else ''}ready: {words}", flush=True)

    async def main() -> None:
        until = asyncio.ensure_future(wait_for_signal())  # signals handled from the start, loading included
        await asyncio.sleep(0)  # let it install its handlers before anything else runs
        try:
            await serve(until, ready)
        finally:
            until.cancel()

    try:
        asyncio.run(main())
    finally:
        from pdserve.serving.tracing import shutdown_tracing

        shutdown_tracing()  # the last spans, before the process goes
    return 0


def cluster_security(args: argparse.Namespace, role: str):
    from pdserve.serving.auth import ClusterSecurity, TLSFiles, load_cluster_token, warn_if_open

    token = load_cluster_token(args.cluster_token_file)
    warn_if_open(token, role)
    tls = TLSFiles(args.cluster_tls_cert, args.cluster_tls_key, args.cluster_tls_ca, args.cluster_tls_server_name)
    return ClusterSecurity(token, tls)


def _worker(args: argparse.Namespace, make_service) -> int:
    from pdserve.serving.worker import serve_worker

    check_ports_free(args.host, [args.port, args.metrics_port])  # first: a taken port is the only line printed
    service = make_service()
    engine_config = _worker_engine_config(args, speculates=service.role == "decode")
    return _serve(args.command, lambda until, ready: serve_worker(
        service, engine_config, args.host, args.port, args.metrics_port, until,
        lambda a: ready({"grpc": a.grpc, "metrics": a.metrics}), drain_timeout_s=args.drain_timeout,
        advertise=args.advertise_address, warmup=not args.no_warmup, model_name=args.served_model_name))


def _decode_worker(args: argparse.Namespace) -> int:
    from pdserve.decode_worker.server import DecodeServerConfig, DecodeWorkerServicer

    config = DecodeServerConfig(kv_transfer_timeout_s=args.kv_transfer_timeout, stream_timeout_s=args.stream_timeout,
                                kv_shm=not args.no_kv_shm, kv_dist=not args.no_kv_dist,
                                local_prefill_tokens=args.local_prefill_tokens,
                                local_prefill_chunk_tokens=args.local_prefill_chunk_tokens,
                                stream_interval=args.stream_interval, merge_backlog=not args.no_merge_backlog)
    return _worker(args, lambda: DecodeWorkerServicer(config, security=cluster_security(args, "decode worker")))


def _prefill_worker(args: argparse.Namespace) -> int:
    from pdserve.prefill_worker.server import PrefillServerConfig, PrefillWorkerServicer

    config = PrefillServerConfig(kv_transfer_timeout_s=args.kv_transfer_timeout, max_chunk_bytes=args.max_chunk_bytes,
                                 kv_shm=not args.no_kv_shm, kv_dist=args.kv_dist)
    return _worker(args, lambda: PrefillWorkerServicer(config, security=cluster_security(args, "prefill worker")))


def _router(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.router.main import serve

    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: no such checkpoint directory")
    split = lambda s: [a for a in (s or "").split(",") if a]  # noqa: E731
    if args.reuse_port and args.http_port is not None and args.metrics_port is None:
        raise ValueError("--reuse-port with --http-port needs a --metrics-port of this router's own: /metrics on "
                         "the shared HTTP port answers for whichever router the connection reached")
    # shared ports are in use by the other routers: only this one's own are checked
    check_ports_free(args.host, [args.metrics_port] if args.reuse_port else [args.port, args.http_port, args.metrics_port])
    config = router_config(args)
    return _serve("router", lambda until, ready: serve(config, split(args.prefill), split(args.decode), args.host,
                                                       args.port, args.http_port, args.metrics_port, until, ready,
                                                       args.drain_timeout, args.reuse_port))


def router_config(args: argparse.Namespace):
    from pdserve.router.api_keys import ApiKeys
    from pdserve.router.main import RouterConfig
    from pdserve.router.metrics import SLO
    from pdserve.router.server import RouterPolicy
    from pdserve.serving.auth import TLSFiles

    policy = RouterPolicy(rpc_timeout_s=args.rpc_timeout, queue_timeout_s=args.queue_timeout,
                          max_failovers=args.max_failovers, failover_wait_s=args.failover_wait,
                          token_streams=not args.no_token_streams)
    slo = {k: v for k, v in (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot)) if v is not None}
    return RouterConfig(model=args.model, served_model_name=args.served_model_name, policy=policy,
                        connect_timeout_s=args.connect_timeout,
                        health_interval_s=args.health_interval, max_queued_requests=args.max_queued_requests,
                        max_prompt_chars=args.max_prompt_chars, cluster=cluster_security(args, "router"),
                        tls=TLSFiles(args.tls_cert, args.tls_key),
                        api_keys=ApiKeys.from_flags(args.api_key, args.api_key_rate_limit, args.api_key_max_concurrency),
                        slo=SLO(**slo), http_idle_timeout_s=args.http_idle_timeout,
                        http_body_timeout_s=args.http_body_timeout)


# `pdserve serve` flag -> config field (dotted: section.field)
SERVE_OVERRIDES = {
    "model": "model", "draft_model": "draft_model", "num_speculative_tokens": "num_speculative_tokens",
    "speculative_method": "speculative_method", "served_model_name": "served_model_name", "dtype": "dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "prefill_workers": "prefill.workers", "decode_workers": "decode.workers", "prefill_cpus": "prefill.cpus",
    "decode_cpus": "decode.cpus", "gpus_per_worker": None, "host": "router.host", "grpc_port": "router.grpc_port",
    "http_port": "router.http_port", "router_processes": "router.processes", "drain_timeout": "router.drain_timeout", "max_failovers": "router.max_failovers",
    "placement_timeout": "placement_timeout", "metrics_targets_file": "metrics_targets_file",
    "cluster_token_file": "security.cluster_token_file", "tls_cert": "security.tls_cert",
    "tls_key": "security.tls_key", "api_key": "security.api_keys", "spec_verifier": "decode.engine.spec_verifier",
    "local_prefill_tokens": "local_prefill_tokens", "local_prefill_chunk_tokens": "local_prefill_chunk_tokens",
    "stream_interval": "stream_interval",
}


def serve_config(args: argparse.Namespace):
    """`pdserve serve`'s configuration: the config file (or the defaults) under the flags."""
    from pdserve.cluster.config import load

    overrides = {field: getattr(args, flag) for flag, field in SERVE_OVERRIDES.items() if field}
    if args.gpus_per_worker is not None:
        overrides.update({"prefill.gpus": args.gpus_per_worker, "decode.gpus": args.gpus_per_worker})
    if args.no_speculation:
        overrides["num_speculative_tokens"] = 0
    if args.no_kv_shm:
        overrides["kv_shm"] = False
    if args.no_token_streams:
        overrides["router.token_streams"] = False
    if args.kv_dist:
        overrides["kv_dist"] = True
    return load(args.config, overrides)


def _serve_system(args: argparse.Namespace) -> int:
    config = serve_config(args)
    r = config.router
    check_ports_free(r.host, [p for p in (r.grpc_port, r.http_port) if p])
    from pdserve.cluster import serve as system

    print("starting Ray" if args.ray_address is None else f"joining Ray at {args.ray_address}", file=sys.stderr,
          flush=True)
    connection = system.start_ray(args.ray_address, args.num_cpus, args.ray_dashboard)
    conn_file = system.write_connection_file(connection, embedded=args.ray_address is None)
    try:
        return _serve("", lambda until, ready: system.serve(config, args.ray_address, telemetry(args), until, ready))
    finally:
        conn_file.unlink(missing_ok=True)
        system.stop_ray()


def check_ports_free(host: str, ports: list[int]) -> None:
    """One clear line before anything loads when a port is taken."""
    import socket

    for port in ports:
        if not port:  # None (off) or 0 (any free port)
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
            try:
                s.bind((host, port))
            except OSError as e:
                raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _scale(args: argparse.Namespace) -> int:
    from pdserve.cluster.serve import connect_to_running

    controller = connect_to_running(args.ray_address)
    import ray

    try:
        counts = ray.get(controller.scale.remote(args.prefill, args.decode, args.routers), timeout=args.timeout)
    except ray.exceptions.RayTaskError as e:  # the controller's own error (a bad count, no room): one line
        raise ValueError(str(e.cause.args[0] if e.cause and e.cause.args else e.cause)) from None
    print(f"pdserve scaled: prefill={counts['prefill']} decode={counts['decode']} routers={counts['routers']}",
          flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from pdserve.cluster.serve import connect_to_running

    controller = connect_to_running(args.ray_address)
    import ray

    status = ray.get(controller.status.remote(), timeout=60)
    members = [dataclasses.asdict(m) for m in sorted(status["members"], key=lambda m: m.worker_id)]
    if args.json:
        print(json.dumps({"version": status["version"], "workers": members, "placed": status["placed"]}))
        return 0
    for m in members:
        print(f"{m['worker_id']:12} {m['address']:22} metrics={m['metrics_address']:22} node={m['node_id'][:12]} "
              f"pid={m['pid']}{' (restarted)' if m['is_restart'] else ''}")
    starting = sorted(set(status["placed"]) - {m["worker_id"] for m in members})
    if starting:
        print("not serving yet: " + ", ".join(starting))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from pdserve.cluster.profile import profile_main

    return profile_main(args)


def _add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure step costs on a model (and draft): the cost profile for pdserve plan")
    add_profile_args(p)
    p.set_defaults(func=_profile)


def build_parser() -> argparse.ArgumentParser:
    from pdserve import __version__

    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving. Settings also come "
                                     "from PDSERVE_* environment variables (a flag wins); each command's --help "
                                     "names them.")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run the offline engine on one prompt, streaming to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=_generate)

    dec = sub.add_parser("decode-worker", help="serve the decode pool's worker (gRPC)")
    add_worker_args(dec, 50061)
    dec.add_argument("--stream-timeout", type=float, default=120.0, help="seconds between token deltas at most")
    dec.set_defaults(func=_decode_worker)

    pre = sub.add_parser("prefill-worker", help="serve the prefill pool's worker (gRPC); with --draft-model it "
                         "fills the draft's KV cache too (prefill workers never speculate)")
    add_worker_args(pre, 50071)
    pre.add_argument("--max-chunk-bytes", type=int, default=4 << 20, help="KV bytes per PushKV message at most")
    pre.set_defaults(func=_prefill_worker)

    rt = sub.add_parser("router", help="serve the public Generation API (gRPC) and the OpenAI API (HTTP)")
    add(rt, "--model", required=True, help="checkpoint directory: its tokenizer and chat template are used")
    add(rt, "--served-model-name", help="the model's name in /v1/models, requests and metrics "
        "(default: the checkpoint directory's name)")
    add_server_args(rt, 50051)
    add(rt, "--http-port", type=int, help="serve the OpenAI API (and /metrics) here too (default: off)")
    add(rt, "--prefill", default="", help="prefill worker addresses, comma separated (none: colocated)")
    add(rt, "--decode", required=True, help="decode worker addresses, comma separated")
    rt.add_argument("--rpc-timeout", type=float, default=300.0, help="seconds one request may take end to end")
    rt.add_argument("--connect-timeout", type=float, default=120.0, help="seconds to wait for workers at start")
    rt.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
    rt.add_argument("--max-queued-requests", type=int, default=1024)
    rt.add_argument("--queue-timeout", type=float, default=30.0, help="seconds a request may wait for admission")
    rt.add_argument("--max-prompt-chars", type=int, default=1 << 20)
    rt.add_argument("--max-failovers", type=int, default=3,
                    help="times a request may move to other workers after one fails mid-request")
    rt.add_argument("--failover-wait", type=float, default=30.0,
                    help="seconds a failing-over request waits for a usable worker to (re)appear")
    rt.add_argument("--slo-ttft", type=float, default=None,
                    help="TTFT SLO in seconds (default 1): requests meeting both SLOs count toward goodput")
    rt.add_argument("--slo-tpot", type=float, default=None,
                    help="SLO on the time per output token after the first, seconds (default 0.1)")
    rt.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds in-flight requests get before they end with UNAVAILABLE")
    rt.add_argument("--http-idle-timeout", type=float, default=75.0, help="seconds an HTTP connection may sit with "
                    "no request in progress (new, between requests, or in its headers), or streaming to a client that takes nothing, "
                    "before it is closed")
    rt.add_argument("--http-body-timeout", type=float, default=30.0,
                    help="seconds a request's body may take to arrive after its headers (then 408)")
    rt.add_argument("--no-token-streams", action="store_true", help="take each request's tokens on its own call, "
                    "not on one stream per decode worker for all of this router's requests (a message a step)")
    rt.add_argument("--reuse-port", action="store_true", help="share --port and --http-port with the other routers "
                    "started with it on this host (SO_REUSEPORT: the kernel spreads connections over them); each "
                    "needs a --metrics-port of its own")
    add_cluster_security_args(rt)
    add_public_security_args(rt)
    rt.set_defaults(func=_router)
    _add_serve_parser(sub)
    _add_scale_parser(sub)
    from pdserve.loadgen.cli import add_bench_parser, add_calibrate_parser, add_plan_parser  # argparse only

    add_bench_parser(sub)
    add_plan_parser(sub)
    add_calibrate_parser(sub)
    _add_profile_parser(sub)
    for command in sub.choices.values():  # every command: defaults in --help, --log-level and --log-format
        command.formatter_class = HelpFormatter
        add_logging_args(command)
    return parser


def _add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="the whole system on Ray: router, prefill and decode pools")
    add_serve_args(sv)
    sv.set_defaults(func=_serve_system)


def _add_scale_parser(sub) -> None:
    sc = sub.add_parser("scale", help="set the worker (and router process) counts of a running `pdserve serve`")
    sc.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
    sc.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    sc.add_argument("--routers", type=int, default=None, help="router processes wanted (a system started with "
                    "router.processes above 1: its ports are shared)")
    sc.add_argument("--ray-address", default=None, help="the cluster it runs on (default: the one a local "
                    "`pdserve serve` started)")
    sc.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the change")
    sc.set_defaults(func=_scale)
    st = sub.add_parser("status", help="the workers of a running `pdserve serve`: where, which node, which process")
    st.add_argument("--ray-address", default=None, help="as for `pdserve scale`")
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.set_defaults(func=_status)


def telemetry(args: argparse.Namespace):
    from pdserve.serving.logs import Telemetry

    return Telemetry(args.log_level, args.log_format, getattr(args, "otlp_endpoint", None))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        telemetry(args).setup(f"pdserve-{args.command}")
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
