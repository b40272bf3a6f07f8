"""`.proto` files of pdserve and their generated Python modules (`proto/pdserve/v1/*_pb2*.py`).

The generated modules are committed; `python -m proto.codegen` rewrites them, and a test checks
that doing so changes nothing.
"""
