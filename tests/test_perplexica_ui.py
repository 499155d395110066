"""Perplexica's real web UI (v1.10.0-rc3, ../shared/clients/perplexica-ui) against this
server, in headless Chromium, with the fake model and the fake SearxNG: everything issue 13
lists under "What a Perplexica user can do" (PROTOCOL §1, §6, §9). Each test acts as a
user and checks what the user sees and what the server asked the fakes.

The UI is built once per machine by scripts/perplexica_ui.sh (cached); its build talks to
127.0.0.1:18080, where `backend` runs this server, one per module.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests import perplexica
from tests.fakes.model import DEFAULT_REPLIES, FakeModel, short_call
from tests.fakes.search import RESULT_COUNT, TOPICS, FakeSearch
from tests.perplexica import (
    API_URL,
    FAILED_TO_CONNECT,
    FOCUS_MODES,
    UI,
    Backend,
    SearxngRecorder,
    answer_requests,
    conversation,
    minimal_pdf,
    system_prompt,
)

#: these tests build the Perplexica UI (once, cached): `-m "not perplexica_ui"` skips them
pytestmark = pytest.mark.perplexica_ui

# the harness's fixtures: the built UI, this server on :18080, Chromium, the page
perplexica_build = perplexica.perplexica_build
perplexica_ui = perplexica.perplexica_ui
searxng_recorder = perplexica.searxng_recorder
searxng = perplexica.searxng
perplexica_settings = perplexica.perplexica_settings
backend = perplexica.backend
chromium = perplexica.chromium
ui = perplexica.ui
ui_defaults = perplexica.ui_defaults

RESULT_TITLES = {f"Result {n}: {TOPICS[n]}" for n in range(RESULT_COUNT)}
#: the sources of a focus mode that keeps to some sources (SearxNG engines, PROTOCOL §1)
ENGINES = {
    "All": set(),
    "Academic": {"arxiv", "google scholar", "pubmed"},
    "Wolfram Alpha": {"wolframalpha"},
    "Youtube": {"youtube"},
    "Reddit": {"reddit"},
}
SUGGESTIONS = next(reply for key, reply in DEFAULT_REPLIES if key == "Follow-up questions")
CREATED_JUST_NOW = re.compile(r"^(\d+ seconds?|[1-5] minutes?) Ago$")
#: a question asked with this is answered after a short wait, as a real model would: the UI
#: reads the last message after `messageEnd` from a ref that a render updates
#: (ChatWindow.tsx:441-443, 564); when the sources, every chunk and `messageEnd` arrive
#: within one render it sees the question as the last message and skips the suggestions
#: and the automatic image search
THINKING = " #wait=0.3"


def heading(ui: UI, text: str) -> Any:
    return ui.page.get_by_role("heading", name=text, exact=True)


def see_answer(ui: UI, text: str) -> None:
    ui.see(ui.page.get_by_text(text), f"the answer {text!r}")


def api_get(path: str) -> tuple[int, Any]:
    """GET on the server as the UI would (no user, no key)."""
    request = urllib.request.Request(API_URL + path, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def new_chat(ui: UI, model: FakeModel, question: str, answer: str) -> str:
    """Ask `question` in a new chat (answered `answer`); the chat's id."""
    model.answer_text = answer
    ui.home()
    ui.ask(question)
    see_answer(ui, answer.split(" [")[0])
    return ui.chat_id()


# -- connect -------------------------------------------------------------------------


def test_home_page_connects_with_the_configured_models(ui: UI) -> None:
    with ui.page.expect_response(API_URL + "/api/models") as models:
        ui.home()
    ui.see(ui.page.get_by_text("Research begins here."), "the empty chat")
    assert ui.page.get_by_text(FAILED_TO_CONNECT).count() == 0, ui.report()
    assert ui.received()[0] == {"type": "signal", "data": "open"}

    # GET /api/models: the configured chat and embedding models, never a key
    assert models.value.status == 200
    body = models.value.json()
    chat_models = {m for p in body["chatModelProviders"].values() for m in p}
    embedding_models = {m for p in body["embeddingModelProviders"].values() for m in p}
    assert "fake-chat" in chat_models
    assert "fake-embed" in embedding_models
    assert "test-key" not in models.value.text()
    # the UI takes the first of each: the configured default answers
    stored = ui.local_storage()
    assert stored["chatModel"] == "fake-chat"
    assert stored["embeddingModel"] == "fake-embed"
    assert "chatModel=fake-chat" in ui.ws_urls[-1]
    ui.page.wait_for_timeout(500)
    assert ui.toasts() == [], ui.report()


# -- ask -----------------------------------------------------------------------------


@pytest.mark.parametrize("title", list(FOCUS_MODES))
def test_ask_in_each_focus_mode(
    ui: UI, fake_model: FakeModel, searxng: SearxngRecorder, title: str
) -> None:
    question = f"What does the {title} focus say about methane?"
    answer = f"In {title} focus, methane is CH4 [1]."
    fake_model.answer_text = answer
    ui.home()
    ui.pick_focus(title)
    sent = ui.ask(question)

    assert sent["focusMode"] == FOCUS_MODES[title]
    ui.see(heading(ui, question), "the question")
    see_answer(ui, f"In {title} focus, methane is CH4")
    assert ui.page.get_by_text(FAILED_TO_CONNECT).count() == 0
    # streamed: the first chunk is "" (else the UI doubles it), then the answer in pieces
    chunks = [f["data"] for f in ui.received("message")]
    assert chunks[0] == "" and "".join(chunks) == answer

    if title == "Writing":  # no web search: an answer without sources
        assert searxng.of("") == []
        assert ui.source_titles() == []
    else:
        calls = searxng.of("")
        assert calls, "no SearxNG web search"
        assert all(call.engines == ENGINES[title] for call in calls), [c.params for c in calls]
        titles = ui.source_titles()
        assert titles and set(titles) <= RESULT_TITLES | {"All Sources"}, titles
        # citation [1] links to the first source
        first = ui.received("sources")[-1]["data"][0]["metadata"]["url"]
        assert ui.page.locator(f'a[href="{first}"]', has_text="1").count() >= 1

    # the model got the question once, and nothing else but the system prompt
    requests = answer_requests(fake_model, question)
    assert len(requests) == 1, fake_model.streamed_requests()
    assert conversation(requests[0]) == [("user", question)]
    assert requests[0]["model"] == "fake-chat"


@pytest.mark.parametrize("mode", ["Speed", "Balanced"])
def test_optimization_modes_and_a_follow_up_with_copilot(
    ui: UI, fake_model: FakeModel, fake_search: FakeSearch, mode: str
) -> None:
    question = f"How do falcon engines burn methane in {mode} mode?"
    answer = f"{mode} answer about engines [1]."
    fake_model.answer_text = answer
    ui.home()
    ui.pick_optimization(mode)
    sent = ui.ask(question)
    assert sent["optimizationMode"] == mode.lower()
    see_answer(ui, f"{mode} answer about engines")
    assert ui.source_titles()
    prompt = system_prompt(answer_requests(fake_model, question)[0])
    if mode == "Speed":  # search snippets only
        assert fake_search.pages_read == [] and "SNIPPET-" in prompt
    else:  # ranked, the best page read in full
        assert fake_search.pages_read and "FULLTEXT-" in prompt

    # a follow-up with the Copilot switch on, in the same optimization mode
    ui.page.get_by_role("switch", name="Copilot").click()
    follow_up = f"And the oxidiser, in {mode} mode?"
    fake_model.answer_text = f"{mode} follow-up: liquid oxygen [2]."
    sent = ui.ask(follow_up)
    assert sent["optimizationMode"] == mode.lower()
    see_answer(ui, f"{mode} follow-up: liquid oxygen")
    assert ui.source_titles(-1)
    # the UI sent the earlier turns as "human"/"assistant" and the question twice
    requests = answer_requests(fake_model, follow_up)
    assert len(requests) == 1
    assert conversation(requests[0]) == [
        ("user", question),
        ("assistant", answer),
        ("user", follow_up),
    ]
    assert ui.page.locator("xpath=//h3[normalize-space()='Sources']").count() == 2


# -- related, images, videos ---------------------------------------------------------


def test_related_suggestions_appear_under_an_answer(ui: UI, fake_model: FakeModel) -> None:
    question = "What is the boiling point of methane?" + THINKING
    fake_model.answer_text = "Methane boils at -161.5 °C [1]."
    ui.home()
    with ui.page.expect_response(API_URL + "/api/suggestions", timeout=20_000) as answer:
        ui.ask(question)
    assert answer.value.status == 200, answer.value.text()
    ui.see(heading(ui, "Related"), "the Related suggestions")
    expected = SUGGESTIONS.splitlines()
    shown = [s for s in expected if ui.page.get_by_text(s, exact=True).count()]
    assert len(shown) >= 3, (shown, answer.value.text())
    # the suggestions were made from this chat's question
    asked = [r for r in fake_model.requests if short_call(r)]
    assert any(
        question in json.dumps(r["messages"]) and "Follow-up questions" in json.dumps(r)
        for r in asked
    )

    # a click asks it
    fake_model.answer_text = "Next: it is a gas at room temperature."
    sent_before = len(ui.sent())
    ui.page.get_by_text(shown[0], exact=True).click()
    ui.wait_answered(sent_before)
    ui.see(heading(ui, shown[0]), "the suggestion asked")
    see_answer(ui, "Next: it is a gas at room temperature.")


def _images(searxng: SearxngRecorder) -> dict[str, str]:
    """What the fake SearxNG answered to `categories=images`: image URL → title."""
    found = {}
    for call in searxng.of("images"):
        for item in call.results:
            for key in ("img_src", "thumbnail_src"):
                if item.get(key):
                    found[item[key]] = item.get("title", "")
    return found


def _videos(searxng: SearxngRecorder) -> dict[str, tuple[str, str]]:
    """What the fake SearxNG answered to `categories=videos`: thumbnail → (title, player)."""
    found = {}
    for call in searxng.of("videos"):
        for item in call.results:
            for key in ("thumbnail", "img_src"):
                if item.get(key) and item.get("iframe_src"):
                    found[item[key]] = (item.get("title", ""), item["iframe_src"])
    return found


def _check_images(ui: UI, searxng: SearxngRecorder) -> None:
    shown = ui.see(ui.page.locator("img.cursor-zoom-in"), "the images")
    expected = _images(searxng)
    assert expected, "the server did not search SearxNG's images category"
    pairs = [(img.get_attribute("src"), img.get_attribute("alt")) for img in shown.all()]
    for src, alt in pairs:
        assert src in expected and alt == expected[src], (src, alt, expected)
        assert src in ui.requested  # the browser loaded it
    # a click opens it in the lightbox
    shown.first.click()
    slide = ui.see(
        ui.page.locator(".yarl__slide_current .yarl__slide_image"), "the image in the lightbox"
    )
    assert slide.first.get_attribute("src") == pairs[0][0]
    ui.page.keyboard.press("Escape")


def test_images_load_for_an_answer(ui: UI, fake_model: FakeModel, searxng: SearxngRecorder) -> None:
    fake_model.answer_text = "Falcon engines burn methane [1]."
    ui.home()
    ui.ask("Show me methane rocket engines")
    with ui.page.expect_response(API_URL + "/api/images") as answer:
        ui.page.get_by_role("button", name="Search images").click()
    assert answer.value.status == 200, answer.value.text()
    assert isinstance(answer.value.json().get("images"), list)
    _check_images(ui, searxng)


def test_images_load_by_themselves_with_the_default_settings(
    ui_defaults: UI, fake_model: FakeModel, searxng: SearxngRecorder
) -> None:
    fake_model.answer_text = "Falcon engines burn methane [1]."
    ui_defaults.home()
    ui_defaults.ask("Pictures of methane flames" + THINKING)
    _check_images(ui_defaults, searxng)


def test_videos_load_for_an_answer(ui: UI, fake_model: FakeModel, searxng: SearxngRecorder) -> None:
    fake_model.answer_text = "Raptor engines burn methane [1]."
    ui.home()
    ui.ask("Videos of Raptor engine tests")
    with ui.page.expect_response(API_URL + "/api/videos") as answer:
        ui.page.get_by_role("button", name="Search videos").click()
    assert answer.value.status == 200, answer.value.text()
    assert isinstance(answer.value.json().get("videos"), list)
    tiles = ui.see(
        ui.page.locator("div.cursor-pointer").filter(has=ui.page.get_by_text("Video", exact=True)),
        "the videos",
    )
    expected = _videos(searxng)
    assert expected, "the server did not search SearxNG's videos category"
    shown = [
        (t.locator("img").get_attribute("src"), t.locator("img").get_attribute("alt"))
        for t in tiles.all()
    ]
    for src, alt in shown:
        assert src in expected and alt == expected[src][0], (src, alt, expected)
        assert src in ui.requested
    # a click plays it: the player's page in the lightbox
    tiles.first.click()
    player = ui.see(ui.page.locator(".yarl__slide_current iframe"), "the player")
    assert player.first.get_attribute("src").startswith(expected[shown[0][0]][1])


# -- files ---------------------------------------------------------------------------


def test_attach_files_and_ask_about_them(ui: UI, fake_model: FakeModel, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("The harness soup recipe calls for cardamom from Kerala.\n")
    spec = tmp_path / "spec.pdf"
    spec.write_bytes(minimal_pdf("Tungsten melts at 3422 degrees Celsius."))
    ui.home()
    uploaded = ui.attach(notes, spec)
    files = uploaded["files"]
    assert [(f["fileName"], f["fileExtension"]) for f in files] == [
        ("notes.txt", "txt"),
        ("spec.pdf", "pdf"),
    ]
    ui.see(ui.page.get_by_text("2 files"), "the attached files")

    question = "What do my files say about cardamom and tungsten?"
    fake_model.answer_text = "Cardamom goes in the soup [1] and tungsten melts at 3422 °C [2]."
    sent = ui.ask(question)
    assert sent["files"] == [f["fileId"] for f in files]
    see_answer(ui, "Cardamom goes in the soup")
    titles = ui.source_titles()
    assert "notes.txt" in titles and "spec.pdf" in titles, titles
    # the model was given both files' text (the PDF's extracted)
    given = json.dumps(answer_requests(fake_model, question)[0]["messages"])
    assert "cardamom from Kerala" in given and "3422 degrees" in given

    # reopened, the chat keeps its files: a follow-up uses them again
    ui.open(f"/c/{ui.chat_id()}")
    ui.see(heading(ui, question), "the reopened chat")
    follow_up = "Where does the soup recipe get its cardamom from?"
    fake_model.answer_text = "From Kerala [1]."
    sent = ui.ask(follow_up)
    assert sent["files"] == [f["fileId"] for f in files]
    given = json.dumps(answer_requests(fake_model, follow_up)[0]["messages"])
    assert "cardamom from Kerala" in given


# -- library: list, reopen, follow up, rewrite, delete -------------------------------


def test_library_lists_chats_with_dates_and_reopens_them(ui: UI, fake_model: FakeModel) -> None:
    fake_model.replies.insert(
        0, ("Write a title", lambda p: "Walrus sizes" if "walrus" in p else "Otter sleep")
    )
    walrus = "How big do walruses grow?"
    first = new_chat(ui, fake_model, walrus, "Walruses reach 1.5 tonnes [1].")
    live_sources = ui.source_titles()
    otter = "Where do sea otters sleep?"
    second = new_chat(ui, fake_model, otter, "Sea otters sleep in kelp [1].")
    assert first != second

    ui.open("/library")
    ui.see(ui.page.get_by_role("heading", name="Library"), "the library")
    items = {}
    for chat_id, name in (
        (first, f"Walrus sizes|{re.escape(walrus)}"),
        (second, f"Otter sleep|{re.escape(otter)}"),
    ):
        link = ui.see(ui.page.get_by_role("link", name=re.compile(f"^({name})$")), name)
        assert link.first.get_attribute("href") == f"/c/{chat_id}"
        item = ui.page.locator("div.py-6").filter(has=link.first)
        date = item.locator("p.text-xs").inner_text().strip()
        assert CREATED_JUST_NOW.match(date), date
        items[chat_id] = link.first
    # newest first
    hrefs = [a.get_attribute("href") for a in ui.page.locator("main a[href^='/c/']").all()]
    assert hrefs.index(f"/c/{second}") < hrefs.index(f"/c/{first}")

    # reopen: the messages and the sources of the answer
    items[first].click()
    ui.page.wait_for_url(f"**/c/{first}")
    ui.see(heading(ui, walrus), "the reopened question")
    see_answer(ui, "Walruses reach 1.5 tonnes")
    # (the "All Sources" link of the live answer is not a source: it may be left out)
    assert [t for t in ui.source_titles() if t != "All Sources"] == [
        t for t in live_sources if t != "All Sources"
    ]
    ui.see(ui.page.get_by_text(re.compile(r"^\d+ (second|minute)s? ago$")), "the chat's date")


def test_follow_up_continues_a_reopened_chat(ui: UI, fake_model: FakeModel) -> None:
    q1, a1 = "What do hermit crabs eat?", "Hermit crabs eat algae [1]."
    chat = new_chat(ui, fake_model, q1, a1)
    ui.open(f"/c/{chat}")
    ui.see(heading(ui, q1), "the reopened chat")

    q2, a2 = "And how long do they live?", "They live about 30 years [2]."
    fake_model.answer_text = a2
    sent = ui.ask(q2)
    assert sent["message"]["chatId"] == chat
    see_answer(ui, "They live about 30 years")
    # the model: the earlier turns with their roles, the question once
    requests = answer_requests(fake_model, q2)
    assert len(requests) == 1
    assert conversation(requests[0]) == [("user", q1), ("assistant", a1), ("user", q2)]

    # saved: reopened again, both turns in order
    ui.open(f"/c/{chat}")
    ui.see(heading(ui, q2), "the follow-up, reopened")
    questions = ui.page.locator("h2").all_inner_texts()
    assert questions == [q1, q2]
    see_answer(ui, "Hermit crabs eat algae")
    see_answer(ui, "They live about 30 years")


def test_rewrite_regenerates_the_last_answer(ui: UI, fake_model: FakeModel) -> None:
    q1, a1 = "Why is the sky blue?", "Rayleigh scattering [1]."
    q2, a2 = "And sunsets?", "Longer paths redden the light [2]."
    new_chat(ui, fake_model, q1, a1)
    fake_model.answer_text = a2
    asked = ui.ask(q2)
    see_answer(ui, "Longer paths redden the light")

    fake_model.answer_text = "Dust and long paths make sunsets red [1]."
    sent = ui.rewrite(-1)
    assert sent["message"]["messageId"] == asked["message"]["messageId"]  # the same question
    see_answer(ui, "Dust and long paths make sunsets red")
    assert ui.page.get_by_text("Longer paths redden the light").count() == 0
    assert heading(ui, q2).count() == 1
    # asked again, with the history up to that question (not the old answer, not twice)
    requests = answer_requests(fake_model, q2)
    assert len(requests) == 2
    assert conversation(requests[-1]) == [("user", q1), ("assistant", a1), ("user", q2)]


def test_rewrite_an_earlier_answer_drops_the_turns_after_it(ui: UI, fake_model: FakeModel) -> None:
    q1, a1 = "Who built the first telescope?", "Hans Lipperhey, in 1608 [1]."
    q2, a2 = "What did Galileo see?", "The moons of Jupiter [2]."
    chat = new_chat(ui, fake_model, q1, a1)
    fake_model.answer_text = a2
    ui.ask(q2)
    see_answer(ui, "The moons of Jupiter")

    fake_model.answer_text = "Lipperhey applied for the patent in 1608 [1]."
    ui.rewrite(0)
    see_answer(ui, "Lipperhey applied for the patent in 1608")
    assert ui.page.get_by_text("Hans Lipperhey, in 1608").count() == 0
    assert heading(ui, q2).count() == 0
    requests = answer_requests(fake_model, q1)
    assert len(requests) == 2
    assert conversation(requests[-1]) == [("user", q1)]

    # the server kept only the new answer
    ui.open(f"/c/{chat}")
    ui.see(heading(ui, q1), "the reopened chat")
    see_answer(ui, "Lipperhey applied for the patent in 1608")
    assert ui.page.locator("h2").all_inner_texts() == [q1]
    assert ui.page.get_by_text("The moons of Jupiter").count() == 0

    # and a reopened chat's answer is rewritten too (the question's id is the server's)
    fake_model.answer_text = "The first telescope came from Middelburg [1]."
    ui.rewrite(0)
    see_answer(ui, "The first telescope came from Middelburg")
    assert ui.page.get_by_text("Lipperhey applied for the patent in 1608").count() == 0
    requests = answer_requests(fake_model, q1)
    assert len(requests) == 3
    assert conversation(requests[-1]) == [("user", q1)]


def test_delete_a_chat_from_the_library(ui: UI, fake_model: FakeModel) -> None:
    fake_model.replies.insert(
        0, ("Write a title", lambda p: "Lemming myths" if "lemming" in p else "Puffin diet")
    )
    doomed_q = "Do lemmings really jump off cliffs?"
    doomed = new_chat(ui, fake_model, doomed_q, "No, that is a myth [1].")
    kept_q = "What do puffins eat?"
    kept = new_chat(ui, fake_model, kept_q, "Puffins eat sand eels [1].")

    ui.open("/library")
    doomed_link = ui.page.get_by_role(
        "link", name=re.compile(f"^(Lemming myths|{re.escape(doomed_q)})$")
    )
    ui.see(doomed_link, "the chat to delete")
    item = ui.page.locator("div.py-6").filter(has=doomed_link)
    item.locator("button:has(svg.lucide-trash)").click()
    dialog = ui.page.get_by_role("dialog")
    ui.see(dialog.get_by_text("Are you sure you want to delete this chat?"), "the confirmation")
    with ui.page.expect_response(
        lambda r: r.request.method == "DELETE" and r.url == f"{API_URL}/api/chats/{doomed}"
    ) as deleted:
        dialog.get_by_role("button", name="Delete").click()
    assert deleted.value.status == 200
    doomed_link.wait_for(state="detached")
    assert ui.toasts() == [], ui.report()

    ui.open("/library")
    ui.see(ui.page.locator(f"a[href='/c/{kept}']"), "the chat kept")
    assert ui.page.locator(f"a[href='/c/{doomed}']").count() == 0
    assert api_get(f"/api/chats/{doomed}")[0] == 404
    ui.open(f"/c/{doomed}")
    ui.see(ui.page.get_by_text("404"), "the 404 page of a deleted chat")


# -- discover, settings --------------------------------------------------------------


def test_discover_shows_recent_news(ui: UI, backend: Backend, searxng: SearxngRecorder) -> None:
    backend.restart()  # an empty news cache
    with ui.page.expect_response(API_URL + "/api/discover", timeout=20_000) as answer:
        ui.open("/discover")
    assert answer.value.status == 200, answer.value.text()
    ui.see(ui.page.get_by_role("heading", name="Discover"), "the discover page")
    news = {
        item["url"]: item
        for call in searxng.of("news")
        for item in call.results
        if item.get("url") and (item.get("thumbnail") or item.get("img_src"))
    }
    assert news, "the server did not search SearxNG's news category"
    cards = ui.see(ui.page.locator('a[href^="/?q=Summary: "]'), "the news cards")
    for card in cards.all():
        url = card.get_attribute("href").removeprefix("/?q=Summary: ")
        assert url in news, (url, list(news))
        assert news[url]["title"][:40] in card.inner_text()
    assert ui.toasts() == [], ui.report()

    # cached: a second visit does not search again
    searches = len(searxng.of("news"))
    ui.open("/discover")
    ui.see(ui.page.locator('a[href^="/?q=Summary: "]'), "the news cards, again")
    assert len(searxng.of("news")) == searches


def test_discover_is_an_empty_page_not_an_error_when_search_fails(
    ui: UI, backend: Backend, fake_search: FakeSearch
) -> None:
    backend.restart()
    fake_search.fail = 500
    with ui.page.expect_response(API_URL + "/api/discover", timeout=20_000) as answer:
        ui.open("/discover")
    assert answer.value.status == 200, answer.value.text()
    assert answer.value.json()["blogs"] == []
    ui.see(ui.page.get_by_role("heading", name="Discover"), "the discover page")
    ui.page.wait_for_timeout(500)
    assert ui.page.locator('a[href^="/?q=Summary: "]').count() == 0
    assert ui.toasts() == [], ui.report()


def test_settings_list_the_models_and_refuse_to_save(ui: UI) -> None:
    ui.home()  # the UI picks its models from /api/models
    chosen = ui.local_storage()["chatModel"]
    with ui.page.expect_response(API_URL + "/api/config") as config:
        ui.open("/settings")
    assert config.value.status == 200
    assert "test-key" not in config.value.text()
    ui.see(ui.page.get_by_role("heading", name="Settings", level=1), "the settings page")
    ui.see(ui.page.get_by_text("Model Settings"), "the model settings")
    providers = ui.page.locator("select").nth(1).locator("option")
    assert providers.count() >= 1
    models = ui.page.locator("select").nth(2).locator("option")
    values = [o.get_attribute("value") for o in models.all()]
    assert "fake-chat" in values, models.all_inner_texts()

    # saving an API key: the server refuses (read-only), and keeps no secret
    with ui.page.expect_response(
        lambda r: r.url == API_URL + "/api/config" and r.request.method == "POST"
    ) as saved:
        ui.page.get_by_placeholder("OpenAI API Key").fill("sk-harness-secret")
        ui.page.get_by_placeholder("OpenAI API Key").blur()
    assert saved.value.status == 403
    refusal = saved.value.json()
    assert refusal["key"] == "FORBIDDEN" and "read-only" in refusal["data"], refusal
    ui.wait_until(
        lambda: any("Failed to save" in text for text in ui.console_errors), "the UI's refusal"
    )
    status, now = api_get("/api/config")
    assert status == 200 and "sk-harness-secret" not in json.dumps(now)

    # choosing another chat model (a fresh page: no key typed) is a browser preference:
    # accepted, nothing written on the server, and the UI keeps the choice
    other = [v for v in values if v and v != chosen]
    assert other, values
    ui.open("/settings")
    ui.see(ui.page.get_by_text("Model Settings"), "the model settings")
    with ui.page.expect_response(
        lambda r: r.url == API_URL + "/api/config" and r.request.method == "POST"
    ) as saved:
        ui.page.locator("select").nth(2).select_option(other[0])
    assert saved.value.status == 200
    ui.wait_until(lambda: ui.local_storage()["chatModel"] == other[0], "the model kept")
