"""The `pdserve` command line's shared options, and the environment variables that set them
where a container would rather set variables than flags. A flag always wins over its variable;
`--help` shows each default (the variable's value when it is set).

| variable | sets | commands |
|---|---|---|
| `PDSERVE_MODEL` | `--model` | generate, prefill-worker, decode-worker, router, serve |
| `PDSERVE_DRAFT_MODEL` | `--draft-model` | generate, prefill-worker, decode-worker, serve |
| `PDSERVE_SERVED_MODEL_NAME` | `--served-model-name` | prefill-worker, decode-worker, router, serve |
| `PDSERVE_HOST` | `--host` | prefill-worker, decode-worker, router, serve |
| `PDSERVE_GRPC_PORT` | `--port` (`--grpc-port` of serve) | prefill-worker, decode-worker, router, serve |
| `PDSERVE_HTTP_PORT` | `--http-port` | router, serve |
| `PDSERVE_METRICS_PORT` | `--metrics-port` | prefill-worker, decode-worker, router |
| `PDSERVE_PREFILL`, `PDSERVE_DECODE` | `--prefill`, `--decode` (worker addresses) | router |
| `PDSERVE_CONFIG` | `--config` | serve |
| `PDSERVE_LOG_LEVEL` | `--log-level` | every command |
| `PDSERVE_LOG_FORMAT` | `--log-format` | every command |
| `PDSERVE_OTLP_ENDPOINT` | `--otlp-endpoint` | prefill-worker, decode-worker, router, serve |
"""
from __future__ import annotations

import argparse
import os

from pdserve.decode_worker import LOCAL_PREFILL_CHUNK_TOKENS, LOCAL_PREFILL_TOKENS
from pdserve.serving.logs import LOG_FORMATS, LOG_LEVELS

ENV_PREFIX = "PDSERVE_"
DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # with a proposer and no -k


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in --help, unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS) or action.required:
            return text
        return super()._get_help_string(action)


def env(flag: str, fallback=None, variable: str | None = None):
    """The default of `flag`: its PDSERVE_* variable when set, else `fallback`."""
    name = variable or ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
    value = os.environ.get(name)
    return value if value not in (None, "") else fallback


def add(p: argparse.ArgumentParser, flag: str, *, variable: str | None = None, required: bool = False,
        help: str = "", **kwargs) -> None:
    """An option whose default may come from the environment (`--model` ← PDSERVE_MODEL)."""
    name = variable or ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
    default = env(flag, kwargs.pop("default", None), name)
    p.add_argument(flag, default=default, required=required and default is None,
                   help=f"{help} [env {name}]".strip(), **kwargs)


def add_logging_args(p: argparse.ArgumentParser, otlp: bool = False) -> None:
    """--log-level, --log-format (every command) and --otlp-endpoint (servers)."""
    if not any("--log-level" in a.option_strings for a in p._actions):
        add(p, "--log-level", default="warning", choices=LOG_LEVELS,
            help="warning: quiet; info: one line per request")
    if not any("--log-format" in a.option_strings for a in p._actions):
        add(p, "--log-format", default="text", choices=LOG_FORMATS, help="text (key=value) or json (one object per line)")
    if otlp:
        add(p, "--otlp-endpoint", help="export OpenTelemetry spans to this OTLP/HTTP collector, e.g. "
            "http://127.0.0.1:4318 (default: none)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add(p, "--model", required=True, help="checkpoint directory (Hugging Face layout)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the KV cache's dtype: the model's (auto), or bfloat16 or float16 under a float32 model on "
                   "the CPU (half the bytes read and moved, twice the blocks; K and V rounded when written)")
    p.add_argument("--device", default="auto")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--cpu-attention", default="auto", choices=["auto", "native", "torch"],
                   help="decode attention on the CPU: the native op where it builds (auto), insist on it, or torch")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "native", "torch"],
                   help="float32 projections on the CPU: packed weights and the native op where it builds with "
                   "AVX-512 or AVX2 (auto), insist on it, or torch's nn.Linear")
    p.add_argument("--graph-capture", default="auto", choices=["auto", "off", "compile", "cuda_graphs"],
                   help="the forward pass as one captured graph: CUDA graphs on CUDA, off on the CPU (auto); "
                   "compile (torch.compile: a faster CPU step, tens of seconds per model at start-up)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    add(p, "--draft-model", help="draft checkpoint for speculative decoding")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help=f"speculation depth; default {DEFAULT_NUM_SPECULATIVE_TOKENS} with --draft-model or "
                   "--speculative-method ngram, else 0 (no speculation); needs one of them")
    p.add_argument("--speculative-method", default=None, choices=["draft", "ngram"],
                   help="default: draft with --draft-model")
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="per-sequence speculation depth from acceptance and step costs")
    p.add_argument("--spec-verifier", default="coupled", choices=["coupled", "rejection"],
                   help="how sampled drafts are verified: coupled (a seeded request's tokens are plain sampling's, "
                   "at any depth) or rejection (accepts more; its tokens depend on the depth); both exact in "
                   "distribution")


def speculation_depth(args: argparse.Namespace, speculates: bool = True) -> int:
    """-k as given, or its documented default; ValueError when -k has no proposer. A worker
    that never speculates (prefill) takes a draft only to fill its cache: 0 unless given."""
    k, has_proposer = args.num_speculative_tokens, bool(args.draft_model or args.speculative_method)
    if k is not None and k > 0 and not has_proposer:
        raise ValueError("--num-speculative-tokens needs a proposer: --draft-model PATH or --speculative-method ngram")
    if k is None:
        return DEFAULT_NUM_SPECULATIVE_TOKENS if has_proposer and speculates else 0
    return k


def add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    add(p, "--host", default="127.0.0.1")
    add(p, "--port", variable="PDSERVE_GRPC_PORT", type=int, default=default_port, help="gRPC port (0: a free one)")
    add(p, "--metrics-port", type=int, help="serve Prometheus /metrics here (default: off)")
    add_logging_args(p, otlp=True)


def add_worker_args(p: argparse.ArgumentParser, default_port: int) -> None:
    add_engine_args(p)
    add(p, "--served-model-name", help="the model's name in metrics, as the router's (default: the checkpoint "
        "directory's name)")
    add_server_args(p, default_port)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: sized by memory)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget (chunked prefill)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None, help="the most prompt tokens a step that also "
                   "decodes takes, so a prompt's prefill delays the running requests' next tokens by a few short "
                   "steps, not one long one, at its own TTFT (a colocated worker's prompts, a decode worker's "
                   "prefill fallback); default: no cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds a KV transfer may take")
    p.add_argument("--no-kv-shm", action="store_true", help="never move K/V through shared memory, even between "
                   "workers on one node (default: a prefill worker's KV cache lives in /dev/shm and a decode worker "
                   "whose probe it can open copies from it; any other pair uses gRPC)")
    p.add_argument("--kv-dist", action="store_true", help="prefill worker: send K/V bytes over a torch.distributed "
                   "group (NCCL between CUDA caches, gloo between host caches) to decode workers that take it, gRPC "
                   "carrying the rest; in place of shared memory")
    p.add_argument("--no-kv-dist", action="store_true", help="decode worker: take no K/V over torch.distributed "
                   "(default: take it in the backend of its cache's device)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--local-prefill-tokens", type=int, default=LOCAL_PREFILL_TOKENS, help="decode worker: "
                   "prefill a disaggregated request itself when its prefix cache holds all but at most this many "
                   "of the prompt's tokens (a conversation's next turn), instead of the prefill worker; 0: never "
                   "(default: %(default)s)")
    p.add_argument("--local-prefill-chunk-tokens", type=int, default=None, help="decode worker: such tails take at "
                   "most this many tokens in all of a step that also decodes (0: no cap; default: %d on a CPU, no cap "
                   "on a GPU)" % LOCAL_PREFILL_CHUNK_TOKENS)
    p.add_argument("--stream-interval", type=int, default=1, help="decode worker: send a request's tokens once "
                   "this many are new (its first and last at once): N writes N times fewer stream messages here and "
                   "at the router, and clients get tokens N at a time (default: %(default)s, every token)")
    p.add_argument("--no-merge-backlog", action="store_true", help="decode worker: send each engine output as a "
                   "message of its own even when a stream fell behind its engine (by default what waits goes as one "
                   "message; off only to measure what that saves)")
    p.add_argument("--no-warmup", action="store_true", help="serve without running one request through first")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds live requests get to finish before the worker stops")
    p.add_argument("--advertise-address", default=None, help="HOST:PORT other processes reach this worker at "
                   "(default: the address it binds; set it when binding 0.0.0.0)")
    add_cluster_security_args(p)


def add_cluster_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster credentials (the internal RPCs between router and workers)")
    g.add_argument("--cluster-token-file", default=None, help="file holding the cluster's shared secret "
                   "(or PDSERVE_CLUSTER_TOKEN); without one, internal calls are not authenticated")
    g.add_argument("--cluster-tls-cert", default=None, help="this process's certificate for mutual TLS")
    g.add_argument("--cluster-tls-key", default=None, help="its private key")
    g.add_argument("--cluster-tls-ca", default=None, help="the CA every peer's certificate must chain to")
    g.add_argument("--cluster-tls-server-name", default=None, help="the name peers' certificates carry "
                   "(default: their address's host)")


def add_public_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the public APIs (gRPC and HTTP)")
    g.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    g.add_argument("--tls-key", default=None, help="and this private key")
    g.add_argument("--api-key", action="append", default=None, help="a key clients must present as "
                   "'authorization: Bearer <key>' (repeatable; or PDSERVE_API_KEY, comma separated)")
    g.add_argument("--api-key-rate-limit", type=float, default=None, help="requests per second per key")
    g.add_argument("--api-key-max-concurrency", type=int, default=None, help="requests in flight per key")


# `pdserve serve` flags a container may set through the environment instead
_SERVE_ENV = {"--config": "PDSERVE_CONFIG", "--model": "PDSERVE_MODEL", "--draft-model": "PDSERVE_DRAFT_MODEL",
              "--served-model-name": "PDSERVE_SERVED_MODEL_NAME", "--host": "PDSERVE_HOST",
              "--grpc-port": "PDSERVE_GRPC_PORT", "--http-port": "PDSERVE_HTTP_PORT"}


def add_serve_args(sv) -> None:
    """`pdserve serve`'s options: flags over the config file's settings."""
    add(sv, "--config", help="YAML file describing the pools (see deploy/pdserve.yaml); flags override it")
    sv.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto' or HOST:PORT) instead "
                    "of starting a private local one")
    sv.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded Ray (default: all)")
    sv.add_argument("--no-ray-dashboard", dest="ray_dashboard", action="store_false",
                    help="start the embedded Ray without its dashboard's modules: about 2 s less to start and ten "
                    "processes fewer, but no `ray list actors` (Ray's state API is one of them)")
    add_logging_args(sv, otlp=True)
    for flag, kind, what in [
            ("--model", str, "checkpoint directory (default: the demo model)"),
            ("--draft-model", str, "draft checkpoint (default: the demo draft)"),
            ("--num-speculative-tokens", int, "speculation depth k of the decode pool"),
            ("--speculative-method", str, "'draft' or 'ngram'"),
            ("--spec-verifier", str, "the decode pool's verifier of sampled drafts: 'coupled' or 'rejection' "
             "(README, speculative decoding)"),
            ("--served-model-name", str, "model name in the API and metrics"),
            ("--dtype", str, "auto, float32, bfloat16 or float16"),
            ("--kv-cache-dtype", str, "the KV cache's: auto (the model's), or bfloat16 or float16 under a float32 "
             "model on the CPU"),
            ("--prefill-workers", int, "prefill workers (0: colocated)"),
            ("--decode-workers", int, "decode workers"),
            ("--prefill-cpus", float, "CPUs per prefill worker (fractions allowed)"),
            ("--decode-cpus", float, "CPUs per decode worker"),
            ("--local-prefill-tokens", int, "a decode worker prefills a request itself when its prefix cache "
             "holds all but at most this many prompt tokens (0: never)"),
            ("--local-prefill-chunk-tokens", int, "such tails take at most this many tokens in all of a step that "
             "also decodes (0: no cap; default: %d on a CPU, no cap on a GPU)" % LOCAL_PREFILL_CHUNK_TOKENS),
            ("--stream-interval", int, "a decode worker sends a request's tokens once this many are new (its "
             "first and last at once): fewer stream messages, tokens N at a time (default: 1)"),
            ("--gpus-per-worker", float, "GPUs per worker of both pools"),
            ("--host", str, "the router's address"),
            ("--grpc-port", int, "the public gRPC API (0: a free port)"),
            ("--http-port", int, "the OpenAI HTTP API and /metrics (0: a free port)"),
            ("--router-processes", int, "router processes sharing the public ports (the kernel spreads client "
             "connections over them): more cores for streaming and parsing"),
            ("--drain-timeout", float, "seconds in-flight requests get on shutdown"),
            ("--max-failovers", int, "times a request may move after a worker fails"),
            ("--placement-timeout", float, "seconds to place and load every worker"),
            ("--metrics-targets-file", str, "where to write the Prometheus file-SD target list"),
            ("--cluster-token-file", str, "the internal RPCs' shared secret (default: a new one per run)"),
            ("--tls-cert", str, "TLS certificate of the public ports"), ("--tls-key", str, "and its key")]:
        if flag in _SERVE_ENV:
            add(sv, flag, variable=_SERVE_ENV[flag], type=kind, help=what + " (default: the config's)")
        else:
            sv.add_argument(flag, type=kind, default=None, help=what + " (default: the config's)")
    sv.add_argument("--api-key", action="append", default=None, help="an API key clients must present (repeatable)")
    sv.add_argument("--no-speculation", action="store_true", help="decode without speculative decoding")
    sv.add_argument("--no-kv-shm", action="store_true", help="never move K/V through shared memory, even between "
                    "a prefill and a decode worker on one node (default: the config's kv_shm)")
    sv.add_argument("--no-token-streams", action="store_true", help="the routers take each request's tokens on its "
                    "own call, not on one stream per decode worker (default: the config's router.token_streams)")
    sv.add_argument("--kv-dist", action="store_true", help="move K/V bytes over torch.distributed groups (NCCL "
                    "between GPU workers, gloo between CPU ones) instead of gRPC or shared memory (default: the "
                    "config's kv_dist)")


def add_profile_args(p) -> None:
    """`pdserve profile`'s options."""
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="k, for speculative steps at fixed depth")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the workers' KV cache (auto: the model's): a transfer's bytes per token follow it")
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
