"""A realtime server for an AI search chat: SSE and WebSocket streaming of a model's
answer, grounded in web search, with stop and resume across processes."""
