"""Transports: one I/O-free `Encoder` and its endpoints per wire format (SSE, WebSocket)."""
