"""Scheduled research over HTTP (PROTOCOL §16): `/api/schedules`.

The user is the credential's with auth on; with auth off the `userId` of the query
(GET, DELETE) or of the JSON body (POST, PATCH), and `"0"` without one (§7)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import NotFound
from ..schedules import ScheduleService, schedule_json
from .http import client_identity, count_request, json_errors, read_json


def _schedules(request: Request) -> ScheduleService:
    schedules: ScheduleService | None = getattr(request.app.state, "schedules", None)
    if schedules is None:
        raise NotFound("scheduled research is off on this server (schedules.enabled)")
    return schedules


def _user(request: Request, body: Any = None) -> str:
    claimed = body.get("userId") if isinstance(body, dict) else None
    return client_identity(request, claimed or request.query_params.get("userId"))


async def _body(request: Request) -> Any:
    return await read_json(request, request.app.state.settings.limits.max_body_bytes)


@json_errors
async def create(request: Request) -> Response:
    body = await _body(request)
    schedule = await _schedules(request).create(_user(request, body), body)
    return JSONResponse({"schedule": schedule_json(schedule, secret=True)}, status_code=201)


@json_errors
async def listed(request: Request) -> Response:
    schedules = await _schedules(request).listed(_user(request))
    return JSONResponse({"schedules": [schedule_json(s) for s in schedules]})


@json_errors
async def get(request: Request) -> Response:
    schedule = await _schedules(request).owned(_user(request), request.path_params["id"])
    return JSONResponse({"schedule": schedule_json(schedule)})


@json_errors
async def update(request: Request) -> Response:
    body = await _body(request)
    schedule, new_secret = await _schedules(request).update(
        _user(request, body), request.path_params["id"], body
    )
    return JSONResponse({"schedule": schedule_json(schedule, secret=new_secret)})


@json_errors
async def delete(request: Request) -> Response:
    await _schedules(request).delete(_user(request), request.path_params["id"])
    return JSONResponse({"id": request.path_params["id"], "deleted": True})


@json_errors
async def run_now(request: Request) -> Response:
    body = await _body(request) if request.headers.get("content-length", "0") != "0" else None
    await count_request(request)
    run = await _schedules(request).run_now(_user(request, body), request.path_params["id"])
    return JSONResponse({"run": {"id": run.id}}, status_code=202)


@json_errors
async def runs(request: Request) -> Response:
    found = await _schedules(request).runs(_user(request), request.path_params["id"])
    return JSONResponse({"runs": [run.to_json() for run in found]})
