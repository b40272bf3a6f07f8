"""`ServeConfig`: what `pdserve serve` runs — the model, the router, and each pool's workers —
from a YAML file (`deploy/pdserve.yaml` documents every field) with command-line flags on top.
Every value is validated on load; an error names the field as written in the file
(`decode.workers must be >= 1, got 0`). Read only by the composition roots (`serve.py`, the
controller), which hand each component the part it needs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.decode_worker import LOCAL_PREFILL_TOKENS

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL, DEMO_DRAFT = REPO / "models" / "demo", REPO / "models" / "demo-draft"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: how many workers, what each may use, and engine options for all of them."""

    workers: int = 1
    cpus: float = 0.5  # per worker; fractional allowed; torch threads = max(1, floor(cpus))
    gpus: float = 0.0  # per worker
    engine: dict = field(default_factory=dict)  # EngineConfig fields (block_size, max_num_seqs, …)

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one worker."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}

    @property
    def num_threads(self) -> int:
        return max(1, int(self.cpus))


@dataclass(frozen=True, slots=True)
class RouterSection:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int | None = 8000  # OpenAI API and /metrics; None: off
    # router processes sharing the public ports (SO_REUSEPORT; the kernel spreads connections
    # over them): this one, in `pdserve serve`'s process, and the others as Ray actors on its node
    processes: int = 1
    rpc_timeout: float = 300.0
    queue_timeout: float = 30.0
    max_queued_requests: int = 1024
    max_prompt_chars: int = 1 << 20
    max_failovers: int = 3
    failover_wait: float = 30.0
    # each decode worker's tokens for all of a router's requests on one stream, a message a step;
    # False: each request's on its own call
    token_streams: bool = True
    health_interval: float = 1.0
    drain_timeout: float = 30.0
    http_idle_timeout: float = 75.0  # seconds an HTTP connection may sit with no request in progress (or no reader)
    http_body_timeout: float = 30.0  # seconds a request's body may take after its headers (then 408)
    slo_ttft: float = 1.0  # seconds; requests meeting both SLOs count toward goodput
    slo_tpot: float = 0.1  # seconds per output token after the first


@dataclass(frozen=True, slots=True)
class SecuritySection:
    cluster_token_file: str | None = None  # the internal RPCs' shared secret; default: a new one per run
    cluster_tls_cert: str | None = None  # mutual TLS between the processes: certificate, key, CA
    cluster_tls_key: str | None = None
    cluster_tls_ca: str | None = None
    cluster_tls_server_name: str | None = None  # the name in every process's certificate
    tls_cert: str | None = None  # TLS on the public gRPC and HTTP ports
    tls_key: str | None = None
    api_keys: list = field(default_factory=list)  # keys clients must present (also PDSERVE_API_KEY)
    api_key_rate_limit: float | None = None  # requests per second per key
    api_key_max_concurrency: int | None = None  # requests in flight per key


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str = str(DEMO_MODEL)
    served_model_name: str | None = None  # default: the model directory's name
    draft_model: str | None = str(DEMO_DRAFT)
    num_speculative_tokens: int = 4  # the decode pool's k; 0: no speculation
    speculative_method: str | None = None  # "draft" | "ngram"; default: draft when draft_model is set
    dtype: str = "auto"
    # both pools' KV caches (a pair must agree): "auto" (the model's), or "bfloat16" / "float16"
    # under a float32 model on the CPU: half the bytes a transfer moves
    kv_cache_dtype: str = "auto"
    router: RouterSection = RouterSection()
    security: SecuritySection = SecuritySection()
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    kv_transfer_timeout: float = 30.0
    stream_timeout: float = 120.0
    kv_shm: bool = True  # K/V through shared memory between a prefill and a decode worker on one node
    # K/V bytes over a torch.distributed group (NCCL between GPU workers, device to device; gloo
    # between CPU ones); in place of kv_shm. Off by default: each pair then holds a group open.
    kv_dist: bool = False
    # a decode worker prefills a request itself when its prefix cache holds all but at most this
    # many of the prompt's tokens (a conversation's next turn); 0: never
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS
    # such tails take at most this many tokens in all of a step that also decodes; None: 32 on a CPU
    # (decode_worker.LOCAL_PREFILL_CHUNK_TOKENS), no cap on a GPU; 0: no cap
    local_prefill_chunk_tokens: int | None = None
    # a decode worker sends a request's tokens once this many are new (its first and last at once)
    stream_interval: int = 1
    placement_timeout: float = 60.0  # for the cluster to find the resources of every worker
    start_timeout: float = 300.0  # for every placed worker to load its model and serve
    metrics_targets_file: str | None = None  # Prometheus file-SD list of every process (default: beside the Ray logs)

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and Path(self.model).is_dir(), "model", self.model,
               "must be a checkpoint directory")
        if self.draft_model is not None:
            _check(isinstance(self.draft_model, str) and Path(self.draft_model).is_dir(), "draft_model",
                   self.draft_model, "must be a checkpoint directory")
        _check(isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 0,
               "num_speculative_tokens", self.num_speculative_tokens, "must be an integer >= 0")
        _check(self.speculative_method in (None, "draft", "ngram"), "speculative_method", self.speculative_method,
               "must be 'draft' or 'ngram'")
        for name in ("kv_transfer_timeout", "stream_timeout", "placement_timeout", "start_timeout"):
            _positive(name, getattr(self, name))
        _check(isinstance(self.kv_shm, bool), "kv_shm", self.kv_shm, "must be true or false")
        _check(isinstance(self.kv_dist, bool), "kv_dist", self.kv_dist, "must be true or false")
        _check(isinstance(self.local_prefill_tokens, int) and not isinstance(self.local_prefill_tokens, bool)
               and self.local_prefill_tokens >= 0, "local_prefill_tokens", self.local_prefill_tokens,
               "must be an integer >= 0")
        chunk = self.local_prefill_chunk_tokens
        _check(chunk is None or isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0,
               "local_prefill_chunk_tokens", chunk, "must be an integer >= 0 or null")
        _check(isinstance(self.stream_interval, int) and not isinstance(self.stream_interval, bool)
               and self.stream_interval >= 1, "stream_interval", self.stream_interval, "must be an integer >= 1")
        _check_pool("prefill", self.prefill, minimum=0)
        _check_pool("decode", self.decode, minimum=1)
        _check_router(self.router)
        _check_security(self.security)
        for role in ("prefill", "decode"):
            self.engine_config(role)  # every engine option's value, checked before anything starts
        if self.is_disaggregated:  # what the router's pairing compares (router/workers.py), said before any start
            a, b = self.kv_description("prefill"), self.kv_description("decode")
            for i, name in enumerate(("dtype", "kv_cache_dtype", "block_size")):
                _check(a[i] == b[i], f"prefill.engine.{name} and decode.engine.{name}", (a[i], b[i]),
                       "must agree (as the workers resolve them): a prefill and a decode worker pair only when "
                       "their KV caches do")

    def cluster_security(self):
        """The internal RPCs' credentials: the file's secret, or a new one for this run."""
        import secrets

        from pdserve.serving.auth import ClusterSecurity, TLSFiles, load_cluster_token

        sec = self.security
        token = load_cluster_token(sec.cluster_token_file) if sec.cluster_token_file else secrets.token_urlsafe(32)
        return ClusterSecurity(token, TLSFiles(sec.cluster_tls_cert, sec.cluster_tls_key, sec.cluster_tls_ca,
                                               sec.cluster_tls_server_name))

    def engine_config(self, role: str):
        from pdserve.engine.config import EngineConfig

        try:
            return EngineConfig(**self.engine_options(role))
        except ValueError as e:
            raise ValueError(str(e).replace("EngineConfig.", f"{role}.engine.")) from None

    @property
    def is_disaggregated(self) -> bool:
        return self.prefill.workers > 0

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def kv_description(self, role: str) -> tuple[str, str, int]:
        """The model's dtype, the KV cache's and the block size a worker of `role` will resolve
        (on a GPU where its pool has one, unless its engine names a device)."""
        import torch

        from pdserve.engine.config import kv_dtype_named, resolve_dtype
        from pdserve.engine.disagg import DTYPE_NAMES
        from pdserve.engine.model.config import load_model_config

        engine = self.engine_config(role)
        pool = self.prefill if role == "prefill" else self.decode
        device = torch.device(("cuda" if pool.gpus > 0 else "cpu") if engine.device == "auto" else engine.device)
        dtype = resolve_dtype(engine.dtype, load_model_config(self.model), device)
        return DTYPE_NAMES[dtype], DTYPE_NAMES[kv_dtype_named(engine.kv_cache_dtype, dtype)], engine.block_size

    def engine_options(self, role: str) -> dict:
        """EngineConfig keyword arguments for a worker of `role`."""
        pool = self.prefill if role == "prefill" else self.decode
        spec = {"draft_model": self.draft_model, "speculative_method": self.speculative_method}
        if role == "decode":  # the prefill pool ships the draft's K/V but never speculates
            spec["num_speculative_tokens"] = self.num_speculative_tokens if self.draft_model or \
                self.speculative_method == "ngram" else 0
        return {"model": self.model, "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype, **spec, **pool.engine}


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(name: str, value: Any) -> None:
    _check(_is_number(value) and value > 0, name, value, "must be a number > 0")


def _check_pool(name: str, pool: PoolConfig, minimum: int) -> None:
    _check(isinstance(pool.workers, int) and not isinstance(pool.workers, bool) and pool.workers >= minimum, f"{name}.workers", pool.workers,
           f"must be an integer >= {minimum}")
    _positive(f"{name}.cpus", pool.cpus)
    _check(_is_number(pool.gpus) and pool.gpus >= 0, f"{name}.gpus", pool.gpus, "must be a number >= 0")
    _check(isinstance(pool.engine, dict), f"{name}.engine", pool.engine, "must be a mapping of engine options")
    from pdserve.engine.config import EngineConfig  # validates the engine options' names and values

    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "draft_model", "tokenizer"}
    unknown = sorted(set(pool.engine) - known)
    _check(not unknown, f"{name}.engine", unknown, f"has unknown options (known: {', '.join(sorted(known))})")


def _check_router(r: RouterSection) -> None:
    for name in ("grpc_port", "http_port"):
        value = getattr(r, name)
        if value is not None:
            _check(isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65536, f"router.{name}", value, "must be a port (0: any free one)")
    for name in ("rpc_timeout", "queue_timeout", "failover_wait", "health_interval", "drain_timeout", "slo_ttft",
                 "slo_tpot", "http_idle_timeout", "http_body_timeout"):
        _positive(f"router.{name}", getattr(r, name))
    _check(isinstance(r.processes, int) and not isinstance(r.processes, bool) and r.processes >= 1,
           "router.processes", r.processes, "must be an integer >= 1")
    _check(isinstance(r.token_streams, bool), "router.token_streams", r.token_streams, "must be true or false")
    for name in ("max_queued_requests", "max_failovers", "max_prompt_chars"):
        _check(isinstance(getattr(r, name), int) and not isinstance(getattr(r, name), bool) and getattr(r, name) >= 0, f"router.{name}", getattr(r, name),
               "must be an integer >= 0")


def _check_security(sec: SecuritySection) -> None:
    from pdserve.router.api_keys import ApiKeys
    from pdserve.serving.auth import TLSFiles

    for name in ("cluster_token_file", "cluster_tls_cert", "cluster_tls_key", "cluster_tls_ca", "tls_cert", "tls_key"):
        value = getattr(sec, name)
        _check(value is None or (isinstance(value, str) and Path(value).is_file()), f"security.{name}", value,
               "must be an existing file")
    _check(isinstance(sec.api_keys, list) and all(isinstance(k, str) for k in sec.api_keys), "security.api_keys",
           sec.api_keys, "must be a list of strings")
    for make in (lambda: TLSFiles(sec.cluster_tls_cert, sec.cluster_tls_key, sec.cluster_tls_ca),
                 lambda: TLSFiles(sec.tls_cert, sec.tls_key),
                 lambda: ApiKeys(tuple(sec.api_keys), sec.api_key_rate_limit, sec.api_key_max_concurrency)):
        try:
            make()
        except (ValueError, TypeError) as e:
            raise ValueError(f"security: {e}") from None


SECTIONS = {"router": RouterSection, "security": SecuritySection, "prefill": PoolConfig, "decode": PoolConfig}


def load(path: str | None, overrides: dict[str, Any]) -> ServeConfig:
    """The config from a YAML file (or the defaults), then `overrides` (dotted names, e.g.
    {"decode.workers": 2} or {"decode.engine.spec_verifier": "rejection"}; None values are
    skipped). Paths in the file are relative to the file. ValueError names what is wrong."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(path)
        _resolve_paths(raw, Path(path).parent)
    for dotted, value in overrides.items():
        if value is None:
            continue
        *sections, key = dotted.split(".")  # "decode.engine.spec_verifier": into the file's engine options
        table = raw
        for section in sections:
            table = table.setdefault(section, {})
        table[key] = value
    return _build(ServeConfig, raw, "")


PATH_FIELDS = {"": ("model", "draft_model", "metrics_targets_file"),
               "security": ("cluster_token_file", "cluster_tls_cert", "cluster_tls_key", "cluster_tls_ca", "tls_cert",
                            "tls_key")}


def _resolve_paths(raw: dict, base: Path) -> None:
    """Paths in a config file are relative to the file, not to where the command runs."""
    for section, keys in PATH_FIELDS.items():
        table = raw.get(section) if section else raw
        for key in keys if isinstance(table, dict) else ():
            if isinstance(table.get(key), str) and not Path(table[key]).is_absolute():
                table[key] = str((base / table[key]).resolve())


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of fields, got {type(data).__name__}")
    return data


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ValueError(f"{prefix.rstrip('.')} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"unknown field {prefix}{unknown[0]} (known: {', '.join(fields)})")
    kwargs = {}
    for name, value in raw.items():
        sub = SECTIONS.get(name) if not prefix else None
        kwargs[name] = _build(sub, value, f"{name}.") if sub is not None else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: {e}") from None
