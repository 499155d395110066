"""Transports: how events reach a client (SSE, WebSocket), behind one `Emitter` interface."""
