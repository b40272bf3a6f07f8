"""The native sources built again with narrower instruction sets, so the loops a CPU with
AVX-512 never runs (AVX2, plain, the CRC fallbacks) are tested here too. Each variant is one
source with other flags (decoder.cpp and draft_passes.cpp with the three they call), under an op
namespace of its own beside the loaded library.

A variant takes 7 to 12 s to compile on these 2 cores (the decoder's, five sources, about
30 s), six in all: the suite's longest stretch of pure compiling. So when a selected test asks
for one, `conftest.py` starts this module as a background process at the start of the session
(`nice` 19, so a test never waits for the CPU on its account), which builds JOBS variants at a
time, in the order the suite reaches them: the builds take what the tests leave idle, and when a
test waits for its variant, both cores compile. A test then waits until its variant is built
(with a timeout) and loads it from the shared build directory (ninja finds it up to date); when
the background build failed, the test builds the variant itself and so reports the compiler's
error.

    python tests/native_variants.py BUILD_DIR   # builds every variant into BUILD_DIR/<name>
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# name -> (source or sources, extra flags)
VARIANTS = {  # in the order the suite reaches them (tests/disagg before tests/kernels)
    "pdserve_test_kv_xmm_folds": ("kv_copy.cpp", ["-mno-vpclmulqdq"]),
    "pdserve_test_kv_crc32_chains": ("kv_copy.cpp", ["-mno-pclmul"]),
    "pdserve_test_kv_byte_table": ("kv_copy.cpp", ["-mno-pclmul", "-mno-sse4.2", "-mno-avx2", "-mno-avx512f"]),
    # the AVX2 build of the decoder holds the AVX2 builds of attention and the projections too:
    # their tests take their ops from it rather than compiling those two sources again
    "pdserve_test_decoder_avx2": (("decoder.cpp", "draft_passes.cpp", "rejection.cpp", "linear.cpp",
                                   "paged_attention.cpp"), ["-mno-avx512f"]),
    "pdserve_test_plain": ("paged_attention.cpp", ["-mno-avx512f", "-mno-avx2", "-mno-fma"]),
    "pdserve_test_linear_plain": ("linear.cpp", ["-mno-avx512f", "-mno-avx2", "-mno-fma"]),
}
BUILD_TIMEOUT_S = 1200  # the background process's six builds, niced beside the suite
JOBS = 2  # variants built at once, each in a process of its own (a compile is one process: ninja's MAX_JOBS=1)
BUILT = "built"  # written into a variant's directory once it is built


def build(name: str, build_dir: Path):
    """Build (or find up to date) and load one variant; its op namespace."""
    import torch
    from torch.utils import cpp_extension

    from pdserve.kernels import native

    sources, flags = VARIANTS[name]
    names = (sources,) if isinstance(sources, str) else sources
    paths = [next(s for s in native.SOURCES if s.name == source) for source in names]
    directory = build_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name, [str(p) for p in paths],
                       extra_cflags=[*native.FLAGS, *flags, f"-DPDSERVE_OP_NAMESPACE={name}"], extra_ldflags=list(native.LDFLAGS), is_python_module=False, verbose=False,
                       build_directory=str(directory))
    (directory / BUILT).touch()
    return getattr(torch.ops, name)


class Builder:
    """The background process building every variant; `ops(name)` waits for it, then loads."""

    def __init__(self, build_dir: Path):
        self.build_dir = build_dir
        self.log = build_dir / "build.log"
        build_dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # one compile per variant at a time; the `ninja` wheel's binary sits beside this interpreter,
        # maybe not on PATH; a process group of its own, so `stop` ends its pool and compilers too
        env = {**os.environ, "MAX_JOBS": "1",
               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(["nice", "-n", "19", sys.executable, __file__, str(self.build_dir)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ops(self, name: str):
        """Wait until the background process has built this variant (or ended, or timed out), then load it."""
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while (self.proc is not None and self.proc.poll() is None and not (self.build_dir / name / BUILT).exists()
               and time.monotonic() < deadline):
            time.sleep(0.2)
        if not (self.build_dir / name / BUILT).exists():
            self.stop()  # ended without it, or too slow: the test builds it and reports why it fails
        return build(name, self.build_dir)  # up to date when the background build succeeded

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            for lock in self.build_dir.glob("*/lock"):  # a killed build's lock would stall the next one
                lock.unlink(missing_ok=True)


def _build_one(name: str, build_dir: str) -> str | None:
    """A pool worker's task: build one variant; the error, if it fails."""
    try:
        build(name, Path(build_dir))
    except Exception as e:  # the test building it again reports it
        return f"{name}: {e!r}"
    return None


def main(build_dir: str) -> int:
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(JOBS) as pool:  # tasks start in submission order: the suite's
        errors = [e for e in pool.map(_build_one, VARIANTS, [build_dir] * len(VARIANTS)) if e]
    for error in errors:
        print(error, flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
