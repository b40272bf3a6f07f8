"""pdserve: disaggregated LLM serving — prefill and decode pools, KV over gRPC, speculative decoding.

The one import root. Each folder at the top of the repository installs as a subpackage
(`engine/` → `pdserve.engine`, `router/` → `pdserve.router`, …; see pyproject.toml), and this
folder, which also holds the `.proto` files, installs as `pdserve` itself, so protoc's modules
import as `pdserve.v1`.
"""
__version__ = "0.2.0"
