"""pdserve.v1: the public Generation API and the internal worker services (protoc's output)."""
