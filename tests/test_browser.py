"""The web client at /, driven in headless Chromium against the real server and fakes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from app.main import create_app
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import serve

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
ANSWER = (
    "## Methane engines\n\n"
    "SpaceX's Raptor burns liquid methane with liquid oxygen in a full-flow staged cycle [4]. "
    "Methane leaves less soot than kerosene, which makes engines easier to reuse [4][1].\n\n"
    "- **Fuel:** liquid methane (CH₄)\n- **Oxidiser:** liquid oxygen\n- **Cycle:** full-flow staged combustion\n"
)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed: run `bash scripts/test.sh`, which installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield chromium
        chromium.close()


@pytest.fixture
def site(settings):
    with serve(create_app(settings)) as server:
        yield server


@pytest.fixture
def page(browser, site):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(site.url + "/")
    yield page
    context.close()
    assert errors == []


def ask(page, question, transport="sse", focus="webSearch"):
    page.select_option("#transport", transport)
    page.select_option("#focus", focus)
    page.fill("#question", question)
    page.click("#send")


def wait_state(page, state, timeout=15_000):
    page.wait_for_selector(f".turn[data-state={state}]", state="attached", timeout=timeout)


@pytest.mark.parametrize("transport", ["sse", "ws"])
def test_ask_and_see_the_streamed_answer_with_sources(page, fake_model, fake_search, transport):
    fake_model.answer_text = ANSWER
    fake_model.replies.insert(0, ("Write a title", "Methane rocket engines"))
    ask(page, RELEVANT_QUESTION, transport)
    wait_state(page, "completed")
    answer = page.locator(".turn .answer")
    assert answer.locator("h2").inner_text() == "Methane engines"
    assert answer.locator("li").count() == 3
    cite = answer.locator("a.cite").first
    assert cite.inner_text() == "[4]"
    assert cite.get_attribute("href").endswith("/pages/3")  # source 4 is result 3
    cards = page.locator(".turn .source")
    assert cards.count() == 9  # 8 sources and "All sources"
    assert "falcon engines burn methane" in cards.nth(3).inner_text()
    assert page.locator(".turn .reasoning-text").text_content() == "why0 why1 "  # folded away
    page.wait_for_selector("#chats li .title:text('Methane rocket engines')", timeout=5000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"client-{transport}.png"))


def test_stop_keeps_the_partial_answer_and_closes_the_model_stream(page, fake_model):
    ask(page, "tell me a long story #tokens=500 #delay=0.02", focus="deepSeek")
    page.wait_for_function(
        "() => document.querySelector('.turn .answer').innerText.includes('tok5')"
    )
    page.click("#stop")
    wait_state(page, "cancelled")
    assert page.locator(".turn .status").inner_text() == "stopped"
    partial = page.locator(".turn .answer").inner_text()
    assert partial.startswith("tok0 tok1") and "tok499" not in partial
    record = fake_model.streams[-1]
    deadline = time.monotonic() + 5
    while record.outcome == "open" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert record.outcome == "client_closed"
    assert page.locator("#send").is_enabled()


def test_reload_mid_answer_resumes_without_a_second_model_call(page, fake_model):
    ask(page, "count slowly #tokens=150 #delay=0.02", focus="deepSeek")
    page.wait_for_function(
        "() => document.querySelector('.turn .answer').innerText.includes('tok10')"
    )
    page.reload()
    wait_state(page, "completed")
    expected = " ".join(f"tok{i}" for i in range(150))
    assert page.locator(".turn").count() == 1
    assert page.locator(".turn .question").inner_text() == "count slowly #tokens=150 #delay=0.02"
    assert page.locator(".turn .answer").inner_text().strip() == expected
    assert len(fake_model.streamed_requests()) == 1


def test_reopen_a_chat_from_the_sidebar_and_delete_it(page, fake_model):
    fake_model.replies.insert(0, ("Write a title", "First chat"))
    ask(page, "first question #tokens=3", focus="deepSeek")
    wait_state(page, "completed")
    page.fill("#question", "follow-up #tokens=2")
    page.click("#send")
    page.wait_for_function(
        "() => document.querySelectorAll('.turn[data-state=completed]').length === 2"
    )
    page.click("#new-chat")
    assert page.locator(".turn").count() == 0
    page.click("#chats li .open:has-text('First chat')")
    page.wait_for_function("() => document.querySelectorAll('.turn').length === 2")
    assert page.locator(".turn .question").all_inner_texts() == [
        "first question #tokens=3",
        "follow-up #tokens=2",
    ]
    assert page.locator(".turn .answer").nth(1).inner_text().strip() == "tok0 tok1"
    page.hover("#chats li")
    page.click("#chats li .delete")
    page.wait_for_function("() => document.querySelectorAll('#chats li').length === 0")
    assert page.locator(".turn").count() == 0
