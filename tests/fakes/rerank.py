"""A fake rerank API (Jina/Cohere style) on loopback: `POST /rerank` with `{model, query,
documents, top_n}` → `{"results": [{"index", "relevance_score"}]}`. It ranks first the
documents that contain `favourite` (else keeps the order), and can be made slow."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class FakeRerank:
    favourite: str = "reranked"
    delay: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/rerank", self.rerank, methods=["POST"])])

    async def rerank(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        waited = 0.0
        while waited < self.delay:  # in steps, so that setting `delay` to 0 ends a wait
            await asyncio.sleep(0.05)
            waited += 0.05
        documents = body["documents"]
        scores = [
            (2.0 if self.favourite in text.lower() else 1.0 / (1 + i), i)
            for i, text in enumerate(documents)
        ]
        ranked = sorted(scores, key=lambda pair: -pair[0])[: body.get("top_n") or len(documents)]
        return JSONResponse(
            {"results": [{"index": i, "relevance_score": score} for score, i in ranked]}
        )
