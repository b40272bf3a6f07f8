"""The router: public gRPC (and OpenAI HTTP) API, request life cycle, worker selection. No torch."""
