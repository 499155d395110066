"""The chat rules of OpenAI's Responses API (PROTOCOL §11): what a response reads and
writes beside its generation.

A response is a generation of the one chat service; its id is `resp_<answerId>`.
Beside the answer, the store keeps what the request said that the response echoes
(`ResponseRequest`), the response it continued, and once it has ended what its stream
showed beyond the answer's text (`outcome_of`). `Responses` is the small service the
transport calls: it continues a response (`previous_response_id`, with the thread of
turns that led to it as history), keeps a new one and settles it once it has ended,
finds a caller's own response (`NotFound` for any other, as for one that does not
exist), and says which events make a response as far as it got — from the
generation's log while it is kept, else rebuilt from the stored answer. Turning those
events into the Responses stream is the transport's (I/O-free) encoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import AppError, BadRequest, Conflict, NotFound
from ..events import Event, Handle
from ..ids import parse_id
from ..ownership import authorize
from ..protocol import ChatRequest, Events
from ..store import Chat, StoredMessage, StoredResponse
from .history import HISTORY_MESSAGES
from .service import ChatService

log = logging.getLogger("app.responses")

#: how long a cancel waits for the response to end before it answers
CANCEL_WAIT_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class ResponseRequest:
    """What a response echoes of its request (kept with its answer, `to_json`)."""

    model: str
    instructions: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    user: str | None = None
    created_at: int = 0
    include: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "instructions": self.instructions,
            "metadata": self.metadata,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "background": self.background,
            "user": self.user,
            "created_at": self.created_at,
            "include": list(self.include),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResponseRequest:
        return cls(
            model=str(data.get("model") or ""),
            instructions=data.get("instructions"),
            metadata=dict(data.get("metadata") or {}),
            previous_response_id=data.get("previous_response_id"),
            store=data.get("store") is not False,
            background=data.get("background") is True,
            user=data.get("user"),
            created_at=int(data.get("created_at") or 0),
            include=tuple(data.get("include") or ()),
        )


def response_id(answer_id: str) -> str:
    return f"resp_{answer_id}"


def answer_of(rid: str) -> str:
    """The answer id of a response id; `NotFound` for anything that is not one of ours."""
    if not rid.startswith("resp_"):
        raise _missing(rid)
    try:
        return parse_id(rid.removeprefix("resp_"), "response id")
    except BadRequest:
        raise _missing(rid) from None


def _missing(rid: str) -> NotFound:
    return NotFound(f"no response with id {rid!r}")


def search_step(data: dict[str, Any]) -> dict[str, Any] | None:
    """The search step a `progress` event's data carries, if it carries one."""
    step = data.get("step")
    return step if isinstance(step, dict) and step.get("kind") == "search" else None


def outcome_of(events: Sequence[Event]) -> list[dict[str, Any]]:
    """What a response's stream showed that its stored answer does not hold, to be
    kept with it: its search steps and their notes, and its terminal event (status,
    usage, images, related questions; or the error)."""
    return [
        {"type": e.type, "data": e.data}
        for e in events
        if e.terminal or (e.type == "progress" and search_step(e.data) is not None)
    ]


def _said(*messages: StoredMessage | None) -> list[tuple[str, str]]:
    """The messages a conversation shows (as `stored_history` keeps them): questions,
    and answers that completed or were stopped, with text."""
    return [
        (m.role, m.content)
        for m in messages
        if m is not None
        and m.content
        and (m.role == "user" or m.status in ("completed", "cancelled"))
    ]


@dataclass(frozen=True, slots=True)
class Found:
    """A response the caller owns: its answer, chat and what was kept with it."""

    answer_id: str
    answer: StoredMessage
    chat: Chat
    user: str
    kept: StoredResponse | None

    @property
    def asked(self) -> ResponseRequest:
        """What its request said (as far as it is known: an answer that was not asked
        through this API, or whose request was not kept, shows its chat's mode)."""
        if self.kept is not None:
            return ResponseRequest.from_json(self.kept.request)
        return ResponseRequest(model=self.chat.focus_mode, created_at=int(self.answer.created_at))


class Responses:
    """The Responses API's reads and writes of the store and the hub, over one
    `ChatService`. Holds no state of its own: one may be made per request."""

    def __init__(self, service: ChatService) -> None:
        self.service = service

    async def _owned(self, rid: str, user: str) -> tuple[str, StoredMessage, Chat]:
        """The answer id, answer and chat of the response `rid` if `user` owns it;
        `NotFound` for any other, as for a response that does not exist."""
        answer_id = answer_of(rid)
        store = self.service.store
        answer = await store.get_message(answer_id)
        chat = await store.get_chat(answer.chat_id) if answer is not None else None
        if answer is None or answer.role != "assistant" or chat is None:
            raise _missing(rid)
        authorize(chat.user_id, user, refusal=_missing(rid))
        return answer_id, answer, chat

    async def continued(
        self, request: ChatRequest, previous: str, user: str
    ) -> tuple[ChatRequest, str]:
        """The request as the next turn after the response `previous` (the user's own:
        `NotFound` otherwise, as for a response that does not exist), in its chat, with
        the conversation that led to it as history (`thread`) — so a `previous` that is
        not the chat's newest answer branches from there, as OpenAI's do; and its answer
        id."""
        answer_id, answer, chat = await self._owned(previous, user)
        given = request.history or ()
        history = (*await self.thread(answer), *given)[-HISTORY_MESSAGES:]
        return replace(request, chat_id=chat.id, history=history), answer_id

    async def thread(self, answer: StoredMessage) -> list[tuple[str, str]]:
        """The conversation up to and including `answer` (role, text), at most
        `HISTORY_MESSAGES`: its question and itself after the conversation of the
        response it continued, and so on back; a turn that continued none ends it, and
        one not made here (a chat's own question) continues from the chat's messages
        before it."""
        store = self.service.store
        messages = await store.list_messages(answer.chat_id)
        by_id = {m.id: m for m in messages}
        turns: list[tuple[str, str]] = []
        current: StoredMessage | None = answer
        while current is not None and len(turns) < HISTORY_MESSAGES:
            question = by_id.get(current.reply_to or "")
            turns[:0] = _said(question, current)
            kept = await store.get_response(current.id)
            if kept is None:  # continues whatever came before it in the chat
                first = (question or current).id
                start = next((i for i, m in enumerate(messages) if m.id == first), 0)
                turns[:0] = _said(*messages[:start])
                break
            current = by_id.get(kept.previous) if kept.previous else None
        return turns[-HISTORY_MESSAGES:]

    async def keep(self, handle: Handle, asked: ResponseRequest, previous: str | None) -> None:
        """Keep what the request of the response `handle` runs said, and settle the
        response once it has ended (`settle`, in the background). A store that fails
        loses only the echo: the answer runs and is saved."""
        service = self.service
        try:
            await service.store.add_response(
                StoredResponse(handle.answer_id, asked.to_json(), previous)
            )
        except AppError as exc:
            log.warning(
                "response %s: its request was not kept (%s)",
                response_id(handle.answer_id),
                exc.message,
            )
        service.chores.spawn(self.settle(handle, asked.store), name=f"settle-{handle.answer_id}")

    async def settle(self, handle: Handle, store: bool) -> None:
        """Once the response has ended: with `store: false` its question and answer are
        deleted (the rest of their chat stays; an empty chat goes); else what its stream
        showed beyond the answer's text is kept with the answer (`outcome_of`)."""
        service = self.service
        await service.ended(handle)
        if not store:
            await service.store.delete_turn(handle.answer_id)
            return
        events = await service.hub.logged(handle.answer_id)
        if events and events[-1].terminal:
            await service.store.end_response(handle.answer_id, outcome_of(events))

    async def find(self, rid: str, user: str) -> Found:
        """A response `user` owns; `NotFound` for any other."""
        answer_id, answer, chat = await self._owned(rid, user)
        kept = await self.service.store.get_response(answer_id)
        return Found(answer_id, answer, chat, user, kept)

    async def running(self, found: Found) -> Handle:
        """The handle to follow the response's generation by; `NotFound` once its
        events are no longer kept."""
        handle = await self.service.hub.find(found.answer_id)
        if handle is None:
            raise NotFound("this response's events are no longer kept: GET it without stream")
        return handle

    async def events(self, found: Found) -> list[Event]:
        """The events that make the response as far as it got: the generation's log
        while it is kept, else events rebuilt from the stored answer and what was kept
        with it."""
        service, answer_id, answer = self.service, found.answer_id, found.answer
        logged = await service.hub.logged(answer_id)
        if logged:
            return list(logged)
        chat_id = answer.chat_id

        def event(kind: str, data: dict[str, Any]) -> Event:
            return Event(kind, chat_id, answer_id, data)

        outcome = found.kept.outcome if found.kept is not None else None
        kept = [event(e["type"], e["data"]) for e in outcome or ()]
        stored = [e for e in kept if not e.terminal]
        messages = await service.store.list_messages(chat_id)
        question = next((m for m in messages if m.id == answer.reply_to), None)
        stored += [
            event("sources", {"data": question.sources if question is not None else []}),
            event("reasoning", {"data": answer.reasoning}),
            event("message", {"data": answer.content}),
        ]
        if kept and kept[-1].terminal:
            stored.append(kept[-1])
        elif answer.status == "failed":
            stored.append(event("error", answer.error or {}))
        elif answer.status != "streaming":
            truncated = {"truncated": True} if answer.truncated else {}
            stored.append(event("messageEnd", {"status": answer.status, **truncated}))
        return stored

    async def _runs(self, found: Found) -> Handle | None:
        handle = await self.service.hub.lookup(found.chat.id)
        return handle if handle is not None and handle.answer_id == found.answer_id else None

    async def delete(self, found: Found) -> None:
        """Delete the response's answer and its question (the rest of their chat stays;
        an empty chat goes). `Conflict` while it runs."""
        if await self._runs(found) is not None:
            raise Conflict("this response is running: cancel it first")
        await self.service.store.delete_turn(found.answer_id)

    async def cancel(self, found: Found) -> Found:
        """Stop the response wherever it runs, and wait for it to end (at most
        `CANCEL_WAIT_SECONDS`); the response as it is then."""
        service = self.service
        handle = await self._runs(found)
        if handle is not None:
            await service.cancel(found.chat.id, found.user)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CANCEL_WAIT_SECONDS):
                    async for _ in service.relay(handle, Events()):
                        pass
        fresh = await service.store.get_message(found.answer_id) or found.answer
        return replace(found, answer=fresh)
