"""When a schedule runs: five-field cron expressions read in a time zone (PROTOCOL §16).

Pure functions over `cronsim` (the parser Healthchecks runs in production: typed,
no dependencies, DST handled as cron does it). Raises `BadRequest` naming what is
wrong, so the API can answer with it as it is.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .errors import BadRequest

#: how many runs ahead the shortest gap of a cron expression is looked for: enough to
#: meet every minute and hour of a day's pattern more than once, and a few days' turns
GAP_LOOKAHEAD = 500
MAX_CRON_CHARS = 200


def zone(name: str) -> ZoneInfo:
    """The time zone of an IANA name (`Europe/Berlin`); `BadRequest` for another."""
    if not isinstance(name, str) or not name or len(name) > 64:
        raise BadRequest("timezone must be an IANA time zone name such as 'Europe/Berlin'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise BadRequest(f"timezone {name!r} is not a known IANA time zone") from exc


def check(cron: Any, timezone: str, min_interval: float) -> str:
    """`BadRequest` unless `cron` is five fields (minute hour day month weekday) that run
    no more often than every `min_interval` seconds in `timezone`."""
    if not isinstance(cron, str) or len(cron) > MAX_CRON_CHARS:
        raise BadRequest("cron must be a string of five fields: minute hour day month weekday")
    if len(cron.split()) != 5:
        raise BadRequest(
            f"cron {cron!r} must have five fields (minute hour day month weekday),"
            f" not {len(cron.split())}"
        )
    times = upcoming(cron, timezone, datetime.now(UTC).timestamp(), GAP_LOOKAHEAD)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if not times:
        raise BadRequest(f"cron {cron!r} never runs")
    if gaps and min(gaps) < min_interval:
        raise BadRequest(
            f"cron {cron!r} runs every {min(gaps):.0f} seconds at times; this server runs a"
            f" schedule at most every {min_interval:.0f} seconds"
        )
    return cron


def upcoming(cron: str, timezone: str, after: float, count: int = 1) -> list[float]:
    """The next `count` times (Unix seconds) after `after` that `cron` names in `timezone`.
    `BadRequest` for an expression cron does not read."""
    start = datetime.fromtimestamp(after, zone(timezone))
    try:
        times = CronSim(cron, start)
        return [moment.timestamp() for moment in itertools.islice(times, count)]
    except (CronSimError, StopIteration) as exc:
        raise BadRequest(f"cron {cron!r} is not a cron expression: {exc}") from exc


def next_time(cron: str, timezone: str, after: float) -> float:
    """The first time after `after` that `cron` names (Unix seconds)."""
    times = upcoming(cron, timezone, after)
    if not times:
        raise BadRequest(f"cron {cron!r} never runs")
    return times[0]
