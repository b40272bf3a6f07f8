"""What every pdserve server process shares: the gRPC server life cycle (health, reflection,
signals), the engine thread, wire conversions, the `/metrics` endpoint, and the KV transfer
interface with its backends.

Torch-free except where a module says otherwise: the router imports from here too.
"""
