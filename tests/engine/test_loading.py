"""Loading a checkpoint gives every parameter storage for the checkpoint to fill and nothing more:
no random initialization, no compiler. A worker loads on every start and every restart after a
failure, so what loading pulls in is paid on the failover path."""
from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from pdserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1])
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
print(json.dumps({"tokens": out.token_ids, "modules": [m for m in ("torch._dynamo", "sympy") if m in sys.modules]}))
"""


def test_loading_and_decoding_import_no_compiler(checkpoint):
    """`torch._dynamo` and `sympy` took 3 s of a 3.2 s load of the tiny model: the embedding's
    random initialization on the meta device and `Module.to_empty` both ran through reference
    implementations that import them."""
    path = checkpoint("llama")
    run = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got["tokens"]) == 4
    assert got["modules"] == []
