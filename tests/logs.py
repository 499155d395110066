"""What tests read of the log: every record as one text, exceptions included."""

from __future__ import annotations

import logging


def everything_logged(records: list[logging.LogRecord]) -> str:
    out = []
    for r in records:
        out.append(f"{r.name} {r.getMessage()} {getattr(r, 'fields', '')}")
        if r.exc_info:
            out.append(logging.Formatter().formatException(r.exc_info))
    return "\n".join(out)
