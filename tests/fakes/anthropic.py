"""A fake of Anthropic's Messages API (real HTTP, for the official `anthropic` SDK).

`POST /v1/messages`, streamed (`stream: true`: `message_start`, a `ping`, a thinking
block with `thinking_delta`s and a `signature_delta`, a text block of `text_delta`s
or, for a request with `tools` while `tool_rounds` last, `tool_use` blocks whose
input comes in `input_json_delta` pieces; then `message_delta` with `stop_reason`
and `usage`, `message_stop`) or whole. `GET /v1/models` lists `models`. A request
without the right key (`x-api-key`, or `Authorization: Bearer` as newer SDKs send it)
is answered 401 as Anthropic answers it. Every request
asked is kept in `requests`.

`stop_reason` is `max_tokens` for a last user message holding `#cut`; non-streamed
answers are `reply` (a request with tools and no round left: a text answer, no call).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeAnthropic:
    api_key: str = "anthropic-key"
    models: list[str] = field(default_factory=lambda: ["claude-test", "claude-small"])
    requests: list[dict[str, Any]] = field(default_factory=list)
    thinking: str = "Let me weigh this."
    answer: str = "Claude says hello."
    reply: str = "claude reply"
    tool_rounds: list[list[tuple[str, dict[str, Any]]]] = field(default_factory=list)

    def reset(self) -> None:
        self.requests.clear()
        self.tool_rounds.clear()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
            ]
        )

    def streamed(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("stream")]

    def whole(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if not r.get("stream")]

    # -- endpoints ------------------------------------------------------------------

    def _refused(self, request: Request) -> Response | None:
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
        if self.api_key in (request.headers.get("x-api-key"), bearer):
            return None
        error = {"type": "authentication_error", "message": "invalid x-api-key"}
        return JSONResponse({"type": "error", "error": error}, status_code=401)

    async def list_models(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        data = [
            {
                "type": "model",
                "id": name,
                "display_name": name.replace("-", " ").title(),
                "created_at": "2025-01-01T00:00:00Z",
            }
            for name in self.models
        ]
        return JSONResponse(
            {
                "data": data,
                "has_more": False,
                "first_id": self.models[0] if self.models else None,
                "last_id": self.models[-1] if self.models else None,
            }
        )

    async def messages(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        body = orjson.loads(await request.body())
        self.requests.append(body)
        calls = self.tool_rounds.pop(0) if body.get("tools") and self.tool_rounds else []
        last = body["messages"][-1]["content"] if body.get("messages") else ""
        cut = "#cut" in orjson.dumps(last).decode()
        blocks: list[dict[str, Any]] = [
            {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": arguments}
            for i, (name, arguments) in enumerate(calls)
        ]
        stop = "tool_use" if calls else ("max_tokens" if cut else "end_turn")
        if not body.get("stream"):
            text = [] if calls else [{"type": "text", "text": self.reply}]
            return JSONResponse(
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": body["model"],
                    "content": text + blocks,
                    "stop_reason": stop,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 3},
                }
            )
        return StreamingResponse(
            self._stream(body["model"], blocks, stop), media_type="text/event-stream"
        )

    async def _stream(
        self, model: str, blocks: list[dict[str, Any]], stop: str
    ) -> AsyncIterator[bytes]:
        start = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 1},
        }
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        index = 0
        if not blocks:
            yield _event(
                "content_block_start",
                {
                    "index": 0,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                },
            )
            for word in self.thinking.split(" "):
                delta = {"type": "thinking_delta", "thinking": word + " "}
                yield _event("content_block_delta", {"index": 0, "delta": delta})
            delta = {"type": "signature_delta", "signature": "c2lnbmVk"}
            yield _event("content_block_delta", {"index": 0, "delta": delta})
            yield _event("content_block_stop", {"index": 0})
            index = 1
            yield _event(
                "content_block_start",
                {"index": index, "content_block": {"type": "text", "text": ""}},
            )
            for word in self.answer.split(" "):
                delta = {"type": "text_delta", "text": word + " "}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            yield _event("content_block_stop", {"index": index})
        for i, block in enumerate(blocks):
            head = {**block, "input": {}}
            yield _event("content_block_start", {"index": i, "content_block": head})
            text = orjson.dumps(block["input"]).decode()
            for piece in (text[: len(text) // 2], text[len(text) // 2 :]):
                delta = {"type": "input_json_delta", "partial_json": piece}
                yield _event("content_block_delta", {"index": i, "delta": delta})
            yield _event("content_block_stop", {"index": i})
        yield _event(
            "message_delta",
            {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 9}},
        )
        yield _event("message_stop", {})


def _event(kind: str, data: dict[str, Any]) -> bytes:
    payload = orjson.dumps({"type": kind, **data}).decode()
    return f"event: {kind}\ndata: {payload}\n\n".encode()
