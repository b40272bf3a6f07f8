"""`.proto` files of pdserve and their generated Python modules (`proto/pdserve/v1/*_pb2*.py`).

The generated modules are committed; `python -m proto.codegen` rewrites them, and a test checks
that doing so changes nothing.
"""

# proto-plus (pulled in by google-api-core, e.g. through ray[default]) also installs a top-level
# `proto`; whichever comes first on sys.path wins. The CLI checks for this marker.
IS_PDSERVE_PROTO = True
