"""`GET /api/usage`: what a user's answers cost. `usage_json` is shared with the
admin's view of any user (`auth_routes`)."""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..chat.service import ChatService
from ..errors import BadRequest
from .http import client_identity, json_errors


@json_errors
async def usage(request: Request) -> Response:
    """`GET /api/usage?userId=&since=`: what the user's answers cost, per model and in
    all (tokens as the model counted them, or estimated where it did not)."""
    user_id = client_identity(request, request.query_params.get("userId"))
    return JSONResponse(await usage_json(request, user_id))


async def usage_json(request: Request, user_id: str) -> dict[str, Any]:
    """What `user_id`'s answers since `?since=` (Unix seconds) cost, as `/api/usage` says."""
    since_text = request.query_params.get("since", "0")
    try:
        since = float(since_text)
    except ValueError as exc:
        raise BadRequest("since must be Unix seconds") from exc
    if not math.isfinite(since):
        raise BadRequest("since must be Unix seconds")
    service: ChatService = request.app.state.service
    rows = await service.usage(user_id, since)
    total = {
        key: sum(row.to_json()[key] for row in rows)
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens", "total_tokens")
    }
    return {
        "userId": user_id,
        "since": since,
        "models": [
            {"model": r.model, "answers": r.answers, "estimated": r.estimated, **r.to_json()}
            for r in rows
        ],
        "total": {"answers": sum(r.answers for r in rows), **total},
    }
