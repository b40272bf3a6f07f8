"""Native CPU ops: the C++ files in `cpu/`, built once per machine into one library of torch ops.

- `torch.ops.pdserve.paged_attention_cpu(q, k, v, k_cache, v_cache, slot_mapping, block_ids,
  context_lens, query_starts, scale)` (`cpu/paged_attention.cpp`) writes a step's K/V into the
  paged cache and attends over it in one call per layer. It replaces `gathered_attention`'s
  twenty-odd ATen ops, whose fixed costs are most of what a small model's batch-1 step spends on
  attention on a CPU.
- `torch.ops.pdserve.linear_packed(x, packed, bias, out_features)` (`cpu/linear.cpp`): float32
  projections over weights packed once into column panels (`linear_pack`), for every step's
  linears. The BLAS's small-M path reads a decode step's weights at about half the speed one core
  can, and pays about 3x for the 5 rows of a speculative verification. AVX-512 or AVX2 with FMA
  (`linear_packed_available()`); elsewhere the model keeps `nn.Linear`. Bfloat16 panels times 7
  rows and more run on the AMX tile unit where the CPU has one (`cpu/linear_amx.h`, from a copy of
  the panels in the tile unit's order that `linear_pack` keeps beside them;
  `linear_tile_rows(m)` says whether m rows do, `linear_use_tiles(False)` turns it off).
- `torch.ops.pdserve.draft_passes(state, num_passes, catch_up, weights, kv_caches, cos, sin, ...)`
  (`cpu/draft_passes.cpp`): a draft model's passes of a speculative step in one call, the whole
  forward and the pick in C++, its ops calling the two above straight (`cpu/native_ops.h`); used
  through `engine.native_forward.NativePasses`. `draft_passes_logits(...)`: the same passes and the
  logits each picked from (the rejection sampler's q). `decoder_forward(input_ids, positions, slot_mapping,
  block_ids, context_lens, query_starts, weights, kv_caches, cos, sin, ...)` (`cpu/decoder.cpp`,
  the same layers, `cpu/decoder.h`): an engine step (decode, a verification, prefill chunks)
  through every layer in one call, the final norm's output returned; used through
  `engine.native_forward.NativeForward` by `ModelRunner`. `decoder_layer(residual, workspace,
  positions, ..., layer)`: one of those layers on residual streams in place, for a step that
  streams each layer's K/V as it lands (a prefill worker's).
- `torch.ops.pdserve.spec_step(state, depths, draft_weights, draft_caches, ..., weights, kv_caches,
  ..., temperature, noise)` (`cpu/draft_passes.cpp`): a speculative step's draft passes and the
  target's verification with its picks in one call, for sequences that decode greedily or sample
  by temperature alone (used through `engine.spec_decode.fused_step.FusedSpecStep`);
  `race_rows(logits, temperature, noise)`: the same picks for logits rows, the sampler's CPU
  path for such rows (`engine.sampler`). `spec_step_rejection(..., temperature, noise, seeds,
  codes)`: the same step under the rejection sampler, its rule (`cpu/rejection.cpp`) run on the
  distributions the passes and the verification raced, the draft's noise given.
- `torch.ops.pdserve.temperature_probs(logits, temperature)` and `rejection_rows(probs, draft_probs,
  drafts, depths, seeds, positions, temperature, codes)` (`cpu/rejection.cpp`): the distributions
  those picks race, and the rejection sampler's rule over them for a whole step (used through
  `engine.sampler.Sampler.probs` and `engine.spec_decode.verifier.RejectionVerifier`).
- `torch.ops.pdserve.copy_rows_crc32c` and `rows_crc32c` (`cpu/kv_copy.cpp`): the KV transfer's
  copies with their CRC-32C in the same pass (used through `engine.kv_copy`).
- `torch.ops.pdserve.hash_uniforms(keys, codes)` (`cpu/noise.cpp`): `engine.rng.hash_uniforms`
  in one pass, bit for bit: the uniforms of the sampler's noise (used through `engine.sampler`).

The sources are compiled with the C++ compiler and ninja that `torch.utils.cpp_extension` finds (the
same compiler `torch.compile` uses on the CPU), for this CPU (`-march=native`), into torch's
extensions cache (`~/.cache/torch_extensions`, under `$XDG_CACHE_HOME` when set; torch's
`TORCH_EXTENSIONS_DIR` does not move it, as the build directory is given): 10–20 s the
first time on a 2-core machine. Once built, a process loads the library directly (milliseconds,
no lock); while one process builds, the others wait on the cache's lock, and a lock left by a
process that died mid-build is removed after STALE_LOCK_S. Where it cannot be built, `load()`
says why once and returns False, and the engine keeps the torch path.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CPU = Path(__file__).with_name("cpu")
SOURCES = [_CPU / name for name in ("paged_attention.cpp", "linear.cpp", "kv_copy.cpp", "decoder.cpp", "draft_passes.cpp",
                                    "noise.cpp", "rejection.cpp")]
# included by the sources: in the build name
HEADERS = [_CPU / name for name in ("attention_vectors.h", "native_ops.h", "decoder.h", "linear_loops.h", "linear_amx.h",
                                    "crc32c.h", "pick.h", "noise.h", "kv_rows.h")]
# -fopenmp: the ops split their work with at::parallel_for, a header template that runs the whole
# range on the calling thread unless the file is compiled with OpenMP (torch's own backend here).
# Built with -fopenmp-simd alone until the fix, both ops ran on one thread whatever
# torch.set_num_threads said. The library links libgomp.so.1, which resolves to the copy torch
# has loaded already, so the ops share torch's thread pool and its thread count.
# tuples: torch's cpp_extension.load appends its own flags to the lists it is given, and the build
# name hashes these
FLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CPU_ATTENTIONS = CPU_LINEARS = ("auto", "native", "torch")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str, once tried


def _build_name() -> str:
    """One build per sources, torch version and CPU (the code is compiled for this CPU's features)."""
    h = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    h.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    h.update(" ".join(FLAGS + LDFLAGS).encode())
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    h.update(flags.encode())
    return f"pdserve_native_{h.hexdigest()[:16]}"


def load() -> bool:
    """Build (or find) and load the native ops; True when they are usable."""
    with _lock:
        if "ok" not in _state:
            try:
                _build_and_load()
                _state["ok"] = True
            except Exception as e:  # no compiler, no ninja, a compile error: the torch path stays
                _state["ok"], _state["error"] = False, f"{type(e).__name__}: {e}"
                log.warning("native CPU ops unavailable, using the torch and numpy paths: %s", _state["error"])
        return bool(_state["ok"])


def loaded() -> bool:
    """Whether the native ops are loaded in this process already (never builds)."""
    return bool(_state.get("ok"))


def error() -> str | None:
    """Why `load()` failed, if it did."""
    return _state.get("error")  # type: ignore[return-value]


STALE_LOCK_S = 300.0  # a build lock older than this was left by a process that died building


def library_path() -> Path:
    """Where this machine's build of the sources lives (or will)."""
    from torch.utils import cpp_extension

    name = _build_name()
    return Path(cpp_extension.get_default_build_root()) / name / f"{name}.so"


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    library = library_path()
    name, build_dir = library.stem, library.parent
    try:  # built already: load it without the loader's lock and ninja run
        torch.ops.load_library(str(library))
    except OSError:  # not built yet, or being written by another process: build (or wait for it)
        # the `ninja` wheel installs its binary beside this interpreter, which need not be on PATH
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        lock = build_dir / "lock"  # torch's loader waits on this file without a timeout
        with contextlib.suppress(OSError):
            if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink()
        build_dir.mkdir(parents=True, exist_ok=True)
        log.info("building native CPU ops %s (once per machine, 10-20 s)", name)
        cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=list(FLAGS), extra_ldflags=list(LDFLAGS),
                           is_python_module=False, verbose=False,
                           build_directory=str(build_dir))
    torch.library.register_fake("pdserve::paged_attention_cpu", _fake)
    torch.library.register_fake("pdserve::linear_packed", _fake_linear)


def _fake(q, k, v, k_cache, v_cache, slot_mapping, block_ids, context_lens, query_starts, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _fake_linear(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def resolve(name: str, device: torch.device, kernels: str) -> bool:
    """Whether an engine uses the native attention (`name` validated by `EngineConfig`): "auto" on
    the CPU with the torch kernels when it builds; "native" insists (ValueError saying why when it
    cannot); "torch" never."""
    if name == "torch" or device.type != "cpu" or kernels != "torch":
        if name == "native":
            raise ValueError("cpu_attention='native' needs the CPU and the torch kernels")
        return False
    ok = load()
    if name == "native" and not ok:
        raise ValueError(f"cpu_attention='native' could not be built: {error()}")
    return ok


def resolve_linear(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine's projections run `linear_packed` (`name` validated by `EngineConfig`):
    "auto" on the CPU in float32 where the library builds with its AVX-512 or AVX2 loops; "native"
    insists (ValueError saying why when it cannot); "torch" never."""
    if name == "torch":
        return False
    if device.type != "cpu" or dtype != torch.float32:
        if name == "native":
            raise ValueError("cpu_linear='native' needs the CPU and float32")
        return False
    ok = load() and torch.ops.pdserve.linear_packed_available()
    if name == "native" and not ok:
        raise ValueError(f"cpu_linear='native' is unavailable: {error() or 'this CPU has neither AVX-512 nor AVX2 with FMA'}")
    return ok
