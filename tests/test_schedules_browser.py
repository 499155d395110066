"""The web client's schedules: "Run this every…" under a question, the Schedules dialog,
and the dot on a chat whose schedule ran since it was last opened."""

from __future__ import annotations

from tests.test_browser import ask, browser, open_page, page, wait_state  # noqa: F401


def test_a_question_becomes_a_schedule_and_its_run_marks_the_chat(page, fake_model):  # noqa: F811
    ask(page, "what is new in rust?", focus="deepSeek")
    wait_state(page, "completed")
    page.click(".turn .actions .schedule-it")
    page.wait_for_selector("#schedules[open] #schedule-new:not([hidden])")
    page.select_option("#schedule-preset", "weekdays")
    page.fill("#schedule-time", "07:30")
    page.click("#schedule-new button.primary")
    row = page.wait_for_selector("#schedule-list li.schedule")
    assert "what is new in rust?" in row.inner_text()
    assert "30 7 * * 1-5" in row.inner_text()
    # run it now, then look at it from another chat: its chat gets the dot
    row.query_selector("button:has-text('Run now')").click()
    page.click("#schedules menu button.primary")
    page.click("#new-chat")
    page.wait_for_function(
        "() => fetch('/api/schedules').then(r => r.json())"
        ".then(b => b.schedules[0] && b.schedules[0].lastRunAt !== null)",
        timeout=15_000,
    )
    page.reload()
    page.wait_for_selector("#chats li.unread", timeout=10_000)
    page.click("#chats li.unread button.open")
    page.wait_for_selector("#chats li.unread", state="detached", timeout=10_000)
