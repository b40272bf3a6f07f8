"""The command line around the servers: --version, defaults and environment variables in
--help, PDSERVE_* settings under flags, speculation flags that would otherwise be silent, a
taken port or a missing model reported in one line before anything loads, and both log formats."""
from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import __version__
from pdserve.cluster.cli import build_parser, main
from pdserve.serving.logs import fields, request_context, setup_logging

PDSERVE = str(Path(sys.executable).with_name("pdserve"))
SERVERS = ("router", "prefill-worker", "decode-worker", "serve")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pdserve {__version__}"


@pytest.mark.parametrize("command", [*SERVERS, "generate", "bench", "plan", "profile", "scale", "status"])
def test_help_shows_defaults_and_log_options(command):
    text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
    assert "(default:" in text and "--log-format" in text and "--log-level" in text
    if command in SERVERS:
        assert "PDSERVE_MODEL" in text and "--otlp-endpoint" in text and "PDSERVE_LOG_FORMAT" in text


def test_environment_sets_what_flags_do_not(monkeypatch):
    monkeypatch.setenv("PDSERVE_MODEL", "/models/m")
    monkeypatch.setenv("PDSERVE_GRPC_PORT", "7001")
    monkeypatch.setenv("PDSERVE_HTTP_PORT", "8001")
    monkeypatch.setenv("PDSERVE_DECODE", "10.0.0.1:1")
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "json")
    monkeypatch.setenv("PDSERVE_OTLP_ENDPOINT", "http://collector:4318")
    args = build_parser().parse_args(["router"])  # --model and --decode are required, unless set
    assert (args.model, args.port, args.http_port, args.decode) == ("/models/m", 7001, 8001, "10.0.0.1:1")
    assert (args.log_format, args.otlp_endpoint, args.log_level) == ("json", "http://collector:4318", "warning")
    args = build_parser().parse_args(["router", "--model", "/other", "--port", "7", "--log-format", "text"])
    assert (args.model, args.port, args.log_format) == ("/other", 7, "text")  # flags win
    monkeypatch.setenv("PDSERVE_CONFIG", "/etc/pdserve.yaml")
    args = build_parser().parse_args(["serve"])
    assert (args.config, args.grpc_port, args.model) == ("/etc/pdserve.yaml", 7001, "/models/m")


def test_serve_flags_override_the_config(tmp_path):
    from pdserve.cluster.cli import serve_config

    config = tmp_path / "pdserve.yaml"
    config.write_text("kv_shm: true\nlocal_prefill_tokens: 64\nlocal_prefill_chunk_tokens: 16\nstream_interval: 4\n"
                      "decode:\n  workers: 3\n")
    default = serve_config(build_parser().parse_args(["serve", "--config", str(config)]))
    assert default.kv_shm is True and default.decode.workers == 3 and default.local_prefill_tokens == 64
    assert default.local_prefill_chunk_tokens == 16 and default.stream_interval == 4
    flagged = serve_config(build_parser().parse_args(["serve", "--config", str(config), "--no-kv-shm",
                                                      "--decode-workers", "2", "--no-speculation",
                                                      "--local-prefill-tokens", "0", "--local-prefill-chunk-tokens",
                                                      "0", "--stream-interval", "2", "--no-token-streams"]))
    assert flagged.kv_shm is False and flagged.decode.workers == 2 and flagged.num_speculative_tokens == 0
    assert flagged.local_prefill_tokens == 0 and flagged.local_prefill_chunk_tokens == 0
    assert flagged.stream_interval == 2
    assert default.router.token_streams is True and flagged.router.token_streams is False
    from pdserve.cluster.cli import router_config
    from pdserve.cluster.serve import router_config as serve_router_config

    assert serve_router_config(flagged, None).policy.token_streams is False
    standalone = ["router", "--model", str(tmp_path), "--decode", "127.0.0.1:1"]
    assert router_config(build_parser().parse_args(standalone)).policy.token_streams is True
    assert router_config(build_parser().parse_args([*standalone, "--no-token-streams"])).policy.token_streams is False
    assert default.kv_cache_dtype == "auto"
    narrow = serve_config(build_parser().parse_args(["serve", "--config", str(config), "--kv-cache-dtype",
                                                     "bfloat16"]))
    assert {narrow.engine_config(role).kv_cache_dtype for role in ("prefill", "decode")} == {"bfloat16"}
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        serve_config(build_parser().parse_args(["serve", "--config", str(config), "--kv-cache-dtype", "int8"]))
    # one pool's cache set apart from the other's: workers that would never pair, refused at once
    config.write_text("prefill:\n  engine: {kv_cache_dtype: bfloat16}\n")
    with pytest.raises(ValueError, match=r"prefill.engine.kv_cache_dtype and decode.engine.kv_cache_dtype must "
                                         r"agree.*\('bfloat16', 'float32'\)"):
        serve_config(build_parser().parse_args(["serve", "--config", str(config)]))
    config.write_text("prefill:\n  engine: {kv_cache_dtype: float32}\n")  # what "auto" resolves to on a CPU
    assert serve_config(build_parser().parse_args(["serve", "--config", str(config)])).is_disaggregated
    config.write_text("decode:\n  engine: {block_size: 8}\n")
    with pytest.raises(ValueError, match="block_size must agree"):
        serve_config(build_parser().parse_args(["serve", "--config", str(config)]))
    config.write_text("prefill:\n  workers: 0\ndecode:\n  engine: {block_size: 8}\n")  # colocated: no pairs
    assert serve_config(build_parser().parse_args(["serve", "--config", str(config)])).engine_config("decode").block_size == 8


def test_serve_takes_the_decode_pools_verifier_beside_the_files_engine_options(tmp_path):
    """--spec-verifier lands in the decode pool's engine options, beside those the file sets
    (merged, not replaced); a verifier the engine does not know is a ValueError naming the field."""
    from pdserve.cluster.cli import serve_config

    config = tmp_path / "pdserve.yaml"
    config.write_text("decode:\n  engine: {max_num_seqs: 16}\n")
    assert serve_config(build_parser().parse_args(["serve", "--config", str(config)])).decode.engine == \
        {"max_num_seqs": 16}
    flagged = serve_config(build_parser().parse_args(["serve", "--config", str(config), "--spec-verifier",
                                                      "rejection"]))
    assert flagged.decode.engine == {"max_num_seqs": 16, "spec_verifier": "rejection"}
    assert flagged.engine_config("decode").spec_verifier == "rejection"
    assert flagged.engine_config("prefill").spec_verifier == "coupled"  # a prefill worker never verifies
    with pytest.raises(ValueError, match="spec_verifier"):
        serve_config(build_parser().parse_args(["serve", "--spec-verifier", "maybe"]))


def test_speculation_flags_are_never_silent(text_checkpoint, capsys):
    assert main(["generate", "--model", str(text_checkpoint), "-k", "3", "--prompt", "x"]) == 2
    assert "needs a proposer" in capsys.readouterr().err
    from pdserve.cluster.cli import engine_options

    with_draft = build_parser().parse_args(["decode-worker", "--model", "m", "--draft-model", "d"])
    assert engine_options(with_draft)["num_speculative_tokens"] == 4  # the documented default
    assert engine_options(with_draft, speculates=False)["num_speculative_tokens"] == 0  # a prefill worker
    ngram = build_parser().parse_args(["decode-worker", "--model", "m", "--speculative-method", "ngram", "-k", "2"])
    assert engine_options(ngram)["num_speculative_tokens"] == 2


@pytest.mark.parametrize("option,value", [("cpu_attention", "torch"), ("cpu_linear", "torch"),
                                          ("graph_capture", "compile")])
@pytest.mark.parametrize("command", ["decode-worker", "prefill-worker", "generate"])
def test_engine_flags_reach_the_engine_options(option, value, command):
    from pdserve.cluster.cli import engine_options

    base = [command, "--model", "m"] + (["--prompt", "x"] if command == "generate" else [])
    assert engine_options(build_parser().parse_args(base))[option] == "auto"
    forced = build_parser().parse_args(base + ["--" + option.replace("_", "-"), value])
    assert engine_options(forced)[option] == value


@pytest.mark.parametrize("command", ["decode-worker", "prefill-worker", "router"])
def test_a_taken_port_is_one_line_before_loading(command, text_checkpoint, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        extra = ["--decode", "127.0.0.1:1"] if command == "router" else []
        assert main([command, "--model", str(text_checkpoint), "--port", str(port), *extra]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"pdserve: error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_router_errors_exit_2_with_one_line_and_no_noise(tmp_path, text_checkpoint):
    missing = subprocess.run([PDSERVE, "router", "--model", str(tmp_path / "nope"), "--decode", "127.0.0.1:1"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip().endswith("no such checkpoint directory")
    secured = {**os.environ, "PDSERVE_CLUSTER_TOKEN": "t" * 32}  # else the loud open-cluster warning is a line too
    unreachable = subprocess.run([PDSERVE, "router", "--model", str(text_checkpoint), "--decode", "127.0.0.1:1",
                                  "--port", "0", "--connect-timeout", "1"], capture_output=True, text=True, timeout=60,
                                 env=secured)
    assert unreachable.returncode == 2
    assert unreachable.stderr.strip().splitlines() == ["pdserve: error: workers not serving after 1 s: ['127.0.0.1:1']"]
    open_cluster = subprocess.run([PDSERVE, "router", "--model", str(text_checkpoint), "--decode", "127.0.0.1:1",
                                   "--port", "0", "--connect-timeout", "1"], capture_output=True, text=True, timeout=60,
                                  env={k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"})
    assert "NO CLUSTER CREDENTIALS" in open_cluster.stderr.splitlines()[0]


def _records(fmt: str) -> list[str]:
    stream = io.StringIO()
    setup_logging("info", fmt)
    (handler,) = [h for h in logging.getLogger().handlers if getattr(h, "is_pdserve", False)]
    handler.setStream(stream)
    log = logging.getLogger("pdserve.test")
    with request_context("abc123"):
        log.info("request", extra=fields(status="ok", ttft_s=0.25, client="a b"))
    log.debug("hidden")
    logging.getLogger("pdserve.progress").info("loading")
    setup_logging()  # back to the default
    return stream.getvalue().splitlines()


def test_json_logs_are_one_object_per_line():
    line, progress = _records("json")
    obj = json.loads(line)
    assert (obj["level"], obj["logger"], obj["msg"], obj["req_id"]) == ("info", "pdserve.test", "request", "abc123")
    assert (obj["status"], obj["ttft_s"], obj["client"]) == ("ok", 0.25, "a b")
    assert json.loads(progress)["progress"] is True


def _grpc_client_gone_record(level: str) -> list[str]:
    """What grpc.aio logs when a handler writes to a call whose client has gone."""
    from grpc._cython import cygrpc

    stream = io.StringIO()
    setup_logging(level)
    (handler,) = [h for h in logging.getLogger().handlers if getattr(h, "is_pdserve", False)]
    handler.setStream(stream)
    try:
        raise cygrpc.ExecuteBatchError('Failed "execute_batch"')
    except cygrpc.ExecuteBatchError:
        logging.getLogger("grpc._cython.cygrpc").exception(
            "%s raised in core by servicer method [%s]", "ExecuteBatchError", "/pdserve.v1.Generation/Generate")
    logging.getLogger("grpc._cython.cygrpc").error("another core error")
    setup_logging()
    return stream.getvalue().splitlines()


def test_a_write_to_a_client_that_has_gone_is_one_debug_line_not_a_traceback():
    (quiet,) = _grpc_client_gone_record("warning")  # the default level: only the other error
    assert "level=ERROR" in quiet and "another core error" in quiet
    debug = _grpc_client_gone_record("debug")
    assert "Traceback" not in "\n".join(debug)
    assert any("level=DEBUG" in line and "the client had gone before the write" in line for line in debug)
    assert any("level=ERROR" in line and "another core error" in line for line in debug)  # others untouched


def test_text_logs_are_key_value():
    line, progress = _records("text")
    assert "level=INFO logger=pdserve.test req_id=abc123 msg=request status=ok ttft_s=0.25 client=\"a b\"" in line
    assert progress.endswith("] loading")



def test_a_bad_local_prefill_tokens_is_one_line_naming_it(text_checkpoint, capsys):
    args = ["decode-worker", "--model", str(text_checkpoint), "--port", "0", "--local-prefill-tokens"]
    assert main([*args, "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("pdserve: error: DecodeServerConfig.local_prefill_tokens must be an "
                                               "integer >= 0, got -1")
    with pytest.raises(SystemExit):
        main([*args, "many"])
    assert "--local-prefill-tokens: invalid int value: 'many'" in capsys.readouterr().err


def test_bad_prefill_chunk_tokens_are_one_line_naming_them(text_checkpoint, capsys):
    args = ["decode-worker", "--model", str(text_checkpoint), "--port", "0"]
    assert main([*args, "--prefill-chunk-tokens", "-1"]) == 2
    assert capsys.readouterr().err.strip().endswith("pdserve: error: EngineConfig.prefill_chunk_tokens must be an "
                                                    "integer >= 0 or None, got -1")
    assert main([*args, "--local-prefill-chunk-tokens", "-2"]) == 2
    assert capsys.readouterr().err.strip() == ("pdserve: error: DecodeServerConfig.local_prefill_chunk_tokens must "
                                               "be an integer >= 0 or None, got -2")
    assert main([*args, "--stream-interval", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("pdserve: error: DecodeServerConfig.stream_interval must be an integer "
                                               ">= 1, got 0")
