"""A benchmark's engine in a process of its own, driven by one JSON line each way.

`spec_decode.py` runs each method's engine this way and `spec_by_revision.py` each revision's. An
engine lives in its own process, as a served one does. With several engines in one process, the
one built first ran its steps 1-6% faster than identical ones built after it (BENCHMARKS.md,
Speculative decoding), which biased every comparison between them.

The parent (`ChildProcess`) waits on the child's stdout with `select` and a deadline, so a child
that hangs or dies fails the benchmark with its name instead of blocking it. The child
(`replies`) answers on the stdout it was started with, and anything else it prints goes to
stderr, so that no stray line is read as a reply.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import IO


class ChildProcess:
    """`python <script> <args>` started with pipes; its first line (returned by `hello`) says it
    is ready. `ask` sends one JSON value and returns the child's JSON reply."""

    def __init__(self, name: str, script: str, args: list[str], env: dict | None = None, quiet: bool = False,
                 timeout_s: float = 900):
        self.name, self._buf = name, b""
        # unbuffered bytes: what `select` says is waiting is all there is (no line held in a buffer)
        self.proc = subprocess.Popen([sys.executable, script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if quiet else None, bufsize=0, env=env)
        try:
            self.hello = self._read(timeout_s)
        except BaseException:
            self.close()
            raise

    def ask(self, message, timeout_s: float = 600):
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
        except BrokenPipeError:
            raise RuntimeError(f"the {self.name} process ended (exit code {self.proc.wait()})") from None
        return self._read(timeout_s)

    def close(self) -> None:
        """End of input, then up to 30 s to exit before it is killed."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _read(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise RuntimeError(f"the {self.name} process gave no answer in {timeout_s:.0f} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"the {self.name} process ended (exit code {self.proc.wait()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)


def replies() -> IO[str]:
    """The child's side: the stream its replies go to (the stdout it was started with). From
    here on anything else printed to stdout goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def reply(out: IO[str], value) -> None:
    out.write(json.dumps(value) + "\n")
    out.flush()


def requests():
    """The JSON values the parent sends, until it closes stdin."""
    for line in sys.stdin:
        yield json.loads(line)

