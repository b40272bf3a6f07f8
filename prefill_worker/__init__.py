"""The prefill pool's worker: chunked prefill loop, layer-wise KV sender and its gRPC server."""
