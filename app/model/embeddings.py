"""The embeddings model's `/embeddings` endpoint (`Embedder`), for ranking search
results and indexing uploads and collections, and its answer's decoder
(`decode_embeddings`). Errors as the chat model's (`errors.model_errors`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx2
import numpy as np
import openai
import orjson

from ..config import EmbeddingsSettings
from ..errors import ConfigError, StreamError
from .errors import model_errors

#: an embeddings answer bigger than this is decoded in a thread (~30 vectors of 1,024)
DECODE_IN_THREAD_BYTES = 160 * 1024


class Embedder:
    """The `/embeddings` endpoint of the embeddings model (for ranking search results)."""

    def __init__(self, settings: EmbeddingsSettings, timeout: float = 30.0) -> None:
        self.settings = settings
        self.host = urlsplit(settings.base_url).hostname or ""
        self._client: openai.AsyncOpenAI | None = None
        if settings.model and settings.api_key:
            self._client = openai.AsyncOpenAI(
                base_url=settings.base_url, api_key=settings.api_key, max_retries=0, timeout=timeout
            )

    @property
    def configured(self) -> bool:
        return self._client is not None

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One float32 row per text, in order. ConfigError / ModelError / StreamError.

        Asks for base64 vectors (OpenAI's compact form, which the SDK asks for too) and
        decodes the body with orjson and numpy: a batch of 1,024-dimension vectors parsed
        into the SDK's models and Python floats would hold the event loop several times
        longer. Servers that answer plain float lists anyway are read just as well.
        The request goes through the SDK's client (headers, errors) with a body built
        here, as `_post_chat` does: its parameter walk over every input is skipped. A
        big answer (an import's batch) is decoded in a thread, off the loop that serves
        the streams."""
        if self._client is None:
            raise ConfigError("no embeddings model is configured (embeddings.model)")
        with model_errors("embeddings model", self.host):
            response = await self._client.post(
                "/embeddings",
                cast_to=httpx2.Response,
                body={
                    "model": self.settings.model,
                    "input": list(texts),
                    "encoding_format": "base64",
                },
            )
            body = await response.aread()
        if len(body) > DECODE_IN_THREAD_BYTES:
            return await asyncio.to_thread(decode_embeddings, body, len(texts))
        return decode_embeddings(body, len(texts))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


def decode_embeddings(body: bytes, count: int) -> np.ndarray:
    """The `count` vectors of an `/embeddings` answer as a float32 matrix, rows in
    input order; each vector base64 (little-endian float32) or a list of numbers."""
    try:
        items = sorted(orjson.loads(body)["data"], key=lambda item: item["index"])
        rows = [
            np.frombuffer(base64.b64decode(v, validate=True), dtype="<f4")
            if isinstance(v := item["embedding"], str)
            else np.asarray(v, dtype=np.float32)
            for item in items
        ]
        if len(rows) != count:
            raise StreamError("the embeddings model returned a different number of vectors")
        matrix = (
            np.vstack(rows).astype(np.float32, copy=False) if rows else np.zeros((0, 0), np.float32)
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise StreamError("the embeddings model returned vectors that could not be read") from exc
    if rows and not matrix.shape[1]:
        raise StreamError("the embeddings model returned empty vectors")
    return matrix
