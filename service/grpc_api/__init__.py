"""The gRPC API (`proto/moecache/v1`): token streaming, tokenization, model info and durable jobs,
served by `grpc.aio` in the HTTP server's process and event loop. Stubs are generated from the .proto
files by `stubs.py`; nothing generated is committed."""
