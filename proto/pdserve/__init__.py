"""pdserve protobuf package."""
