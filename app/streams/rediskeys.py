"""The Redis hub's key names and how it encodes what it keeps in them.

Every key carries a hash tag (`{…}`), so that each command, script and transaction
touches one hash slot of a Redis Cluster (and one node):

    sc:{c:chatId}:run        the running generation's handle (JSON): claimed with SET NX,
                             extended and released only by its owner; its TTL makes a
                             dead process's claim expire
    sc:{c:chatId}:latest     the chat's newest answer id
    sc:{a:answerId}:gen      the handle, kept while the events are (for resume)
    sc:{a:answerId}:owner    the token of the process that runs it
    sc:{a:answerId}:log      a Redis Stream; each entry holds a batch of its events
    sc:{a:answerId}:cancel   a short-lived cancel flag, in case pub/sub misses the owner
    sc:{p:token}:proc        this process is alive (TTL twice `handle_ttl`, refreshed by its
                             heartbeat); found missing, it tells the process that Redis
                             lost its data
    sc:{p:token}:journal     a Redis Stream of this process's events not yet in their logs:
                             one entry per commit, one field per generation
    sc:{u:capKey}:active     running answer ids scored by expiry (the concurrency cap)
    sc:{lead:chore}          the lock of a one-at-a-time chore (the sweeper)
    sc:{recovering}          set while owners re-assert what Redis lost
    channel sc:cancel        pub/sub: answer ids to cancel
    channel sc:follow:token  pub/sub: answer ids of that process that another one follows

Keys of one chat, of one answer or of one process share a slot; nothing reads
keys of two tags atomically.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..events import Event, Handle

#: how often a follower says again that it follows (the owner forgets after three times that)
WATCH_EVERY = 2.0
#: how long the hub waits when every connection its client may open is busy
BUSY_SECONDS = 0.05

PREFIX = "sc:"
CANCEL_CHANNEL = PREFIX + "cancel"
#: set (with a TTL of `settle`) by the first process to find Redis empty: until it
#: expires, owners are re-asserting, so claims are refused and none counts as gone
RECOVERING = PREFIX + "{recovering}"


def run(chat_id: str) -> str:
    return f"{PREFIX}{{c:{chat_id}}}:run"


def latest(chat_id: str) -> str:
    return f"{PREFIX}{{c:{chat_id}}}:latest"


def gen(answer_id: str) -> str:
    return f"{PREFIX}{{a:{answer_id}}}:gen"


def owner(answer_id: str) -> str:
    return f"{PREFIX}{{a:{answer_id}}}:owner"


def log(answer_id: str) -> str:
    return f"{PREFIX}{{a:{answer_id}}}:log"


def cancel(answer_id: str) -> str:
    return f"{PREFIX}{{a:{answer_id}}}:cancel"


def proc(token: str) -> str:
    return f"{PREFIX}{{p:{token}}}:proc"


def journal(token: str) -> str:
    return f"{PREFIX}{{p:{token}}}:journal"


def follow_channel(token: str) -> str:
    return f"{PREFIX}follow:{token}"


def active(cap_key: str) -> str:
    return f"{PREFIX}{{u:{cap_key}}}:active"


def lead(chore: str) -> str:
    return f"{PREFIX}{{lead:{chore}}}"


_HANDLE_FIELDS = ("chat_id", "answer_id", "question_id", "user_id", "question")


def dump_handle(handle: Handle) -> bytes:
    """A handle as Redis keeps it (compared byte for byte)."""
    return orjson.dumps({name: getattr(handle, name) for name in _HANDLE_FIELDS})


def load_handle(raw: bytes | str) -> Handle:
    fields = orjson.loads(raw)  # what a newer version adds is left out
    return Handle(**{name: fields[name] for name in _HANDLE_FIELDS})


def dump_events(events: list[Event]) -> bytes:
    return orjson.dumps([[e.seq, e.type, e.data, e.ts] for e in events])


def load_events(raw: bytes, handle: Handle) -> list[Event]:
    return [
        Event(kind, handle.chat_id, handle.answer_id, data, seq, ts)
        for seq, kind, data, ts in orjson.loads(raw)
    ]


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, n = text(entry_id).partition("-")
    return int(ms), int(n or 0)


def entry_id(entry: tuple[int, int]) -> str:
    return f"{entry[0]}-{entry[1]}"


def entries(response: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries of an XREAD answer, of whatever streams it names."""
    return [entry for _key, found in response or () for entry in found]


def after(events: dict[int, Event], seq: int) -> list[Event]:
    """The events after `seq`, up to the first one missing."""
    out = []
    while (event := events.get(seq + 1)) is not None:
        out.append(event)
        seq += 1
    return out


def error(handle: Handle, seq: int, message: str) -> Event:
    return Event(
        "error", handle.chat_id, handle.answer_id, {"key": "STREAM_ERROR", "data": message}, seq
    )
