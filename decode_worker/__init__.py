"""The decode pool's worker: admission, KV receiver, decode loop and its gRPC server."""
