"""The search provider in use: `auto` picks the first configured one, else ddgs (keyless).

ddgs cannot reach its services here: its client is replaced at the boundary (the
factory `app.search.ddgs.new_client`) by a fake that answers what ddgs 9.16.1
returns (the key sets and value types of its result dataclasses), or fails or hangs
as the library does. Everything between that client and the wire is the real code.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ddgs.exceptions import DDGSException, RatelimitException, TimeoutException

import app.search.ddgs
from app.config import DdgsSettings, Settings
from app.main import create_app
from app.search.ddgs import DdgsSearch
from app.search.google import GoogleSearch
from app.search.searxng import SearxngSearch
from app.search.tavily import TavilySearch
from app.search.web import choose_provider, open_provider, search_problem
from tests.client import chat_body, sse_chat
from tests.conftest import USER
from tests.servers import serve

pytestmark = pytest.mark.anyio

QUESTION = "what is python used for"

# -- what ddgs 9.16.1 returns (DDGS().text/images/videos/news: `result.__dict__` of its
# -- result dataclasses, so these keys in this order; values as its engines leave them)

TEXT_RESULTS = [
    {
        "title": "Python (programming language) - Example Encyclopedia",
        "href": "https://en.example.org/wiki/Python_(programming_language)",
        "body": "Python is a high-level, general-purpose programming language. Its design "
        "philosophy emphasizes code readability with the use of significant indentation.",
    },
    {
        "title": "Welcome to Python.example",
        "href": "https://www.python.example.com/",
        "body": "The official home of the Python Programming Language. Download the latest "
        "release, read the documentation and join the community.",
    },
    {
        "title": "Python Tutorial - Learn Python Programming for Beginners",
        "href": "https://learn.example.net/python/tutorial/",
        "body": "This Python tutorial covers variables, data types, control flow, functions, "
        "modules and classes, with runnable examples for each topic.",
    },
]

IMAGES_RESULTS = [
    {
        "title": "Python logo and wordmark on a white background",
        "image": "https://upload.example.org/images/python-logo-full.png",
        "thumbnail": "https://tse2.mm.example.net/th?id=OIP.a1B2c3D4e5F6g7H8i9J0kLAHaEK&pid=Api",
        "url": "https://en.example.org/wiki/File:Python_logo_and_wordmark.png",
        "height": 1080,
        "width": 1920,
        "source": "Bing",
    },
    {
        "title": "Ball python coiled on a branch - stock photo",
        "image": "https://images.photos.example.com/photo-1531386151447-fd76ad50012f.jpg",
        "thumbnail": "https://tse1.mm.example.net/th?id=OIP.Zx9Yw8Vu7Ts6Rq5Po4NmLgHaE8&pid=Api",
        "url": "https://photos.example.com/photos/ball-python-on-branch",
        "height": 3456,
        "width": 5184,
        "source": "Bing",
    },
    {  # the duckduckgo backend copies DDG's JSON: a missing field is None
        "title": "Python cheat sheet for beginners (PDF)",
        "image": None,
        "thumbnail": "https://tse3.mm.example.net/th?id=OIP.QwErTy123456UiOpAsDfGhHaJ4&pid=Api",
        "url": "https://devblog.example.io/python-cheat-sheet/",
        "height": 1414,
        "width": 1000,
        "source": "DuckDuckGo",
    },
]


def _video(n: int, title: str, page: str, player: str, picture: str) -> dict[str, Any]:
    return {
        "title": title,
        "content": page,
        "description": f"description {n}",
        "duration": "10:32",
        "embed_html": f'<iframe width="1280" height="720" src="{player}" allowfullscreen></iframe>',
        "embed_url": player,
        "image_token": f"{n:064x}",
        "images": {"large": picture, "medium": picture, "motion": "", "small": picture},
        "provider": "Bing",
        "published": "2023-08-02T13:30:01.0000000",
        "publisher": "VideoTube",
        "statistics": {"viewCount": 312640 if n else None},
        "uploader": "Code Example Channel",
    }


VIDEOS_RESULTS = [
    _video(
        0,
        "Python Full Course for Beginners",
        "https://www.videos.example.com/watch?v=_uQrJ0TkZlc",
        "https://www.videos.example.com/embed/_uQrJ0TkZlc?autoplay=1",
        "https://tse4.mm.example.net/th?id=OVP.Ab12Cd34Ef56Gh78Ij90KlHgEsDh&pid=Api",
    ),
    _video(
        1,
        "Async Python: asyncio in Practice (Conference Talk)",
        "https://vimeo.example.com/845129337",
        "https://player.vimeo.example.com/video/845129337?autoplay=1",
        "https://tse2.mm.example.net/th?id=OVF.Gh56Ij78Kl90Mn12Op34QrHgEsDh&pid=Api",
    ),
]

NEWS_RESULTS = [
    {
        "date": "2025-10-07T14:22:00+00:00",
        "title": "Python 3.14 released with free-threaded build and new template strings",
        "body": "The Python core team announced the release of Python 3.14.",
        "url": "https://www.technews.example.com/2025/10/07/python-3-14-released/",
        "image": "https://images.technews.example.com/2025/10/python-314-hero.jpg",
        "source": "TechNews Example",
    },
    {
        "date": "2025-09-18T19:47:36+00:00",
        "title": "Malicious packages on package index target Python developers",
        "body": "Security researchers discovered a batch of typosquatted packages.",
        "url": "https://security.example.net/articles/malicious-python-packages-typosquatting",
        "image": None,
        "source": "Security Example Weekly",
    },
]

#: entries a page may not link to (no absolute http(s) URL): dropped
UNLINKABLE = {
    "text": [{"title": "relative", "href": "/wiki/Python", "body": "x"}],
    "images": [{**IMAGES_RESULTS[0], "url": "javascript:alert(1)"}],
    "videos": [{**VIDEOS_RESULTS[0], "embed_url": ""}],
    "news": [{**NEWS_RESULTS[0], "url": None}],
}


class RecordedDdgs:
    """Stands in for `ddgs.DDGS` (its factory is `factory`): answers the recorded
    results, records each call, and can be made to fail or hang (until `release`)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[dict[str, Any]]] = {
            "text": TEXT_RESULTS,
            "images": IMAGES_RESULTS,
            "videos": VIDEOS_RESULTS,
            "news": NEWS_RESULTS,
        }
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.clients: list[DdgsSettings] = []
        self.fail: BaseException | None = None
        self.delay = 0.0
        self.hang = False
        self.release = threading.Event()

    def factory(self, settings: DdgsSettings) -> RecordedDdgs:
        self.clients.append(settings)
        return self

    def asked(self, kind: str) -> list[str]:
        return [query for k, query, _ in self.calls if k == kind]

    def _answer(self, kind: str, query: str, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        self.calls.append((kind, query, kwargs))
        if self.hang:
            self.release.wait(30)
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return copy.deepcopy(self.answers[kind])

    def text(self, query: str, **kwargs: Any) -> list[dict[str, Any]]:
        return self._answer("text", query, kwargs)

    def images(self, query: str, **kwargs: Any) -> list[dict[str, Any]]:
        return self._answer("images", query, kwargs)

    def videos(self, query: str, **kwargs: Any) -> list[dict[str, Any]]:
        return self._answer("videos", query, kwargs)

    def news(self, query: str, **kwargs: Any) -> list[dict[str, Any]]:
        return self._answer("news", query, kwargs)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordedDdgs]:
    fake = RecordedDdgs()
    monkeypatch.setattr(app.search.ddgs, "new_client", fake.factory)
    yield fake
    fake.release.set()  # a thread still waiting in a "hung" call ends


@pytest.fixture
def keyless(settings: Settings) -> Settings:
    """The test settings with only a model key: no search provider configured."""
    return settings.replace(
        search={"provider": "auto"},
        tavily={"api_key": ""},
        searxng={"url": ""},
        google={"api_key": "", "cse_id": ""},
    )


@contextlib.asynccontextmanager
async def running(settings: Settings, **sections: Any) -> Any:
    with serve(create_app(settings.replace(**sections))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            yield http


def search_body(content: str = QUESTION, **fields: Any) -> dict[str, Any]:
    fields = {"focusMode": "webSearch", "optimizationMode": "speed", **fields}
    return chat_body(content, copilotEnabled=True, **fields)


def progress_of(events: list[Any]) -> list[str]:
    return [e.data["data"] for e in events if e.type == "progress"]


# -- which provider ------------------------------------------------------------------------

CONFIGURED = list(itertools.product([False, True], repeat=4))


@pytest.mark.parametrize(
    ("tavily", "searxng", "google_key", "cse_id"),
    CONFIGURED,
    ids=[
        "+".join(n for n, on in zip(("tavily", "searxng", "key", "cse"), c, strict=True) if on)
        or "nothing"
        for c in CONFIGURED
    ],
)
async def test_auto_asks_the_first_configured_provider_else_ddgs(
    keyless, fake_model, fake_search, recorded, tavily, searxng, google_key, cse_id
):
    base = fake_search.base_url
    settings = keyless.replace(
        tavily={"api_key": fake_search.api_key if tavily else ""},
        searxng={"url": base + "/searxng" if searxng else ""},
        google={
            "api_key": fake_search.api_key if google_key else "",
            "cse_id": "cx1" if cse_id else "",
        },
    )
    expected = (
        "tavily"
        if tavily
        else "searxng"
        if searxng
        else "google"
        if google_key and cse_id
        else "ddgs"
    )
    assert choose_provider(settings).name == expected
    assert search_problem(settings) is None
    async with running(settings) as http:
        events = await sse_chat(http, search_body())
    assert any(e.type == "sources" for e in events)
    if expected == "ddgs":
        assert recorded.asked("text") == [QUESTION] and fake_search.queries == []
    else:
        assert fake_search.queries == [(expected, QUESTION)] and recorded.calls == []


@pytest.mark.parametrize(
    ("sections", "reason"),
    [
        (
            {},
            "auto: no Tavily key, no SearxNG URL, no Google key or CSE id → ddgs",
        ),
        (
            {"google": {"api_key": "k"}},
            "auto: no Tavily key, no SearxNG URL, no Google CSE id → ddgs",
        ),
        (
            {"google": {"api_key": "k", "cse_id": "cx"}, "searxng": {"url": "http://sx"}},
            "auto: no Tavily key, SearxNG URL set → searxng",
        ),
        (
            {"google": {"api_key": "k", "cse_id": "cx"}},
            "auto: no Tavily key, no SearxNG URL, Google key and CSE id set → google",
        ),
        ({"tavily": {"api_key": "k"}}, "auto: Tavily key set → tavily"),
        ({"search": {"provider": "ddgs"}, "tavily": {"api_key": "k"}}, "search.provider = ddgs"),
    ],
)
def test_the_choice_says_why(keyless, sections, reason):
    assert choose_provider(keyless.replace(**sections)).reason == reason


@pytest.mark.parametrize(
    ("provider", "kind"),
    [
        ("tavily", TavilySearch),
        ("searxng", SearxngSearch),
        ("google", GoogleSearch),
        ("ddgs", DdgsSearch),
        ("auto", TavilySearch),
    ],
)
async def test_an_explicit_provider_is_used_even_when_another_is_configured(
    settings, provider, kind
):
    async with httpx.AsyncClient() as http:
        assert isinstance(
            open_provider(settings.replace(search={"provider": provider}), http), kind
        )


def test_ddgs_needs_no_key_but_an_explicit_provider_still_does(keyless):
    assert search_problem(keyless) is None
    assert search_problem(keyless.replace(search={"provider": "ddgs"})) is None
    assert "TAVILY_API_KEY" in (
        search_problem(keyless.replace(search={"provider": "tavily"})) or ""
    )
    assert "SEARXNG_URL" in (search_problem(keyless.replace(search={"provider": "searxng"})) or "")
    google = search_problem(keyless.replace(search={"provider": "google"}, google={"api_key": "k"}))
    assert "GOOGLE_CSE_ID" in (google or "")


async def test_an_unknown_provider_is_refused_naming_the_choices(keyless):
    async with httpx.AsyncClient() as http:
        with pytest.raises(ValueError, match="auto, tavily, searxng, google, ddgs or demo"):
            open_provider(keyless.replace(search={"provider": "bing"}), http)


# -- what ddgs finds, on the wire -------------------------------------------------------------


async def test_ddgs_results_are_the_sources_of_a_web_answer(keyless, fake_model, recorded):
    recorded.answers["text"] = TEXT_RESULTS + UNLINKABLE["text"]
    async with running(keyless, ddgs={"region": "uk-en", "safesearch": "off"}) as http:
        events = await sse_chat(http, search_body(messageId="501"))
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert sources[:-1] == [
        {"metadata": {"title": r["title"], "url": r["href"]}, "pageContent": r["body"]}
        for r in TEXT_RESULTS
    ]
    assert sources[-1]["metadata"]["title"] == "All Sources"
    prompt = fake_model.last_system_prompt()
    assert f"source 1 {TEXT_RESULTS[0]['href']} {TEXT_RESULTS[0]['body']}" in prompt
    assert events[-1].data["status"] == "completed"
    (call,) = recorded.calls
    assert call == (
        "text",
        QUESTION,
        {"region": "uk-en", "safesearch": "off", "max_results": 8, "backend": "auto"},
    )
    assert recorded.clients[0].timeout_seconds == 5  # the library's per-request timeout


async def test_a_focus_mode_keeps_ddgs_to_its_sites(keyless, fake_model, recorded):
    async with running(keyless) as http:
        events = await sse_chat(http, chat_body(QUESTION, focusMode="redditSearch"))
    assert any(e.type == "sources" for e in events)
    assert recorded.asked("text") == [f"{QUESTION} (site:reddit.com)"]


async def test_the_search_filters_reach_ddgs_as_its_timelimit_and_site_operators(
    keyless, fake_model, recorded
):
    search = {"domains": ["example.org", "-learn.example.net"], "recency": "week"}
    async with running(keyless) as http:
        events = await sse_chat(http, search_body(search=search))
    ((kind, query, kwargs),) = recorded.calls
    assert kind == "text" and kwargs["timelimit"] == "w"
    assert query == f"{QUESTION} (site:example.org) -site:learn.example.net"
    sources = next(e for e in events if e.type == "sources").data["data"]
    # what ddgs answered from elsewhere is dropped afterwards all the same
    assert [s["metadata"]["url"] for s in sources[:-1]] == [TEXT_RESULTS[0]["href"]]


async def test_an_hour_asks_ddgs_for_a_day(keyless, fake_model, recorded):
    async with running(keyless) as http:
        await sse_chat(http, search_body(search={"recency": "hour"}))
    ((_, _, kwargs),) = recorded.calls
    assert kwargs["timelimit"] == "d"


async def test_ddgs_images_keep_their_size_on_v1(keyless, fake_model, recorded):
    body = {
        "model": "webSearch",
        "messages": [{"role": "user", "content": QUESTION}],
        "return_images": True,
    }
    async with running(keyless) as http:
        answer = (await http.post("/v1/chat/completions", json=body)).json()
    assert answer["images"][:2] == [
        {
            "image_url": i["image"],
            "origin_url": i["url"],
            "title": i["title"],
            "height": i["height"],
            "width": i["width"],
        }
        for i in IMAGES_RESULTS[:2]
    ]


async def test_images_videos_and_discover_come_from_ddgs(keyless, fake_model, recorded):
    for kind, bad in UNLINKABLE.items():
        recorded.answers[kind] = recorded.answers[kind] + bad
    body = {"query": QUESTION, "chatHistory": []}
    async with running(keyless) as http:
        images = (await http.post("/api/images", json=body)).json()["images"]
        videos = (await http.post("/api/videos", json=body)).json()["videos"]
        blogs = (await http.get("/api/discover")).json()["blogs"]
    assert images == [
        {"img_src": i["image"] or i["thumbnail"], "url": i["url"], "title": i["title"]}
        for i in IMAGES_RESULTS
    ]
    assert videos == [
        {
            "img_src": v["images"]["large"],
            "url": v["content"],
            "title": v["title"],
            "iframe_src": v["embed_url"],
        }
        for v in VIDEOS_RESULTS
    ]
    # each discover topic finds the same stories here: they are shown once
    assert blogs == [
        {"title": n["title"], "content": n["body"], "url": n["url"], "thumbnail": n["image"] or ""}
        for n in NEWS_RESULTS
    ]
    assert len(recorded.asked("news")) == 4


# -- failures degrade ---------------------------------------------------------------------------

SECRET_URL = "https://html.duckduckgo.com/html?q=what+is+python+used+for"


@pytest.mark.parametrize(
    ("failure", "words"),
    [
        (RatelimitException(f"{SECRET_URL} 202 Ratelimit"), "rate-limiting this server"),
        # what DDGS raises: the last engine's error wrapped in its base exception
        (DDGSException(RatelimitException(f"{SECRET_URL} 403")), "rate-limiting this server"),
        (TimeoutException(f"{SECRET_URL} timed out"), "did not answer in time"),
        (
            DDGSException("DNSError: DNSError('error sending request for url (https://x/)')"),
            "cannot be reached",
        ),
        (DDGSException("No results found."), "found nothing, or are refusing"),
        (KeyError("results"), "could not read"),  # a service changed its pages
    ],
)
async def test_a_ddgs_failure_is_a_progress_line_and_an_answer_without_sources(
    keyless, fake_model, recorded, failure, words
):
    recorded.fail = failure
    async with running(keyless, search={"timeout_seconds": 3.0}) as http:
        started = time.monotonic()
        events = await sse_chat(http, search_body(chatId="510"))
        elapsed = time.monotonic() - started
        saved = (await http.get("/api/chats/510")).json()["messages"]
    types = [e.type for e in events]
    assert "sources" not in types and "error" not in types
    progress = progress_of(events)
    assert any(p.startswith("web search failed (") and words in p for p in progress), progress
    assert not any(p.count("(") > 1 for p in progress), progress  # no nested parentheses
    # in words: no class names, no URL with the question in it
    assert not any(re.search(r"Exception|Error|https?:|duckduckgo", p) for p in progress)
    assert events[-1].data["status"] == "completed"
    assert "helpful, knowledgeable assistant" in fake_model.last_system_prompt()
    assert saved[0]["sources"] == []
    assert elapsed < 2.5


async def test_a_hung_library_is_cut_by_the_search_timeout(keyless, fake_model, recorded):
    recorded.hang = True
    body = {"query": QUESTION, "chatHistory": []}
    async with running(keyless, search={"timeout_seconds": 0.5}) as http:
        started = time.monotonic()
        events = await sse_chat(http, search_body())
        assert time.monotonic() - started < 2.5
        started = time.monotonic()
        assert (await http.post("/api/images", json=body)).json() == {"images": []}
        assert time.monotonic() - started < 2.5
    assert "sources" not in [e.type for e in events]
    assert any(re.search("timed out|did not answer in time", p) for p in progress_of(events))
    assert events[-1].data["status"] == "completed"


# -- the cache ----------------------------------------------------------------------------------


async def test_a_burst_of_the_same_search_asks_ddgs_once(keyless, fake_model, recorded):
    recorded.delay = 0.3  # the burst arrives while the first call is out
    body = {"query": QUESTION, "chatHistory": []}
    async with running(keyless) as http:
        burst = await asyncio.gather(*(http.post("/api/images", json=body) for _ in range(5)))
        again = await http.post("/api/images", json=body)
        await http.post("/api/images", json={**body, "query": "another question"})
        await http.post("/api/videos", json=body)
        await sse_chat(http, search_body())
        await sse_chat(http, search_body())
    assert all(r.json() == burst[0].json() for r in [*burst, again])
    assert len(burst[0].json()["images"]) == len(IMAGES_RESULTS)
    assert recorded.asked("images") == [QUESTION, "another question"]
    assert recorded.asked("videos") == [QUESTION]
    assert recorded.asked("text") == [QUESTION]


async def test_failures_are_not_cached_and_answers_expire(keyless, fake_model, recorded):
    body = {"query": QUESTION, "chatHistory": []}
    async with running(keyless, ddgs={"cache_seconds": 0.3}) as http:
        recorded.fail = DDGSException(RatelimitException("202 Ratelimit"))
        assert (await http.post("/api/images", json=body)).json() == {"images": []}
        recorded.fail = None
        assert (await http.post("/api/images", json=body)).json()["images"]
        assert (await http.post("/api/images", json=body)).json()["images"]
        assert len(recorded.asked("images")) == 2
        await asyncio.sleep(0.4)
        assert (await http.post("/api/images", json=body)).json()["images"]
    assert len(recorded.asked("images")) == 3
