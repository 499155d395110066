"""The model side of the server: the chat model's client and the embedder, split
the way httpx splits its transports:

* `wire.py` — the Sans-I/O decoder: the answer's bytes in, typed deltas out
  (`Delta`, `ToolCall`, `ToolTurn`), `<think>` split out;
* `errors.py` — what goes wrong, mapped to the server's errors at the boundary;
* `tokens.py` — token estimates;
* `upstream.py` — the small HTTP/1.1 client that reads the answer's stream;
* `client.py` — `LLMClient` and the `ChatModel` interface it shares with
  `demo.py`, the built-in demo model;
* `learned.py` — what the client learned of each model, for the process;
* `embeddings.py` — `Embedder`.

Callers import from here (`from ..model import LLMClient`).
"""

from .client import ChatModel, LLMClient
from .demo import DemoModel, is_demo, topic_of
from .embeddings import Embedder, decode_embeddings
from .errors import ContextTooLong, ToolsUnsupported
from .tokens import cut_to_tokens, tokens_in
from .wire import Delta, Message, ToolCall, ToolTurn

__all__ = [
    "ChatModel",
    "ContextTooLong",
    "Delta",
    "DemoModel",
    "Embedder",
    "LLMClient",
    "Message",
    "ToolCall",
    "ToolTurn",
    "ToolsUnsupported",
    "cut_to_tokens",
    "decode_embeddings",
    "is_demo",
    "tokens_in",
    "topic_of",
]
