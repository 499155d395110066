"""Scheduled research (PROTOCOL §16): the API, the scheduler's claims (exactly one run
per due time, one catch-up run, one retry of a run whose process died), `changed`,
and signed webhooks to a receiver on loopback.

The scheduler's clock is driven by the tests (`Clock`), so due times come without
waiting for real minutes; one test runs a real cron (due every 5 seconds) on two processes."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from app import cron
from app.config import Settings
from app.errors import BadRequest
from app.main import create_app, open_service
from app.metrics import Metrics
from app.schedules import ScheduleService, verdict
from app.store import open_store
from app.store.records import Chat, Delivery, Schedule, ScheduleRun, iso
from app.webhooks import Webhooks, new_secret, sign
from tests.client import wait_for
from tests.conftest import USER
from tests.fakes.model import FakeModel
from tests.fakes.webhooks import WebhookReceiver
from tests.identity import browser, sign_up
from tests.servers import ServerThread, processes, serve

pytestmark = pytest.mark.anyio

#: a Monday, 00:00 UTC
MONDAY = 1_798_416_000.0
YEARLY = "0 0 1 1 *"


class Clock:
    """A clock the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def receiver() -> Iterator[tuple[WebhookReceiver, ServerThread]]:
    hooks = WebhookReceiver()
    with serve(hooks.app()) as server:
        yield hooks, server


@pytest.fixture
def sched_settings(settings: Settings) -> Settings:
    """Minutely schedules allowed, webhooks to loopback allowed, and a tick so rare that
    only the test's own ticks count."""
    return settings.replace(
        schedules={
            "min_interval_seconds": 60,
            "webhook_allow_private_networks": True,
            "tick_seconds": 3600,
            "lease_seconds": 30,
        }
    )


@contextlib.asynccontextmanager
async def scheduler(
    settings: Settings, clock: Clock, **kwargs: Any
) -> AsyncIterator[ScheduleService]:
    """A scheduler on a chat service of its own (its store, its hub), never ticking by
    itself: the test calls `tick`."""
    async with open_service(settings, metrics=Metrics()) as chat:
        schedules = ScheduleService(chat, clock=clock, **kwargs)
        try:
            yield schedules
        finally:
            await schedules.aclose()


async def tick(schedules: ScheduleService) -> list[Any]:
    """One tick, and the runs it started, to their end."""
    tasks = await schedules.tick()
    if tasks:
        await asyncio.gather(*tasks)
    return tasks


def body(**fields: Any) -> dict[str, Any]:
    return {"question": "what changed?", "cron": "0 8 * * 1-5", "focusMode": "deepSeek", **fields}


# -- cron ---------------------------------------------------------------------------------


def test_cron_reads_five_fields_in_a_time_zone() -> None:
    # 08:00 in Berlin is 07:00 UTC in winter and 06:00 UTC in summer
    winter = cron.next_time("0 8 * * *", "Europe/Berlin", MONDAY)
    assert winter - MONDAY == 7 * 3600
    summer = cron.next_time("0 8 * * *", "Europe/Berlin", MONDAY + 180 * 86400)
    assert (summer - MONDAY - 180 * 86400) % 86400 == 6 * 3600
    for bad, named in [
        ("* * * *", "five fields"),
        ("0 8 * * * *", "five fields"),
        ("61 * * * *", "not a cron expression"),
        ("@hourly", "five fields"),
    ]:
        with pytest.raises(BadRequest, match=named):
            cron.check(bad, "UTC", 60)
    with pytest.raises(BadRequest, match="timezone"):
        cron.check("0 8 * * *", "Mars/Olympus", 60)
    # the shortest gap counts, wherever it falls in the pattern
    with pytest.raises(BadRequest, match="every 60 seconds"):
        cron.check("0,1 9 * * *", "UTC", 3600)
    with pytest.raises(BadRequest, match="every 1800 seconds"):
        cron.check("*/30 * * * *", "UTC", 3600)
    assert cron.check("0 * * * *", "UTC", 3600) == "0 * * * *"


def test_the_judge_is_read_strictly() -> None:
    assert verdict("no") is False
    assert verdict(" No. ") is False
    assert verdict("yes") is True
    assert verdict("no, they differ") is True  # not one word: counts as changed
    assert verdict("") is True
    assert verdict("maybe") is True


# -- the API --------------------------------------------------------------------------------


@pytest.fixture
def sched_server(sched_settings: Settings) -> Iterator[ServerThread]:
    with serve(create_app(sched_settings.replace(schedules={"max_per_user": 2}))) as running:
        yield running


async def test_api_validates_and_only_the_owner_uses_a_schedule(
    sched_server: ServerThread, fake_model: FakeModel
) -> None:
    async with httpx.AsyncClient(base_url=sched_server.url, timeout=10, event_hooks=USER) as http:
        for wrong, named in [
            ({"cron": "* * *"}, "cron"),
            ({"cron": "*/30 * * * * *"}, "five fields"),
            ({"timezone": "Nowhere/Else"}, "timezone"),
            ({"webhook": {"url": "ftp://example.com/x"}}, "webhook.url"),
            ({"webhook": {"url": "not a url"}}, "webhook.url"),
            ({"notify": "sometimes"}, "notify"),
            ({"focusMode": "nope"}, "focusMode"),
            ({"question": " "}, "question"),
            ({"chatModel": "gpt"}, "chatModel"),
        ]:
            response = await http.post("/api/schedules", json=body(**wrong))
            assert response.status_code == 400, (wrong, response.text)
            assert named in response.json()["data"]
        response = await http.post(
            "/api/schedules",
            json=body(
                timezone="Europe/Berlin",
                webhook={"url": "https://hooks.example.com/in"},
                notify="changed",
                chatModel={"provider": "default", "model": "fake-chat"},
            ),
        )
        assert response.status_code == 201, response.text
        made = response.json()["schedule"]
        assert re.fullmatch(r"whsec_[A-Za-z0-9+/]+=*", made["webhook"]["secret"])
        assert made["timezone"] == "Europe/Berlin" and made["enabled"] is True
        assert made["chatModel"] == {"provider": "default", "model": "fake-chat"}
        assert made["nextRunAt"].endswith(":00:00.000Z")  # 08:00 Berlin: 06:00 or 07:00 UTC
        schedule_id, chat_id = made["id"], made["chatId"]
        # the secret was shown once
        listed = (await http.get("/api/schedules")).json()["schedules"]
        assert [s["id"] for s in listed] == [schedule_id]
        assert listed[0]["webhook"] == {"url": "https://hooks.example.com/in"}
        # its chat exists from the start
        assert (await http.get(f"/api/chats/{chat_id}")).status_code == 200
        # another user may not see, change, run or delete it
        for method, path in [
            ("GET", f"/api/schedules/{schedule_id}"),
            ("PATCH", f"/api/schedules/{schedule_id}"),
            ("DELETE", f"/api/schedules/{schedule_id}"),
            ("POST", f"/api/schedules/{schedule_id}/run"),
            ("GET", f"/api/schedules/{schedule_id}/runs"),
        ]:
            kwargs: dict[str, Any] = {"params": {"userId": "2"}}
            if method in ("PATCH", "POST"):
                kwargs["json"] = {"userId": "2", "enabled": False}
            response = await http.request(method, path, **kwargs)
            assert response.status_code == 403, (method, path, response.text)
        assert (await http.get("/api/schedules", params={"userId": "2"})).json() == {
            "schedules": []
        }
        # a change of cron moves the next run; pausing and resuming
        response = await http.patch(
            f"/api/schedules/{schedule_id}", json={"cron": "30 9 * * *", "timezone": "UTC"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["schedule"]["nextRunAt"].endswith("T09:30:00.000Z")
        assert "secret" not in response.json()["schedule"]["webhook"]
        response = await http.patch(f"/api/schedules/{schedule_id}", json={"enabled": False})
        assert response.json()["schedule"]["enabled"] is False
        response = await http.patch(f"/api/schedules/{schedule_id}", json={"cron": "* * * * *"})
        assert response.status_code == 200  # minutely is allowed here (min 60 s)
        response = await http.patch(f"/api/schedules/{schedule_id}", json={"cron": "bad"})
        assert response.status_code == 400 and "cron" in response.json()["data"]
        # at most max_per_user (2)
        assert (await http.post("/api/schedules", json=body())).status_code == 201
        response = await http.post("/api/schedules", json=body())
        assert response.status_code == 409 and "at most 2" in response.json()["data"]
        # run now: an ordinary answer in the schedule's chat
        response = await http.post(f"/api/schedules/{schedule_id}/run", json={})
        assert response.status_code == 202, response.text
        run_id = response.json()["run"]["id"]

        async def ended() -> Any:
            runs = (await http.get(f"/api/schedules/{schedule_id}/runs")).json()["runs"]
            return runs if runs and runs[0]["status"] != "running" else None

        runs = await wait_for(ended, timeout=15)
        assert [r["id"] for r in runs] == [run_id]
        assert runs[0]["status"] == "completed" and runs[0]["changed"] is True
        assert runs[0]["retry"] is False
        chat = (await http.get(f"/api/chats/{chat_id}")).json()
        assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
        assert chat["messages"][1]["id"] == runs[0]["messageId"]
        assert chat["messages"][0]["content"] == "what changed?"
        # deleting the schedule keeps its chat
        response = await http.delete(f"/api/schedules/{schedule_id}")
        assert response.status_code == 200
        assert (await http.get(f"/api/schedules/{schedule_id}")).status_code == 404
        assert (await http.get(f"/api/chats/{chat_id}")).status_code == 200


async def test_webhooks_to_private_addresses_are_refused_by_default(settings: Settings) -> None:
    with serve(create_app(settings)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=10, event_hooks=USER) as http:
            for url in [
                "http://127.0.0.1:9/x",
                "http://localhost:9/x",
                "http://10.0.0.1/x",
                "http://169.254.169.254/latest",
                "http://[::1]/x",
            ]:
                response = await http.post(
                    "/api/schedules", json=body(cron="0 8 * * *", webhook={"url": url})
                )
                assert response.status_code == 400, url
                assert "webhook.url" in response.json()["data"]
            # and hourly is the least gap by default
            response = await http.post("/api/schedules", json=body(cron="*/30 * * * *"))
            assert response.status_code == 400


async def test_keys_decide_the_user(sched_settings: Settings) -> None:
    keyed = sched_settings.replace(auth={"api_keys": {"key-a": "user-a", "key-b": "user-b"}})
    with serve(create_app(keyed)) as running:
        a = {"authorization": "Bearer key-a"}
        b = {"authorization": "Bearer key-b"}
        async with httpx.AsyncClient(base_url=running.url, timeout=10) as http:
            assert (await http.get("/api/schedules")).status_code == 401
            response = await http.post("/api/schedules", json=body(), headers=a)
            assert response.status_code == 201
            schedule_id = response.json()["schedule"]["id"]
            assert (await http.get(f"/api/schedules/{schedule_id}", headers=a)).status_code == 200
            assert (await http.get(f"/api/schedules/{schedule_id}", headers=b)).status_code == 403
            assert (await http.get("/api/schedules", headers=b)).json()["schedules"] == []
            # a claimed userId that is not the key's is refused
            response = await http.post("/api/schedules", json=body(userId="user-b"), headers=a)
            assert response.status_code == 403


async def test_accounts_own_their_schedules(sched_settings: Settings) -> None:
    accounts = sched_settings.replace(auth={"mode": "accounts"})
    with serve(create_app(accounts)) as running:
        async with browser(running.url) as ann, browser(running.url) as bob:
            await sign_up(ann, "ann@example.com")
            await sign_up(bob, "bob@example.com")
            response = await ann.post("/api/schedules", json=body())
            assert response.status_code == 201, response.text
            schedule_id = response.json()["schedule"]["id"]
            assert (await bob.get(f"/api/schedules/{schedule_id}")).status_code == 403
            assert (await bob.delete(f"/api/schedules/{schedule_id}")).status_code == 403
            assert (await ann.get(f"/api/schedules/{schedule_id}")).status_code == 200


# -- the scheduler, on a clock the test moves -------------------------------------------------


async def test_each_due_time_runs_once_and_missed_ones_give_one_catch_up(
    sched_settings: Settings, fake_model: FakeModel
) -> None:
    clock = Clock(MONDAY)
    async with scheduler(sched_settings, clock) as schedules:
        made = await schedules.create("1", body(cron="* * * * *"))
        assert made.next_run_at == MONDAY + 60
        assert await tick(schedules) == []  # not due yet
        for minute in (1, 2, 3):
            clock.now = MONDAY + 60 * minute + 5
            assert len(await tick(schedules)) == 1
            assert await tick(schedules) == []  # the same due time: taken already
        # every process was down for ten minutes: one run, for the first missed time
        clock.now = MONDAY + 60 * 13 + 5
        assert len(await tick(schedules)) == 1
        assert await tick(schedules) == []
        runs = await schedules.runs("1", made.id)
        assert [r.due_at - MONDAY for r in reversed(runs)] == [60, 120, 180, 240]
        assert all(r.status == "completed" for r in runs)
        again = await schedules.owned("1", made.id)
        assert again.next_run_at == MONDAY + 60 * 14
        # each run an answer in the schedule's chat
        messages = await schedules.store.list_messages(made.chat_id)
        assert [m.role for m in messages] == ["user", "assistant"] * 4
        assert {m.id for m in messages if m.role == "assistant"} == {r.message_id for r in runs}


async def test_two_schedulers_on_postgresql_claim_each_due_time_once(
    sched_settings: Settings, postgres_url: str
) -> None:
    shared = sched_settings.replace(store={"url": postgres_url})
    clock = Clock(MONDAY)
    claimed: list[tuple[str, float, str]] = []

    def recording(name: str, schedules_of: dict[str, ScheduleService]) -> Any:
        async def run(schedule: Schedule, run: ScheduleRun) -> None:
            claimed.append((schedule.id, run.due_at, name))
            await asyncio.sleep(0.01)
            ended = replace(run, status="completed", ended_at=clock())
            me = schedules_of[name]
            assert await me.store.end_run(ended, me.owner, 5)

        return run

    both: dict[str, ScheduleService] = {}
    async with (
        scheduler(shared, clock, runner=recording("a", both)) as a,
        scheduler(shared, clock, runner=recording("b", both)) as b,
    ):
        both.update(a=a, b=b)
        made = [await a.create(str(n % 3), body(cron="* * * * *")) for n in range(30)]
        for minute in range(1, 6):
            clock.now = MONDAY + 60 * minute + 1
            await asyncio.gather(tick(a), tick(b), tick(a), tick(b))
    expected = {(s.id, MONDAY + 60 * m) for s in made for m in range(1, 6)}
    got = [(schedule_id, due) for schedule_id, due, _ in claimed]
    assert len(got) == len(expected) and set(got) == expected  # each once, none missed


async def test_changed_is_judged_and_notify_changed_sends_only_then(
    sched_settings: Settings,
    fake_model: FakeModel,
    receiver: tuple[WebhookReceiver, ServerThread],
) -> None:
    hooks, hook_server = receiver

    def judge(prompt: str) -> str:
        earlier = prompt.split("Earlier answer:\n", 1)[1].split("\n\nLatest answer:", 1)[0]
        latest = prompt.split("Latest answer:\n", 1)[1].split("\n\nDo they differ", 1)[0]
        return "no" if earlier.strip() == latest.strip() else "yes"

    fake_model.replies.insert(0, ("differ in substance", judge))
    clock = Clock(MONDAY)
    async with scheduler(sched_settings, clock) as schedules:
        made = await schedules.create(
            "1",
            body(cron="0 * * * *", notify="changed", webhook={"url": hook_server.url + "/in"}),
        )
        changes = []
        for hour, text in enumerate(["Rates are 4%.", "Rates are 4%.", "Rates are 5%."], 1):
            fake_model.answer_text = text
            clock.now = MONDAY + 3600 * hour + 1
            assert len(await tick(schedules)) == 1
            changes.append((await schedules.runs("1", made.id))[0].changed)
        assert changes == [True, False, True]
        judged = [r for r in fake_model.requests if "differ in substance" in str(r)]
        assert len(judged) == 2  # not for the first run
        assert all(r.get("max_tokens", 99) <= 3 + 1024 for r in judged)
        # webhooks for the first and the third run only, each signed
        delivered = await hooks.wait(2)
        await asyncio.sleep(0.2)
        assert len(hooks.received) == 2
        runs = await schedules.runs("1", made.id)
        verify = Webhook(made.webhook_secret)
        sent = [verify.verify(r.body, r.headers) for r in delivered]
        assert [p["runId"] for p in sent] == [runs[2].id, runs[0].id]
        assert [p["answer"] for p in sent] == ["Rates are 4%.", "Rates are 5%."]
        assert all(p["type"] == "schedule.run.completed" and p["changed"] for p in sent)
        assert sent[0]["chatId"] == made.chat_id and sent[0]["question"] == "what changed?"
        assert sent[0]["messageId"] == runs[2].message_id


async def test_failing_runs_pause_the_schedule_and_webhooks_say_so(
    sched_settings: Settings,
    fake_model: FakeModel,
    receiver: tuple[WebhookReceiver, ServerThread],
) -> None:
    hooks, hook_server = receiver
    clock = Clock(MONDAY)
    paused = sched_settings.replace(schedules={"pause_after_failures": 2})
    async with scheduler(paused, clock) as schedules:
        made = await schedules.create(
            "1",
            body(question="why? #fail=500", cron="0 * * * *", webhook={"url": hook_server.url}),
        )
        for hour in (1, 2):
            clock.now = MONDAY + 3600 * hour + 1
            assert len(await tick(schedules)) == 1
        clock.now = MONDAY + 3600 * 3 + 1
        assert await tick(schedules) == []  # paused
        schedule = await schedules.owned("1", made.id)
        assert schedule.enabled is False
        assert schedule.paused_reason and "2 failed runs" in schedule.paused_reason
        runs = await schedules.runs("1", made.id)
        assert [r.status for r in runs] == ["failed", "failed"]
        sent = [Webhook(made.webhook_secret).verify(r.body, r.headers) for r in await hooks.wait(2)]
        assert {p["type"] for p in sent} == {"schedule.run.failed"}
        # resumed: failures forgotten, the next run is the next due time from now
        resumed, _ = await schedules.update("1", made.id, {"enabled": True})
        assert resumed.enabled and resumed.paused_reason is None
        assert resumed.next_run_at == MONDAY + 3600 * 4


async def test_a_webhook_is_retried_after_a_500_with_the_same_id(
    sched_settings: Settings,
    fake_model: FakeModel,
    receiver: tuple[WebhookReceiver, ServerThread],
) -> None:
    hooks, hook_server = receiver
    hooks.statuses = [500]
    clock = Clock(MONDAY)
    async with scheduler(sched_settings, clock) as schedules:
        made = await schedules.create("1", body(cron="0 * * * *", webhook={"url": hook_server.url}))
        clock.now = MONDAY + 3601
        await tick(schedules)
        await hooks.wait(1)
        assert await tick(schedules) == []
        assert len(hooks.received) == 1  # not due again yet
        clock.now += 6  # past the first pause (5 s)
        await tick(schedules)
        first, second = await hooks.wait(2)
        assert (first.status, second.status) == (500, 200)
        assert first.headers["webhook-id"] == second.headers["webhook-id"]
        Webhook(made.webhook_secret).verify(second.body, second.headers)
        delivery = await schedules.store.get_delivery(second.headers["webhook-id"])
        assert delivery is not None and delivery.status == "delivered" and delivery.attempts == 2


async def test_webhooks_reach_no_private_address_at_connect_time_and_follow_no_redirect(
    settings: Settings, receiver: tuple[WebhookReceiver, ServerThread]
) -> None:
    hooks, hook_server = receiver
    async with open_service(settings, metrics=Metrics()) as chat:
        guarded = Webhooks(settings.schedules, chat.store, owner="t")
        try:
            secret = new_secret()
            for url in [hook_server.url + "/in", f"http://localhost:{hook_server.port}/in"]:
                delivery = Delivery("msg_1", url, secret, "{}", time.time(), time.time() + 60)
                ended = await guarded.send(delivery)
                assert ended.status == "failed" and ended.error is not None
                assert ended.error.startswith("refused"), ended.error
            assert hooks.received == []
        finally:
            await guarded.aclose()
        allowed = settings.schedules.__class__(webhook_allow_private_networks=True)
        loose = Webhooks(allowed, chat.store, owner="t")
        try:
            hooks.redirect_to = "http://169.254.169.254/latest/meta-data"
            delivery = Delivery(
                "msg_2", hook_server.url, secret, "{}", time.time(), time.time() + 60
            )
            ended = await loose.send(delivery)
            assert ended.status == "pending" and ended.error == "the receiver answered 307"
            assert len(hooks.received) == 1  # the redirect was not followed
        finally:
            await loose.aclose()


def test_signatures_are_standard_webhooks() -> None:
    secret = new_secret()
    stamp = int(time.time())
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(secret, "msg_1", stamp, '{"a":1}'),
    }
    assert Webhook(secret).verify('{"a":1}', headers) == {"a": 1}
    with pytest.raises(Exception, match="(?i)signature"):
        Webhook(new_secret()).verify('{"a":1}', headers)


# -- real processes on PostgreSQL and Redis ----------------------------------------------------


@pytest.fixture
def workers_env(hosts_env: dict[str, str]) -> dict[str, str]:
    """Two "hosts" (one PostgreSQL database, one Redis) whose schedulers tick twice a
    second and hold a run's lease for 3 seconds."""
    return {
        **hosts_env,
        "SCHEDULES_MIN_INTERVAL_SECONDS": "60",
        "SCHEDULES_TICK_SECONDS": "0.5",
        "SCHEDULES_LEASE_SECONDS": "3",
        "SCHEDULES_WEBHOOK_ALLOW_PRIVATE_NETWORKS": "true",
    }


async def test_a_run_whose_process_is_killed_is_retried_once_by_another(
    workers_env: dict[str, str], fake_model: FakeModel
) -> None:
    with processes(2, workers_env) as (a, b):
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=10, event_hooks=USER) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=10, event_hooks=USER) as on_b,
        ):
            # an answer of some 4 seconds, on a schedule that is not due for months
            question = "slow news? #tokens=40 #delay=0.1"
            response = await on_a.post("/api/schedules", json=body(question=question, cron=YEARLY))
            assert response.status_code == 201, response.text
            schedule_id = response.json()["schedule"]["id"]
            response = await on_a.post(f"/api/schedules/{schedule_id}/run", json={})
            assert response.status_code == 202

            async def runs() -> list[dict[str, Any]]:
                got = await on_b.get(f"/api/schedules/{schedule_id}/runs")
                return list(got.json()["runs"])

            async def answering() -> Any:
                found = await runs()
                return found if found and found[0]["messageId"] else None

            first = (await wait_for(answering, timeout=15))[0]
            a.kill()

            async def ended() -> Any:
                found = await runs()
                return found if found and found[0]["status"] != "running" else None

            (run,) = await wait_for(ended, timeout=40)
            assert run["id"] == first["id"]
            assert run["status"] == "completed", run
            assert run["retry"] is True and run["attempt"] == 2
            assert run["messageId"] != first["messageId"]
            chat_id = (await on_b.get(f"/api/schedules/{schedule_id}")).json()["schedule"]["chatId"]
            chat = (await on_b.get(f"/api/chats/{chat_id}")).json()
            answers = [m for m in chat["messages"] if m["role"] == "assistant"]
            assert answers[-1]["id"] == run["messageId"] and answers[-1]["status"] == "completed"


#: a cron with cronsim's seconds field, every 5 seconds: the API takes five fields (minutes at
#: best), so the test writes its schedules into the shared store itself
EVERY_5_SECONDS = "*/5 * * * * *"


async def test_a_cron_runs_once_per_due_time_on_two_workers_in_real_time(
    workers_env: dict[str, str], fake_model: FakeModel
) -> None:
    """A real cron on two processes, on the real clock, for two due times of each of three
    schedules: every due time runs once, on one of them. Due every 5 seconds, not every
    minute (the scheduler reads its due times with the same `cron.next_time`), so that
    it takes seconds, not minutes."""
    with processes(2, workers_env) as (a, b):
        async with open_store(workers_env["STORE_URL"]) as store:
            made = []
            for n in range(3):
                now = time.time()
                schedule = Schedule(
                    f"90{n}",
                    "1",
                    f"91{n}",
                    "what changed?",
                    EVERY_5_SECONDS,
                    "UTC",
                    cron.next_time(EVERY_5_SECONDS, "UTC", now),
                    now,
                    options={"focusMode": "deepSeek"},
                )
                chat = Chat(schedule.chat_id, "1", schedule.question, "deepSeek", now)
                assert await store.add_schedule(schedule, chat, 10)
                made.append(schedule)
        first_due = min(s.next_run_at for s in made)
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=10, event_hooks=USER) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=10, event_hooks=USER) as on_b,
        ):

            async def done() -> Any:
                every = []
                for n, schedule in enumerate(made):
                    http = (on_a, on_b)[n % 2]
                    got = await http.get(f"/api/schedules/{schedule.id}/runs")
                    found = got.json()["runs"]
                    if len([r for r in found if r["status"] == "completed"]) < 2:
                        return None
                    every.append(found)
                return every

            every = await wait_for(done, timeout=60)
            for runs in every:
                dues = [r["dueAt"] for r in runs]
                assert len(dues) == len(set(dues))  # no due time twice
                assert min(dues) >= iso(first_due)
                assert all(re.search(r":\d[05]\.000Z$", d) for d in dues), dues  # on time
                assert all(r["retry"] is False for r in runs)


# -- the store's contract, on both backends ----------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Any]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/store.db"
    else:
        url = request.getfixturevalue("postgres_url")
    async with open_store(url) as opened:
        yield opened


def a_schedule(schedule_id: str, user: str = "u1", next_run_at: float = MONDAY) -> Schedule:
    return Schedule(
        schedule_id, user, f"chat-{schedule_id}", "q", YEARLY, "UTC", next_run_at, MONDAY
    )


async def test_store_claims_a_due_time_once_and_takes_a_run_over_once(store: Any) -> None:
    schedule = a_schedule("s1")
    chat = Chat(schedule.chat_id, "u1", "q", "webSearch", MONDAY)
    assert await store.add_schedule(schedule, chat, 1)
    assert not await store.add_schedule(a_schedule("s2"), chat, 1)  # one per user here
    assert [s.id for s in await store.due_schedules(MONDAY)] == ["s1"]
    run = ScheduleRun("r1", "s1", MONDAY, started_at=MONDAY)
    assert await store.claim_run(schedule, MONDAY + 60, run, "p1", -1)  # a lease run out
    again = ScheduleRun("r2", "s1", MONDAY, started_at=MONDAY)
    assert not await store.claim_run(schedule, MONDAY + 60, again, "p2", 30)
    assert await store.due_schedules(MONDAY + 59) == []
    # the holder went before it started an answer: taking it over is no retry
    taken = await store.take_over_run("r1", "p2", -1)
    assert taken is not None and taken.attempt == 1
    assert await store.set_run_message("r1", "p2", "answer-1")
    taken = await store.take_over_run("r1", "p3", 30)
    assert taken is not None and taken.attempt == 2 and taken.message_id is None
    assert await store.take_over_run("r1", "p4", 30) is None  # held
    assert not await store.renew_run("r1", "p2", 30)  # p2 lost it
    ended = replace(taken, status="completed", ended_at=MONDAY + 5, message_id="answer-2")
    assert not await store.end_run(ended, "p2", 5)
    assert await store.end_run(ended, "p3", 5)
    (listed,) = await store.list_runs("s1")
    assert (listed.status, listed.attempt, listed.message_id) == ("completed", 2, "answer-2")
    assert (await store.get_schedule("s1")).last_run_at == MONDAY + 5
    # the user goes: their schedules, runs and chats go too
    assert await store.delete_user_schedules("u1") == 1
    assert await store.get_schedule("s1") is None and await store.get_run("r1") is None
    assert await store.get_chat(schedule.chat_id) is None


async def test_a_run_is_answered_by_the_schedules_chosen_model(
    sched_settings: Settings, fake_model: FakeModel
) -> None:
    """`chatModel` of a schedule picks the provider and model of every run, as a chat's does."""
    from tests.servers import serve

    second = FakeModel(api_key="second-key", models=["other-chat", "other-small"])
    with serve(second.app()) as other:
        chosen = sched_settings.replace(
            providers={
                "second": {
                    "base_url": other.url + "/v1",
                    "api_key": "second-key",
                    "small_model": "other-small",
                }
            }
        )
        clock = Clock(MONDAY)
        async with scheduler(chosen, clock) as schedules:
            made = await schedules.create(
                "1",
                body(cron="* * * * *", chatModel={"provider": "second", "model": "other-chat"}),
            )
            clock.now = MONDAY + 65
            assert len(await tick(schedules)) == 1
            (run,) = await schedules.runs("1", made.id)
            assert run.status == "completed"
    assert [r["model"] for r in second.streamed_requests()] == ["other-chat"]
    assert fake_model.streamed_requests() == []
