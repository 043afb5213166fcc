"""The OpenAI protocol without a transport: request bodies (JSON, or dicts built from protobuf messages)
become validated engine requests or OpenAI error objects, and engine outputs become OpenAI response
objects. The HTTP API, the gRPC API and the jobs build on it; it imports none of them."""
