"""Text that every store and every encoder can keep: without NUL characters
(PostgreSQL's text and jsonb refuse them; model output and web pages may hold them)
and without lone UTF-16 surrogates (not UTF-8 at all, so orjson, asyncpg and SQLite
refuse them; Python's own JSON decoder lets an escaped `"\ud800"` through).
Imports nothing of ours."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

#: what neither store can keep in text: NUL (PostgreSQL's text and jsonb refuse it)
#: and lone UTF-16 surrogates (not UTF-8 at all; a JSON decoder lets `"\ud800"` through)
UNKEEPABLE = re.compile("[\x00\ud800-\udfff]")


def _kept(match: re.Match[str]) -> str:
    return "" if match.group() == "\x00" else "\ufffd"


def clean(value: Any) -> Any:
    """`value` without NUL characters or lone surrogates in any of its text (a NUL
    dropped, a surrogate replaced by U+FFFD): strings, and the strings inside lists,
    tuples, dicts and dataclasses (bytes are left as they are). What holds none is
    returned as it is, so the usual call costs a scan and nothing more."""
    if isinstance(value, str):
        return UNKEEPABLE.sub(_kept, value) if UNKEEPABLE.search(value) else value
    if isinstance(value, list):
        cleaned = [clean(v) for v in value]
        return value if all(a is b for a, b in zip(cleaned, value, strict=True)) else cleaned
    if isinstance(value, tuple):
        cleaned_t = tuple(clean(v) for v in value)
        return value if all(a is b for a, b in zip(cleaned_t, value, strict=True)) else cleaned_t
    if isinstance(value, dict):
        items = [(clean(k), clean(v)) for k, v in value.items()]
        if all(ck is k and cv is v for (ck, cv), (k, v) in zip(items, value.items(), strict=True)):
            return value
        return dict(items)
    names = _FIELDS.get(value.__class__)
    if names is None:
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            return value
        names = _FIELDS[value.__class__] = tuple(f.name for f in dataclasses.fields(value))
    changed = {}
    for name in names:
        old = getattr(value, name)
        new = clean(old)
        if new is not old:
            changed[name] = new
    return dataclasses.replace(value, **changed) if changed else value


#: the field names of each dataclass `clean` has met (asking `dataclasses.fields` cost
#: more than the rest of cleaning one: a checkpoint cleans one per running answer)
_FIELDS: dict[type, tuple[str, ...]] = {}
