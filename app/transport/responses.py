"""OpenAI's Responses API (PROTOCOL §11): `POST /v1/responses`, `GET`/`DELETE
/v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

A response is a generation of the one chat service, as a chat completion is: the
same models, search parameters and errors (§10); what it keeps and reads beside its
answer is `app.chat.responses`'s. `ResponseState` turns a generation's events into
the Responses stream events, numbered from 0, and says what the `response` object is
at any point: a pure function of the events, so a client that lost its stream gets
the same numbers again from any process (`?stream=true&starting_after=N`).

A streaming client that goes away stops a foreground response, as on
`/v1/chat/completions`; a `background` one runs on until it ends or is cancelled.

With auth off, whom a response belongs to is the `userId` the request names (in the
body of the POST, as `?userId=` on the others), else user "0" (PROTOCOL §7); OpenAI's
`user` is a label that is echoed, not an identity — the SDKs' `retrieve`, `cancel`
and `delete` could not send it back.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..chat.responses import Found, ResponseRequest, Responses, response_id, search_step
from ..chat.service import ChatService
from ..citations import citations_in, perplexity_sources, real_sources, web_sources
from ..config import Settings
from ..errors import BadRequest
from ..events import Event, Handle
from ..protocol import ChatRequest, Encoder, Events
from .http import (
    client_identity,
    count_request,
    openai_errors,
    rate_key,
    read_json,
    restricted,
)
from .openai import (
    conversation,
    event_stream,
    parse_model,
    searched,
    while_connected,
)

#: what `include` may ask for that a response has
SEARCH_SOURCES = "web_search_call.action.sources"


class ResponseState:
    """A response as its generation's events make it: `feed` returns the stream events
    an event causes (each numbered, from 0 for `response.created`); `response()` is the
    `response` object as far as it got. Pure: no I/O, no clock but `created_at`."""

    def __init__(self, answer_id: str, asked: ResponseRequest) -> None:
        self.id = response_id(answer_id)
        self.answer_id = answer_id
        self.asked = asked
        self.status = "queued" if asked.background else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.sources: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}
        #: why the response is incomplete: "cancelled", or "max_output_tokens" (cut there)
        self.incomplete: str | None = None
        self.searches = 0
        self.seq = -1
        self._steps: dict[str, int] = {}  # a search step's id → its output index
        self._reasoning: int | None = None  # the open reasoning item's index
        self._message: int | None = None  # the message item's index
        self._text: list[str] = []
        self._thought: list[str] = []

    # -- the response object -------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        asked = self.asked
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": asked.created_at,
            "status": self.status,
            "background": asked.background,
            "error": self.error,
            "incomplete_details": {"reason": self.incomplete} if self.incomplete else None,
            "instructions": asked.instructions,
            "metadata": asked.metadata,
            "model": asked.model,
            "output": [self._shown(item) for item in self.output],
            "parallel_tool_calls": False,
            "previous_response_id": asked.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": asked.store,
            "temperature": None,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": None,
            "truncation": "disabled",
            "usage": self.usage,
            "user": asked.user,
        }
        if self.sources:
            body.update(perplexity_sources(self.sources))
        body.update(self.extra)
        return body

    def _shown(self, item: dict[str, Any]) -> dict[str, Any]:
        """An output item as the response shows it: with `include` asking for
        `web_search_call.action.sources`, a search lists the web pages the answer's
        searches found and kept. A search step says how many results it found, not
        which, so every search lists them all; and they are known only once all the
        searches have ended, so the streamed `output_item.done` of a search has none
        (the final `response` has them)."""
        if item["type"] != "web_search_call" or SEARCH_SOURCES not in self.asked.include:
            return dict(item)
        urls = [{"type": "url", "url": url} for url in web_sources(self.sources)]
        return {**item, "action": {**item["action"], "sources": urls}}

    # -- events ---------------------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        """What opens every stream of the response: `response.created` and (unless it
        is still queued) `response.in_progress`."""
        out = [self._event("response.created", response=self.response())]
        if self.status != "queued":
            out.append(self._event("response.in_progress", response=self.response()))
        return out

    def feed(self, event: Event) -> list[dict[str, Any]]:
        kind, data = event.type, event.data
        if kind == "progress":
            return self._step(data)
        if kind == "reasoning" and data.get("data") and self._message is None:
            return self._reason(data["data"])
        if kind == "message" and data.get("data"):
            return self._say(data["data"])
        if kind == "sources":
            self.sources = real_sources(data.get("data", []))
        elif kind == "messageEnd":
            return self._end(data)
        elif kind == "error":
            return self._fail(data)
        return []

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def _added(self, item: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.output.append(item)
        index = len(self.output) - 1
        return index, self._event("response.output_item.added", output_index=index, item=item)

    def _done(self, index: int, **changes: Any) -> dict[str, Any]:
        self.output[index] = item = {**self.output[index], **changes}
        return self._event("response.output_item.done", output_index=index, item=item)

    def _step(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        step = search_step(data)
        if step is None:
            return []
        if step.get("note"):
            return self._note(str(step["note"]))
        index = self._steps.get(str(step.get("id")))
        ref: dict[str, Any] = {"output_index": index, "item_id": ""}
        if step.get("status") == "running" and index is None:
            self.searches += searched(data)
            out = self._promote()
            item = {
                "type": "web_search_call",
                "id": f"ws_{self.answer_id}_{len(self.output)}",
                "status": "in_progress",
                "action": {"type": "search", "query": str(step.get("query", ""))},
            }
            index, added = self._added(item)
            self._steps[str(step.get("id"))] = index
            ref = {"output_index": index, "item_id": item["id"]}
            return [
                *out,
                added,
                self._event("response.web_search_call.in_progress", **ref),
                self._event("response.web_search_call.searching", **ref),
            ]
        if index is None or step.get("status") == "running":
            return []
        ref["item_id"] = self.output[index]["id"]
        status = "completed" if step.get("status") == "done" else "failed"
        return [
            self._event("response.web_search_call.completed", **ref),
            self._done(index, status=status),
        ]

    def _note(self, text: str) -> list[dict[str, Any]]:
        """What a search could not do (a filter its provider cannot apply): a reasoning
        item of its own, so that every client shows it (PROTOCOL §10: never dropped
        silently)."""
        out = self._promote()
        item = {"type": "reasoning", "id": f"rs_{self.answer_id}_{len(self.output)}", "summary": []}
        index, added = self._added(item)
        ref = {"item_id": item["id"], "output_index": index, "summary_index": 0}
        part = {"type": "summary_text", "text": text}
        return [
            *out,
            added,
            self._event("response.reasoning_summary_part.added", **ref, part={**part, "text": ""}),
            self._event("response.reasoning_summary_text.delta", **ref, delta=text),
            self._event("response.reasoning_summary_text.done", **ref, text=text),
            self._event("response.reasoning_summary_part.done", **ref, part=part),
            self._done(index, summary=[part]),
        ]

    def _promote(self) -> list[dict[str, Any]]:
        """A queued response is in progress once its generation does something."""
        if self.status != "queued":
            return []
        self.status = "in_progress"
        return [self._event("response.in_progress", response=self.response())]

    def _reason(self, text: str) -> list[dict[str, Any]]:
        out = self._promote()
        if self._reasoning is None:
            item = {"type": "reasoning", "id": f"rs_{self.answer_id}", "summary": []}
            self._reasoning, added = self._added(item)
            part = {"type": "summary_text", "text": ""}
            out += [
                added,
                self._event(
                    "response.reasoning_summary_part.added",
                    **self._summary_ref(),
                    part=part,
                ),
            ]
        self._thought.append(text)
        out.append(
            self._event("response.reasoning_summary_text.delta", **self._summary_ref(), delta=text)
        )
        return out

    def _summary_ref(self) -> dict[str, Any]:
        index = self._reasoning or 0
        return {"item_id": self.output[index]["id"], "output_index": index, "summary_index": 0}

    def _end_reasoning(self) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return []
        text = "".join(self._thought)
        ref = self._summary_ref()
        index, self._reasoning = self._reasoning, None
        part = {"type": "summary_text", "text": text}
        return [
            self._event("response.reasoning_summary_text.done", **ref, text=text),
            self._event("response.reasoning_summary_part.done", **ref, part=part),
            self._done(index, summary=[part]),
        ]

    def _text_ref(self) -> dict[str, Any]:
        index = self._message or 0
        return {"item_id": self.output[index]["id"], "output_index": index, "content_index": 0}

    def _open_message(self) -> list[dict[str, Any]]:
        out = [*self._promote(), *self._end_reasoning()]
        item = {
            "type": "message",
            "id": f"msg_{self.answer_id}",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._message, added = self._added(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            *out,
            added,
            self._event("response.content_part.added", **self._text_ref(), part=part),
        ]

    def _say(self, text: str) -> list[dict[str, Any]]:
        out = self._open_message() if self._message is None else []
        self._text.append(text)
        out.append(
            self._event("response.output_text.delta", **self._text_ref(), delta=text, logprobs=[])
        )
        return out

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        out = self._open_message() if self._message is None else []
        text = "".join(self._text)
        ref = self._text_ref()
        notes = citations_in(text, self.sources)
        for i, note in enumerate(notes):
            out.append(
                self._event(
                    "response.output_text.annotation.added",
                    **ref,
                    annotation_index=i,
                    annotation=note,
                )
            )
        part = {"type": "output_text", "text": text, "annotations": notes, "logprobs": []}
        out += [
            self._event("response.output_text.done", **ref, text=text, logprobs=[]),
            self._event("response.content_part.done", **ref, part=part),
            self._done(ref["output_index"], status=status, content=[part]),
        ]
        return out

    def _end(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        cancelled = data.get("status") == "cancelled"
        if cancelled:
            self.incomplete = "cancelled"
        elif data.get("truncated"):
            self.incomplete = "max_output_tokens"
        out = [
            *self._promote(),
            *self._end_reasoning(),
            *self._close_message("incomplete" if self.incomplete else "completed"),
        ]
        self.usage = responses_usage(data.get("usage"), self.searches)
        if "images" in data:
            self.extra["images"] = data["images"]
        if "relatedQuestions" in data:
            self.extra["related_questions"] = data["relatedQuestions"]
        self.status = "cancelled" if cancelled else "incomplete" if self.incomplete else "completed"
        kind = "response.incomplete" if self.incomplete else "response.completed"
        return [*out, self._event(kind, response=self.response())]

    def _fail(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        out = [*self._promote(), *self._end_reasoning()]
        if self._message is not None:
            out += self._close_message("incomplete")
        self.status = "failed"
        self.error = {
            "code": str(data.get("key", "INTERNAL")).lower(),
            "message": data.get("data", ""),
        }
        return [*out, self._event("response.failed", response=self.response())]


def responses_usage(usage: dict[str, Any] | None, searches: int) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
        "total_tokens": usage.get("total_tokens", prompt + completion),
        "num_search_queries": searches,
    }


class ResponsesEncoder(Encoder[bytes]):
    """A generation's events as the Responses stream (`id: N`, `event: <type>`, `data:
    <json>`), leaving out what a resuming client had (`sequence_number` ≤ `after`).
    Every subscription begins at the generation's first event (the numbers are made
    by replaying them)."""

    name = "responses"

    def __init__(self, state: ResponseState, after: int = -1) -> None:
        self.state = state
        self.after = after

    def preamble(self, handle: Handle) -> bytes | None:
        return self._lines(self.state.start())

    def encode(self, events: Sequence[Event]) -> bytes | None:
        out: list[dict[str, Any]] = []
        for event in events:
            if event.type == "keep-alive":
                continue
            out += self.state.feed(event)
        return self._lines(out)

    def _lines(self, events: list[dict[str, Any]]) -> bytes | None:
        after = self.after
        return (
            b"".join(
                b"id: %d\nevent: %s\ndata: %s\n\n"
                % (e["sequence_number"], e["type"].encode(), orjson.dumps(e))
                for e in events
                if e["sequence_number"] > after
            )
            or None
        )


# -- the request ------------------------------------------------------------------------------


def parse_response_request(body: Any, settings: Settings) -> tuple[ChatRequest, ResponseRequest]:
    """A `POST /v1/responses` body as a chat request and what the response echoes.
    `BadRequest`, or `NotFound` for an unknown model."""
    focus, optimization, fields = parse_model(body)
    model = str(body["model"])
    given = body.get("input")
    if isinstance(given, str):
        messages: list[Any] = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        messages = [
            m for m in given if not (isinstance(m, dict) and m.get("type") not in (None, "message"))
        ]
    else:
        raise BadRequest("input must be a string or a non-empty list of messages")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string")
    metadata = body.get("metadata") or {}
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise BadRequest("metadata must be at most 16 string keys and string values")
    flags = {}
    for name, default in (("stream", False), ("store", True), ("background", False)):
        value = body.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false")
        flags[name] = value
    if flags["background"] and not flags["store"]:
        raise BadRequest("background responses must be stored: store cannot be false")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise BadRequest("include must be a list of strings")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise BadRequest("previous_response_id must be a string")
    user = body.get("user") if isinstance(body.get("user"), str) else None
    request = conversation(
        messages,
        "input",
        focus,
        optimization,
        settings,
        body,
        fields,
        instructions=instructions or "",
    )
    asked = ResponseRequest(
        model=model,
        instructions=instructions,
        metadata=metadata,
        previous_response_id=previous,
        store=flags["store"],
        background=flags["background"],
        user=user,
        created_at=int(time.time()),
        include=tuple(include),
    )
    return request, asked


# -- endpoints --------------------------------------------------------------------------------


@openai_errors
async def create(request: Request) -> Response:
    """`POST /v1/responses`."""
    settings: Settings = request.app.state.settings
    service: ChatService = request.app.state.service
    responses = Responses(service)
    body = await read_json(request, settings.limits.max_body_bytes)
    chat_request, asked = parse_response_request(body, settings)
    user = client_identity(request, body.get("userId"))
    chat_request = replace(
        chat_request,
        user_id=user,
        cap_key=rate_key(request),
        host=request.headers.get("host", ""),
        restricted=restricted(request),
    )
    previous = None
    if asked.previous_response_id is not None:
        chat_request, previous = await responses.continued(
            chat_request, asked.previous_response_id, user
        )
    await count_request(request)
    handle = await service.start(chat_request)
    state = ResponseState(handle.answer_id, asked)
    await responses.keep(handle, asked, previous)
    if body.get("stream") is True:
        return _stream(request, service, handle, state, stop_on_disconnect=not asked.background)
    if asked.background:
        return JSONResponse(state.response())
    answer = await while_connected(request, service, handle, _feed(service, handle, state))
    return JSONResponse(answer.response())


def _stream(
    request: Request,
    service: ChatService,
    handle: Handle,
    state: ResponseState,
    *,
    stop_on_disconnect: bool,
    after: int = -1,
) -> Response:
    chunks = service.relay(handle, ResponsesEncoder(state, after))
    stop = (lambda: service.stop_here(handle)) if stop_on_disconnect else None
    return event_stream(request, chunks, "responses", stop)


async def _feed(service: ChatService, handle: Handle, state: ResponseState) -> ResponseState:
    async for events in service.relay(handle, Events()):
        for event in events:
            state.feed(event)
    return state


async def _found(request: Request) -> tuple[Responses, Found]:
    """The responses' service and a response the caller owns; `NotFound` for any other."""
    responses = Responses(request.app.state.service)
    user = client_identity(request, request.query_params.get("userId"))
    return responses, await responses.find(request.path_params["response_id"], user)


async def _response(responses: Responses, found: Found) -> Response:
    """The response as far as it got."""
    state = ResponseState(found.answer_id, found.asked)
    state.start()
    for event in await responses.events(found):
        state.feed(event)
    return JSONResponse(state.response())


@openai_errors
async def retrieve(request: Request) -> Response:
    """`GET /v1/responses/{id}`; `?stream=true&starting_after=N` follows it from event
    N+1 (from any process, while its events are kept)."""
    responses, found = await _found(request)
    params = request.query_params
    if params.get("stream") == "true":
        after = params.get("starting_after", "-1")
        if not re.fullmatch(r"-?[0-9]{1,9}", after):
            raise BadRequest("starting_after must be a sequence number")
        handle = await responses.running(found)
        state = ResponseState(found.answer_id, found.asked)
        return _stream(
            request, responses.service, handle, state, stop_on_disconnect=False, after=int(after)
        )
    return await _response(responses, found)


@openai_errors
async def delete(request: Request) -> Response:
    """`DELETE /v1/responses/{id}`: the response's answer and its question (the rest of
    their chat stays; an empty chat goes). `Conflict` while it runs."""
    responses, found = await _found(request)
    await responses.delete(found)
    return JSONResponse(
        {"id": response_id(found.answer_id), "object": "response.deleted", "deleted": True}
    )


@openai_errors
async def cancel(request: Request) -> Response:
    """`POST /v1/responses/{id}/cancel`: stops it wherever it runs, and answers the
    response once it has ended (or as it is, after `CANCEL_WAIT_SECONDS`)."""
    responses, found = await _found(request)
    return await _response(responses, await responses.cancel(found))
