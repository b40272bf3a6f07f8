"""The decode pool's worker: admission, KV receiver, decode loop and its gRPC server."""

# The default of `local_prefill_tokens` (decode_worker/server.py): a disaggregated request whose
# prompt this worker holds all but at most this many tokens of (a conversation's next turn) is
# prefilled here. Measured: BENCHMARKS.md, Multi-turn conversations.
LOCAL_PREFILL_TOKENS = 128

# The default of `local_prefill_chunk_tokens` on a CPU (decode_worker/server.py): the tails prefilled
# here take at most this many tokens in all of a step that also decodes, so one puts a gap of a few short
# steps, not of its whole prefill, between the tokens of the requests decoding here. On the demo
# pair, beside a conversation's next turn (a 96-token tail), another stream's longest gap was
# 9.0 ms at the median against 18.2 with the tail in one step, and the turn's first token came
# 1.15x as late (BENCHMARKS.md, Multi-turn conversations). On a GPU a chunk of a short tail rides
# a decode step at little cost: no cap there unless set (not measured on a GPU).
LOCAL_PREFILL_CHUNK_TOKENS = 32
