"""The web client at /, driven in headless Chromium against the real server and fakes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from app.config import McpServerSettings
from app.main import create_app
from tests.fakes.mcp_server import FakeMcp
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import AppProcess, chromium, serve

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True}
ANSWER = (
    "## Methane engines\n\n"
    "SpaceX's Raptor burns liquid methane with liquid oxygen in a full-flow staged cycle [4]. "
    "Methane leaves less soot than kerosene, which makes engines easier to reuse [4][1].\n\n"
    "- **Fuel:** liquid methane (CH₄)\n- **Oxidiser:** liquid oxygen\n- **Cycle:** full-flow staged combustion\n"
)


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


@pytest.fixture
def open_page(browser, settings):
    """open_page(url=None, changes=None, **context options): a page on the client; without
    `url`, on a fresh server made from `settings` with `changes`. No page may throw."""
    errors: list[str] = []
    with contextlib.ExitStack() as stack:

        def open_(url=None, changes=None, goto=True, **options):
            if url is None:
                app = create_app(settings.replace(**(changes or {})))
                url = stack.enter_context(serve(app)).url
            context = browser.new_context(**{"viewport": DESKTOP, **options})
            stack.callback(context.close)
            page = context.new_page()
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.base = url
            if goto:
                page.goto(url + "/")
            return page

        yield open_
    assert errors == []


@pytest.fixture
def page(open_page):
    return open_page()


def ask(page, question, focus="webSearch"):
    page.select_option("#focus", focus)
    page.fill("#question", question)
    page.click("#send")


def use_settings(page, **values):
    """Settings as the settings panel keeps them, then a reload."""
    page.evaluate("s => localStorage.setItem('settings', JSON.stringify(s))", values)
    page.reload()


def wait_state(page, state, timeout=15_000, nth=0):
    page.wait_for_selector(
        f".turn[data-state={state}] >> nth={nth}", state="attached", timeout=timeout
    )


def skip_pauses_until(page, state, timeout=20):
    """Moves the page's installed clock on until a turn reaches `state`: the client's
    timers (its growing pauses between reconnections) fire at once, in order."""
    deadline = time.monotonic() + timeout
    while not page.locator(f".turn[data-state={state}]").count():
        assert time.monotonic() < deadline, f"no turn reached {state!r}"
        page.clock.fast_forward(10_000)
        page.wait_for_timeout(50)


def wait_text(page, text, selector=".turn .answer", timeout=10_000):
    page.wait_for_function(
        "([s, t]) => [...document.querySelectorAll(s)].some(e => e.innerText.includes(t))",
        arg=[selector, text],
        timeout=timeout,
    )


def last(page, selector):
    return page.locator(selector).last


# ---- asking, streaming, sources ------------------------------------------------------------


@pytest.mark.parametrize("transport", ["sse", "ws"])
def test_ask_and_see_the_streamed_answer_with_sources(page, fake_model, fake_search, transport):
    use_settings(page, transport=transport)
    fake_model.answer_text = ANSWER
    fake_model.replies.insert(0, ("Write a title", "Methane rocket engines"))
    ask(page, RELEVANT_QUESTION)
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
    assert "searching the web" in page.locator(".turn .steps").text_content()  # steps stay
    page.wait_for_selector("#chats li .title:text('Methane rocket engines')", timeout=5000)


def test_stop_keeps_the_partial_answer_and_closes_the_model_stream(page, fake_model):
    ask(page, "tell me a long story #tokens=500 #delay=0.02", focus="deepSeek")
    wait_text(page, "tok5")
    page.click("#stop")
    wait_state(page, "cancelled")
    assert page.locator(".turn .status").inner_text() == "Stopped"
    partial = page.locator(".turn .answer").inner_text()
    assert partial.startswith("tok0 tok1") and "tok499" not in partial
    record = fake_model.streams[-1]
    deadline = time.monotonic() + 5
    while record.outcome == "open" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert record.outcome == "client_closed"
    assert page.locator("#send").is_enabled()


def test_stop_ends_the_stream_here_when_the_cancel_finds_nothing(page, fake_model):
    """A cancel that reaches a worker without the generation (404): the page stops reading."""
    page.route(
        "**/api/chat/cancel",
        lambda route: route.fulfill(
            status=404,
            content_type="application/json",
            body=json.dumps({"type": "error", "key": "NOT_FOUND", "data": "nothing runs"}),
        ),
    )
    ask(page, "a long story #tokens=300 #delay=0.02", focus="deepSeek")
    wait_text(page, "tok5")
    page.click("#stop")
    wait_state(page, "cancelled", timeout=2000)
    frozen = page.locator(".turn .answer").inner_text()
    page.wait_for_timeout(400)
    assert page.locator(".turn .answer").inner_text() == frozen  # nothing more arrives
    assert page.locator("#send").is_visible() and page.locator("#stop").is_hidden()


def test_reload_mid_answer_resumes_without_a_second_model_call(page, fake_model):
    ask(page, "count slowly #tokens=150 #delay=0.02", focus="deepSeek")
    wait_text(page, "tok10")
    page.reload()
    wait_state(page, "completed")
    expected = " ".join(f"tok{i}" for i in range(150))
    assert page.locator(".turn").count() == 1
    assert page.locator(".turn .question").inner_text() == "count slowly #tokens=150 #delay=0.02"
    assert page.locator(".turn .answer").inner_text().strip() == expected
    assert len(fake_model.streamed_requests()) == 1


def test_reopen_a_chat_restores_its_focus_mode_and_delete_asks_first(page, fake_model):
    fake_model.replies.insert(0, ("Write a title", "First chat"))
    ask(page, "first question #tokens=3", focus="mathAssistant")
    wait_state(page, "completed")
    page.fill("#question", "follow-up #tokens=2")
    page.click("#send")
    wait_state(page, "completed", nth=1)
    page.click("#new-chat")
    assert page.locator(".turn").count() == 0
    assert page.input_value("#focus") == "webSearch"  # a new chat starts with the defaults
    page.click("#chats li .open:has-text('First chat')")
    page.wait_for_function("() => document.querySelectorAll('.turn').length === 2")
    assert page.input_value("#focus") == "mathAssistant"
    assert page.locator(".turn .question").all_inner_texts() == [
        "first question #tokens=3",
        "follow-up #tokens=2",
    ]
    assert page.locator(".turn .answer").nth(1).inner_text().strip() == "tok0 tok1"
    page.hover("#chats li")
    page.click("#chats li .delete")
    assert "Delete “First chat”?" in page.locator("#confirm").inner_text()
    page.click("#confirm-cancel")
    assert page.locator("#chats li").count() == 1
    page.click("#chats li .delete")
    page.click("#confirm-ok")
    page.wait_for_function("() => document.querySelectorAll('#chats li').length === 0")
    assert page.locator(".turn").count() == 0


# ---- auth ------------------------------------------------------------------------------------


def test_auth_on_works_end_to_end_and_the_page_names_no_user(open_page, fake_model):
    page = open_page(changes={"auth": {"api_keys": {"the-right-key": "42"}}}, goto=False)
    sent: list[str] = []
    page.on("request", lambda r: sent.append(f"{r.url} {r.post_data or ''}"))
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    page.goto(page.base + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "a-wrong-key")
    page.press("#key-input", "Enter")
    page.wait_for_function(
        "() => document.querySelector('#key-reason').innerText.includes('not accepted')"
    )
    page.fill("#key-input", "the-right-key")
    page.click("#key-dialog .primary")
    fake_model.replies.insert(0, ("Write a title", "Keyed chat"))
    ask(page, "hello with a key #tokens=3", focus="deepSeek")
    wait_state(page, "completed")
    use_settings(page, transport="ws")  # the key is kept: no dialog after the reload
    page.wait_for_selector("#chats li .title:text('Keyed chat')")
    page.click("#chats li .open")
    wait_state(page, "completed")
    page.fill("#question", "and over a socket #tokens=2")
    page.press("#question", "Enter")
    wait_state(page, "completed", nth=1)
    assert page.locator("#key-dialog").is_hidden()
    assert sockets and all("token=the-right-key" in url for url in sockets)
    assert not [line for line in sent if "userId" in line]


# ---- the server goes away ----------------------------------------------------------------------


def app_env(tmp_path, model_url, **extra):
    return {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-chat",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
        **extra,
    }


@pytest.fixture
def app_process():
    started: list[AppProcess] = []

    def start(env):
        started.append(AppProcess(env).start())
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


def test_server_killed_mid_answer_is_resumed_then_said_plainly(
    open_page, app_process, fake_model, tmp_path, model_url, redis_url
):
    env = app_env(
        tmp_path,
        model_url,
        REDIS_URL=redis_url,
        STREAM_HANDLE_TTL_SECONDS="1.5",
        STREAM_FLUSH_INTERVAL_MS="10",
    )
    server = app_process(env)
    page = open_page(server.url)
    resumed: list[tuple[int, str | None]] = []  # (status, Last-Event-ID) of resumes answered
    page.on(
        "response",
        lambda r: (
            resumed.append((r.status, r.request.headers.get("last-event-id")))
            if "/resume" in r.url
            else None
        ),
    )
    ask(page, "tell me slowly #tokens=120 #delay=0.02", focus="deepSeek")
    wait_text(page, "tok10")
    server.kill()
    page.wait_for_selector(".turn .status.reconnecting")
    assert page.locator(".turn .status").inner_text().startswith("Lost the connection")
    server.start()
    wait_state(page, "failed", timeout=20_000)
    assert (
        "The server stopped while writing this answer" in page.locator(".turn .status").inner_text()
    )
    assert "tok10" in page.locator(".turn .answer").inner_text()  # the partial answer stays
    # the restarted server replayed from the last event seen, then said the answer was lost
    assert [status for status, last in resumed if last and ":" in last] == [200]
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_hidden()
    page.click(".turn .retry")  # asks again
    wait_state(page, "completed", timeout=20_000)
    assert "tok119" in page.locator(".turn .answer").inner_text()


def test_server_gone_for_good_over_websocket_frees_the_controls(
    open_page, app_process, fake_model, tmp_path, model_url
):
    server = app_process(app_env(tmp_path, model_url))
    page = open_page(server.url)
    page.clock.install()  # the page's own clock, so its reconnection pauses can be skipped
    use_settings(page, transport="ws")
    ask(page, "tell me slowly #tokens=300 #delay=0.02", focus="deepSeek")
    wait_text(page, "tok10")
    server.kill()
    page.wait_for_selector(".turn .status.reconnecting")
    skip_pauses_until(page, "failed")  # every attempt still runs and fails; only the waits go
    assert page.locator(".turn .status").inner_text().startswith("Can't reach the server")
    assert "tok10" in page.locator(".turn .answer").inner_text()
    assert page.locator("#send").is_enabled()
    page.click("#new-chat")
    assert page.locator(".turn").count() == 0
    ask(page, "anyone there? #tokens=2", focus="deepSeek")  # over a socket that cannot open
    wait_state(page, "failed", timeout=10_000)
    assert page.locator(".turn .status").inner_text().startswith("Can't reach the server")
    server.start()
    page.click(".turn .retry")
    wait_state(page, "completed", timeout=15_000)
    assert page.locator(".turn .answer").inner_text().strip() == "tok0 tok1"


# ---- phone ----------------------------------------------------------------------------------------


def test_phone_layout_with_a_chat_drawer_and_compact_controls(open_page, fake_model):
    page = open_page(**PHONE)
    sidebar = page.locator("#sidebar")
    assert sidebar.bounding_box()["x"] + sidebar.bounding_box()["width"] <= 0  # tucked away
    question, send = page.locator("#question").bounding_box(), page.locator("#send").bounding_box()
    assert (
        send["y"] < question["y"] + question["height"]
        and send["y"] + send["height"] > question["y"]
    )
    assert page.locator("#ask").bounding_box()["height"] < 844 / 6
    fake_model.replies.insert(0, ("Write a title", "Phone chat"))
    page.select_option("#focus", "deepSeek")
    page.fill("#question", "from a phone #tokens=3")
    page.tap("#send")
    wait_state(page, "completed")
    page.tap("#new-chat-top")
    assert page.locator(".turn").count() == 0
    page.tap("#open-drawer")
    page.wait_for_function(
        "() => document.querySelector('#sidebar').getBoundingClientRect().x >= 0"
    )
    page.wait_for_selector("#chats li .title:text('Phone chat')")
    page.tap("#chats li .open")
    wait_state(page, "completed")
    page.wait_for_function(
        "() => document.querySelector('#sidebar').getBoundingClientRect().right <= 0"
    )
    assert page.locator("#topbar-title").inner_text() == "Phone chat"
    page.tap("#open-drawer")
    page.wait_for_function(
        "() => document.querySelector('#sidebar').getBoundingClientRect().x >= 0"
    )
    page.wait_for_function(  # shown without hovering
        "() => getComputedStyle(document.querySelector('#chats li .delete')).opacity === '1'"
    )
    page.tap("#chats li .delete")
    page.tap("#confirm-ok")
    page.wait_for_function("() => document.querySelectorAll('#chats li').length === 0")


# ---- per answer ------------------------------------------------------------------------------------


def test_copy_regenerate_and_edit_an_answer(open_page, fake_model):
    page = open_page(permissions=["clipboard-read", "clipboard-write"])
    ask(page, "first #tokens=3", focus="deepSeek")
    wait_state(page, "completed")
    page.click(".turn .actions .copy")
    assert page.evaluate("navigator.clipboard.readText()") == "tok0 tok1 tok2 "
    assert page.locator(".turn .actions .copy").inner_text() == "Copied"
    page.click(".turn .actions .regenerate")
    wait_state(page, "completed")
    assert len(fake_model.streamed_requests()) == 2
    assert page.locator(".turn").count() == 1
    page.click(".turn .actions .edit")
    page.fill(".turn .editor textarea", "second #tokens=2")
    page.press(".turn .editor textarea", "Enter")
    page.wait_for_function(
        "() => document.querySelector('.turn .question').innerText.startsWith('second')"
    )
    wait_state(page, "completed")
    assert page.locator(".turn .answer").inner_text().strip() == "tok0 tok1"
    page.reload()  # the server replaced the question and its answer
    wait_state(page, "completed")
    assert page.locator(".turn .question").all_inner_texts() == ["second #tokens=2"]


def test_related_questions_under_each_answer(page, fake_model):
    ask(page, "what is it #tokens=2", focus="deepSeek")
    wait_state(page, "completed")
    related = page.locator(".turn .related li")
    related.first.wait_for()
    assert related.all_inner_texts() == [
        "What is next?",
        "Why does it matter?",
        "Who made it?",
        "When did it start?",
    ]
    related.first.locator("button").click()
    wait_state(page, "completed", nth=1)
    assert last(page, ".turn .question").inner_text() == "What is next?"
    page.wait_for_selector(".turn:last-child .related li")
    assert page.locator(".turn:first-child .related").is_visible()  # each answer keeps its own


def test_images_and_videos_for_an_answer(open_page, fake_model, fake_search):
    page = open_page(changes={"search": {"provider": "searxng"}})
    ask(page, RELEVANT_QUESTION)
    wait_state(page, "completed")
    page.click(".turn .actions .images")
    page.wait_for_selector(".media .images .thumb img")
    assert page.locator(".media .images .thumb").count() == 6
    assert "/images/0.png" in page.locator(".media .images img").first.get_attribute("src")
    page.click(".turn .actions .videos")
    page.wait_for_selector(".media .videos .thumb.video")
    assert page.locator(".media .videos .thumb").count() == 3


# ---- look and feel ----------------------------------------------------------------------------------


def luminance(page, selector, prop):
    rgb = page.eval_on_selector(selector, f"e => getComputedStyle(e).{prop}")
    r, g, b = (int(v) for v in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_dark_mode_follows_the_system(open_page, fake_model):
    light = open_page()
    assert luminance(light, "body", "backgroundColor") > 0.8
    dark = open_page(color_scheme="dark")
    assert luminance(dark, "body", "backgroundColor") < 0.15
    ask(dark, "in the dark #tokens=2", focus="deepSeek")
    wait_state(dark, "completed")
    assert luminance(dark, ".turn .answer", "color") > 0.8
    assert luminance(dark, ".composer", "backgroundColor") < 0.2


def test_keyboard_enter_shift_enter_escape_focus_and_delete(page, fake_model):
    page.focus("#question")
    page.keyboard.type("count")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("#tokens=400 #delay=0.02")
    assert page.input_value("#question") == "count\n#tokens=400 #delay=0.02"
    page.select_option("#focus", "deepSeek")
    page.focus("#question")
    page.keyboard.press("Enter")
    wait_text(page, "tok5")
    page.keyboard.press("Escape")
    wait_state(page, "cancelled")
    assert page.locator(".turn .question").inner_text() == "count\n#tokens=400 #delay=0.02"
    page.wait_for_selector("#chats li")
    page.focus("#new-chat")
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    focused = page.evaluate(
        "() => [document.activeElement.className, getComputedStyle(document.activeElement).outlineStyle]"
    )
    assert focused == ["delete", "solid"]  # reachable, and the focus shows
    page.keyboard.press("Enter")
    page.wait_for_selector("#confirm[open]")
    page.keyboard.press("Escape")  # changed my mind
    assert page.locator("#chats li").count() == 1
    page.focus("#chats li .delete")
    page.keyboard.press("Enter")
    page.wait_for_selector("#confirm[open]")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.querySelectorAll('#chats li').length === 0")


def test_auto_scroll_stops_following_when_the_reader_scrolls_up(open_page, fake_model):
    page = open_page(viewport={"width": 1000, "height": 600})
    ask(page, "a long answer #tokens=500 #delay=0.01 #size=40", focus="deepSeek")
    pane = "#conversation"
    page.wait_for_function(f"() => document.querySelector('{pane}').scrollHeight > 1500")
    near_end = f"() => {{ const p = document.querySelector('{pane}'); return p.scrollHeight - p.scrollTop - p.clientHeight < 40; }}"
    page.wait_for_function(near_end, polling="raf", timeout=2000)  # following the end
    page.mouse.move(500, 300)
    page.mouse.wheel(0, -500)
    page.wait_for_timeout(200)
    top = page.eval_on_selector(pane, "p => p.scrollTop")
    height = page.eval_on_selector(pane, "p => p.scrollHeight")
    page.wait_for_timeout(600)
    assert page.eval_on_selector(pane, "p => p.scrollHeight") > height  # it still grows…
    assert abs(page.eval_on_selector(pane, "p => p.scrollTop") - top) <= 1  # …where I read
    page.click("#jump")
    page.wait_for_timeout(300)
    page.wait_for_function(near_end, polling="raf", timeout=2000)
    assert page.locator("#jump").is_hidden()
    page.keyboard.press("Escape")
    wait_state(page, "cancelled")


def test_settings_are_kept_across_reloads(page, fake_model):
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    page.click("#open-settings")
    page.select_option("#set-transport", "ws")
    page.select_option("#set-focus", "deepSeek")
    page.select_option("#set-mode", "balanced")
    page.select_option("#set-theme", "dark")
    page.check("#set-media")
    page.click("#settings .primary")
    page.reload()
    assert page.input_value("#focus") == "deepSeek"
    assert page.input_value("#mode") == "balanced"
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    page.click("#open-settings")
    assert page.input_value("#set-transport") == "ws"
    page.keyboard.press("Escape")
    page.fill("#question", "over the socket #tokens=2")
    page.click("#send")
    wait_state(page, "completed")
    assert [url for url in sockets if "/api/chat/ws" in url]
    page.wait_for_selector(".media .images .thumb")  # searched by themselves, as set
    page.wait_for_selector(".media .videos.none")  # Tavily has no videos
    assert page.locator(".media .videos").inner_text() == "No videos found for this question."


def test_the_search_filters_in_the_settings_reach_the_search(page, fake_model, fake_search):
    fake_search.extra[:] = [{"title": "Pins", "url": "https://pinterest.com/p", "snippet": "p"}]
    page.click("#open-settings")
    page.fill("#set-domains", "-pinterest.com, arxiv.org")
    page.select_option("#set-recency", "week")
    page.click("#settings .primary")
    page.reload()
    page.click("#open-settings")
    assert page.input_value("#set-domains") == "-pinterest.com, arxiv.org"
    assert page.input_value("#set-recency") == "week"
    page.keyboard.press("Escape")
    ask(page, RELEVANT_QUESTION)
    wait_state(page, "completed")
    (_, asked), *_ = fake_search.requests
    assert asked["exclude_domains"] == ["pinterest.com"] and asked["time_range"] == "week"
    assert asked["include_domains"] == ["arxiv.org"]


# ---- errors and what the answer went through ------------------------------------------------------------


def test_an_error_in_plain_words_with_retry(page, fake_model):
    ask(page, "explain it #flaky=500", focus="deepSeek")
    wait_state(page, "failed")
    status = page.locator(".turn .status")
    assert status.inner_text().startswith("The AI model returned an error")
    assert "Error(" not in status.inner_text()
    page.click(".turn .retry")
    wait_state(page, "completed")
    assert page.locator(".turn").count() == 1
    assert "tok4" in page.locator(".turn .answer").inner_text()


def test_a_reopened_failed_answer_still_says_why(page, fake_model):
    ask(page, "explain it #fail=500", focus="deepSeek")
    wait_state(page, "failed")
    said = page.locator(".turn .status").inner_text()
    assert said.startswith("The AI model returned an error")
    page.reload()  # reopened from the store: the saved error, in the same words
    wait_state(page, "failed")
    assert page.locator(".turn .status").inner_text() == said
    assert page.locator(".turn .retry").is_visible()


def test_deep_research_steps_stay_after_the_answer(page, fake_model, fake_search):
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "methane engines"}), ("web_search", {"query": "raptor"})],
        [("done", {})],
    ]
    ask(page, "compare methane rocket engines", focus="deepResearch")
    wait_state(page, "completed", timeout=20_000)
    steps = page.locator(".turn .steps")
    assert steps.is_visible()
    assert "steps" in steps.locator("summary").inner_text()
    steps.locator("summary").click()
    texts = steps.locator("li").all_inner_texts()
    assert "round 1 of 25" in texts
    assert "searching the web: raptor" in texts
    page.reload()  # the chat reopens from the store (#chat=…), its steps with it
    reopened = page.locator(".turn .steps")
    reopened.wait_for()
    reopened.locator("summary").click()
    assert reopened.locator("li").all_inner_texts() == texts


def test_half_written_markdown_is_hidden_while_streaming_and_sentences_end_once(page):
    got = page.evaluate(
        """async () => {
            const turn = await import("/static/turn.js");
            const net = await import("/static/net.js");
            return [
                turn.streamed("Hello **Demo"),
                turn.streamed("Hello **Demo** and `co"),
                turn.streamed("2 * 3 is *six"),
                turn.streamed("```py\\nx = 2 **"),
                net.sentence("its address does not resolve — is this server offline?"),
                net.sentence("no key"),
            ];
        }"""
    )
    assert got == [
        "Hello Demo",
        "Hello **Demo** and co",
        "2 * 3 is six",
        "```py\nx = 2 **",
        "its address does not resolve — is this server offline?",
        "no key.",
    ]


def test_web_search_not_configured_says_so_and_how_to_fix_it(open_page, fake_model, fake_search):
    page = open_page(changes={"search": {"provider": "tavily"}, "tavily": {"api_key": ""}})
    before = page.locator("#search-off")  # said before the first question, too
    before.wait_for()
    assert "TAVILY_API_KEY" in before.inner_text()
    ask(page, RELEVANT_QUESTION)
    wait_state(page, "completed")
    notice = page.locator(".turn .notice")
    assert notice.is_visible()
    assert "Web search is not set up" in notice.inner_text()
    assert "TAVILY_API_KEY" in notice.inner_text()


def test_no_model_key_is_said_on_the_start_page(open_page, fake_model, fake_search):
    page = open_page(changes={"llm": {"api_key": ""}})
    said = page.locator("#model-off")  # before any question is asked
    said.wait_for()
    assert "llm.api_key" in said.inner_text() or "LLM_API_KEY" in said.inner_text()


def test_attach_a_file_and_ask_about_it(page, fake_model):
    page.set_input_files(
        "#file-input",
        files=[{"name": "virus.exe", "mimeType": "application/octet-stream", "buffer": b"MZ"}],
    )
    failed = page.locator("#attachments .chip[data-status=failed]")
    failed.wait_for()
    assert "couldn't attach" in failed.inner_text() and "virus.exe" in failed.inner_text()
    failed.locator(".remove").click()
    page.set_input_files(
        "#file-input",
        files=[
            {
                "name": "notes.txt",
                "mimeType": "text/plain",
                "buffer": b"Mission notes. The launch code word is PELICAN-42. Countdown at dawn.",
            }
        ],
    )
    page.wait_for_selector("#attachments .chip[data-status=ready]")
    page.uncheck("#copilot")
    ask(page, "what is the launch code word?")
    wait_state(page, "completed")
    assert "PELICAN-42" in fake_model.last_system_prompt()
    assert "notes.txt" in page.locator(".turn .sources").inner_text()
    assert "notes.txt" in page.locator(".turn .files").inner_text()
    assert page.locator("#attachments .chip").count() == 0


# ---- screenshots ----------------------------------------------------------------------------------------------

REAL_RESULTS = [
    ("SpaceX Raptor - Wikipedia", "https://en.wikipedia.org/wiki/SpaceX_Raptor"),
    ("Why methane? The case for methalox engines", "https://arstechnica.com/science/methalox"),
    ("BE-4 engine | Blue Origin", "https://www.blueorigin.com/engines/be-4"),
    (
        "Raptor: the full-flow staged combustion cycle",
        "https://everydayastronaut.com/raptor-engine",
    ),
    ("Methane as a rocket fuel: soot, coking and reuse", "https://www.nasa.gov/methane-propulsion"),
    ("Raptor 3 unveiled", "https://spacenews.com/raptor-3-unveiled"),
    ("Liquid methane and liquid oxygen", "https://www.esa.int/methalox"),
    ("Rocket engine cycles compared", "https://www.planetary.org/engine-cycles"),
]
SHOT_ANSWER = (
    'Methane rocket engines burn **liquid methane** with **liquid oxygen** ("methalox") [1][2].\n\n'
    "## How they work\n\n"
    "SpaceX's Raptor runs a *full-flow staged combustion* cycle: every drop of both propellants "
    "passes through a preburner before the main chamber, which keeps turbines cool and pressures "
    "high [4]. Blue Origin's BE-4 uses an oxygen-rich staged cycle instead [3].\n\n"
    "## Why methane\n\n"
    "- **Clean burning:** far less soot and coking than kerosene, so engines are easier to reuse [5].\n"
    "- **Denser than hydrogen:** smaller tanks, and it stays liquid at similar temperatures to oxygen [7].\n"
    "- **Made on Mars:** methane can be produced from CO₂ and water ice [2].\n"
)


def test_screenshots_light_and_dark_desktop_and_phone(open_page, fake_model, fake_search):
    """Screenshots of a finished answer with sources, into test-artifacts/ (and docs/ when
    UPDATE_SCREENSHOTS=1)."""
    fake_search.extra.extend(
        {"title": t, "url": u, "snippet": f"About {t.lower()}."} for t, u in REAL_RESULTS
    )
    fake_model.replies[:0] = [
        (
            "Follow-up questions",
            "How does Raptor compare with BE-4?\nWhy is methane easier to reuse than kerosene?\nCould methane be made on Mars?",
        ),
        (
            "Write a title",
            lambda prompt: (
                "Methane rocket engines" if "methane" in prompt else "Sourdough starter schedule"
            ),
        ),
    ]
    first = open_page(goto=False)
    first.add_init_script("localStorage.setItem('userId', '7')")
    first.goto(first.base + "/")
    ask(first, "a sourdough starter schedule #tokens=3", focus="deepSeek")
    wait_state(first, "completed")
    first.click("#new-chat")
    fake_model.answer_text = SHOT_ANSWER
    ask(first, "How do methane rocket engines work?")
    wait_state(first, "completed")
    first.wait_for_selector(".turn .related li")
    first.wait_for_selector("#chats li .title:text('Methane rocket engines')")
    chat = first.evaluate("location.hash")
    ARTIFACTS.mkdir(exist_ok=True)
    for name, options in [
        ("desktop-light", {}),
        ("desktop-dark", {"color_scheme": "dark"}),
        ("phone-light", PHONE),
        ("phone-dark", {**PHONE, "color_scheme": "dark"}),
    ]:
        shot = open_page(first.base, goto=False, **options)
        shot.add_init_script("localStorage.setItem('userId', '7')")
        shot.goto(f"{first.base}/{chat}")
        wait_state(shot, "completed")
        shot.wait_for_selector(".turn .source")
        shot.evaluate("document.querySelector('.turn .reasoning').open = false")
        path = ARTIFACTS / f"client-{name}.png"
        shot.screenshot(path=str(path))
        if os.environ.get("UPDATE_SCREENSHOTS") == "1":
            shutil.copy(path, ROOT / "docs" / f"client-{name}.png")


def test_on_a_phone_only_the_conversation_scrolls(open_page, fake_model):
    """After a long answer the page itself never scrolls (it would slide the top bar
    over the question): only the conversation does."""
    page = open_page(**PHONE)
    page.select_option("#focus", "deepSeek")
    page.fill("#question", "a long one #tokens=400")
    page.tap("#send")
    wait_state(page, "completed", timeout=30_000)
    sizes = page.evaluate(
        "() => [document.scrollingElement.scrollHeight, window.innerHeight,"
        " document.querySelector('#conversation').scrollHeight]"
    )
    assert sizes[0] <= sizes[1] < sizes[2], sizes
    page.evaluate(
        "() => { window.scrollTo(0, 500); document.querySelector('#conversation').scrollTop = 0; }"
    )
    question = page.locator(".question").first.bounding_box()
    topbar = page.locator("#topbar").bounding_box()
    assert question["y"] >= topbar["y"] + topbar["height"], (question, topbar)


def test_the_demo_model_says_it_is_the_demo(open_page, fake_search):
    page = open_page(
        changes={
            "llm": {"base_url": "demo://?pace=0.002", "model": "demo", "api_key": ""},
            "search": {"provider": "demo"},
        }
    )
    notice = page.locator("#demo-notice")
    notice.wait_for(state="visible")
    assert "made up" in notice.inner_text()
    assert page.locator("#search-off").is_hidden()
    ask(page, "what is a methane rocket engine?")
    wait_state(page, "completed")
    assert page.locator(".turn .source").count() >= 3
    assert "Demo answer" in last(page, ".turn .answer").inner_text()


def test_a_focus_chosen_before_the_config_arrives_stays_chosen(open_page, fake_model):
    """The page paints before the server's config arrives (a slow network): a focus and
    optimization mode picked meanwhile are what the question is asked with."""
    page = open_page(goto=False)
    held = []  # the config request, held until the choice is made
    page.route("**/api/config", lambda route: held.append(route))
    page.goto(page.base + "/", wait_until="domcontentloaded")
    page.wait_for_selector("#focus option[value=deepResearch]", state="attached")
    page.wait_for_function("() => true")  # lets the route handler run
    assert held, "the page asked for its config"
    page.select_option("#mode", "balanced")
    page.select_option("#focus", "deepResearch")
    with page.expect_response("**/api/config"):
        held[0].continue_()
    page.wait_for_timeout(500)  # the config applied
    assert page.eval_on_selector("#focus", "e => e.value") == "deepResearch"
    assert page.eval_on_selector("#mode", "e => e.value") == "balanced"


# ---- MCP servers in the source picker ------------------------------------------------------------


def test_the_source_picker_lists_the_mcp_servers(open_page, fake_model, fake_search):
    fake = FakeMcp()
    # it stops while the page's server still holds its GET stream open: not waited for
    with serve(fake.app(), timeout_graceful_shutdown=1) as mcp:
        servers = {
            "handbook": McpServerSettings(url=mcp.url + "/mcp", default=False),
            "always": McpServerSettings(url=mcp.url + "/mcp"),
        }
        page = open_page(changes={"mcp": {"servers": servers}})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            listed = httpx.get(page.base + "/api/mcp/servers").json()["servers"]
            if all(s["status"] == "ready" for s in listed):
                break
            time.sleep(0.1)
        picker = page.locator("#mcp-servers")
        picker.wait_for()
        assert page.is_checked("#mcp-servers input[value='mcp:always']")
        assert page.is_disabled("#mcp-servers input[value='mcp:always']")
        assert not page.is_checked("#mcp-servers input[value='mcp:handbook']")
        page.check("#mcp-servers input[value='mcp:handbook']")
        page.select_option("#mode", "balanced")
        fake_model.tool_rounds[:] = [[("handbook__lookup", {"topic": "raptor"})], [("done", {})]]
        ask(page, RELEVANT_QUESTION)
        wait_state(page, "completed")
    offered = {t["function"]["name"] for t in fake_model.tool_requests()[0]["tools"]}
    assert {"handbook__lookup", "always__lookup"} <= offered
    assert fake.calls == ["lookup:raptor"]
