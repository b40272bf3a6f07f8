"""The decode pool's worker: admission, KV receiver, decode loop and its gRPC server."""

# The default of `local_prefill_tokens` (decode_worker/server.py): a disaggregated request whose
# prompt this worker holds all but at most this many tokens of (a conversation's next turn) is
# prefilled here. Measured: BENCHMARKS.md, Multi-turn conversations.
LOCAL_PREFILL_TOKENS = 128

# The default of `EngineConfig.prefill_chunk_tokens` on a decode worker on a CPU
# (`DecodeWorkerServicer.engine_config`): a step that decodes takes at most this many prompt
# tokens (a local prefill's tail, a fallback's prompt), so one prompt puts a gap of a few decode
# steps, not of its whole prefill, between the running requests' tokens. On the demo pair a
# 96-token tail after 368 cached tokens cost a 17.6 ms step against 0.6 ms for a decode step, and
# in 32-token chunks 7.0 ms at most a step, its first token 3 ms later (BENCHMARKS.md, Multi-turn
# conversations). On a GPU a chunk this short rides a decode step at little cost: no cap there.
DECODE_PREFILL_CHUNK_TOKENS = 32
