"""The OpenAI-compatible HTTP API: protocol.py (the wire: request bodies, SSE events),
chat.py (messages to a prompt), service.py (the aiohttp routes over the core)."""
