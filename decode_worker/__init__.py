"""The decode pool's worker: admission, KV receiver, decode loop and its gRPC server."""

# The default of `local_prefill_tokens` (decode_worker/server.py): a disaggregated request whose
# prompt this worker holds all but at most this many tokens of (a conversation's next turn) is
# prefilled here. Measured: BENCHMARKS.md, Multi-turn conversations.
LOCAL_PREFILL_TOKENS = 128
