"""Perplexity's search parameters (PROTOCOL §10) and the chat request's `search` controls
(§1): what reaches each provider of the fake web, what is filtered afterwards, and the
response fields (`search_results` with dates, `images`, `related_questions`,
`usage.num_search_queries`), through the `openai` SDK and the chat API."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from app.main import create_app
from tests.client import chat_body, sse_chat
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import serve

pytestmark = pytest.mark.anyio

TODAY = datetime.now(UTC).date()
OTHER_WEB = [
    {"title": "Pins", "url": "https://www.pinterest.com/pin/1", "snippet": "pinned"},
    {"title": "Paper", "url": "https://arxiv.org/abs/2601.1", "snippet": "a paper"},
    {
        "title": "Old news",
        "url": "https://news.example/old",
        "snippet": "long ago",
        "date": (TODAY - timedelta(days=400)).isoformat(),
    },
    {
        "title": "Fresh news",
        "url": "https://news.example/fresh",
        "snippet": "today",
        "date": TODAY.isoformat() + "T08:00:00Z",
    },
]


@contextlib.contextmanager
def api(settings, provider="tavily"):
    with serve(create_app(settings.replace(search={"provider": provider}))) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


def ask(client, **params):
    return client.chat.completions.create(
        model="webSearch",
        messages=[{"role": "user", "content": RELEVANT_QUESTION}],
        extra_body=params,
    )


def urls(completion) -> list[str]:
    return [r["url"] for r in completion.model_extra["search_results"]]


@pytest.mark.parametrize("provider", ["tavily", "searxng", "google"])
def test_excluded_domains_never_appear_whatever_the_provider(
    settings, fake_model, fake_search, provider
):
    fake_search.extra[:] = OTHER_WEB
    with api(settings, provider) as client:
        completion = ask(client, search_domain_filter=["-pinterest.com"])
    found = urls(completion)
    assert found and not any("pinterest" in u for u in found)
    assert "https://arxiv.org/abs/2601.1" in found
    assert completion.model_extra["citations"] == found
    (_, asked), *_ = fake_search.requests
    if provider == "tavily":
        assert asked["exclude_domains"] == ["pinterest.com"]
    if provider == "google":
        assert asked["q"].endswith(" -site:pinterest.com")


def test_an_allow_list_keeps_only_those_domains(settings, fake_model, fake_search):
    fake_search.extra[:] = OTHER_WEB
    with api(settings, "searxng") as client:
        completion = ask(client, search_domain_filter=["arxiv.org", "news.example"])
    assert urls(completion) == [r["url"] for r in OTHER_WEB[1:]]


@pytest.mark.parametrize(
    ("provider", "field", "expected"),
    [
        ("tavily", "time_range", "week"),
        ("searxng", "time_range", "week"),
        ("google", "dateRestrict", "w1"),
    ],
)
def test_recency_reaches_the_provider(settings, fake_model, fake_search, provider, field, expected):
    with api(settings, provider) as client:
        ask(client, search_recency_filter="week")
    (_, asked), *_ = fake_search.requests
    assert asked[field] == expected


def test_dates_reach_tavily_and_google_and_filter_dated_results(settings, fake_model, fake_search):
    fake_search.extra[:] = OTHER_WEB
    after = (TODAY - timedelta(days=30)).strftime("%-m/%-d/%Y")  # as Perplexity writes them
    with api(settings, "tavily") as client:
        completion = ask(
            client, search_after_date_filter=after, search_before_date_filter="2099-01-01"
        )
    (_, asked), *_ = fake_search.requests
    assert asked["start_date"] == (TODAY - timedelta(days=30)).isoformat()
    assert asked["end_date"] == "2099-01-01"
    found = urls(completion)
    assert "https://news.example/old" not in found and "https://news.example/fresh" in found
    fresh = next(r for r in completion.model_extra["search_results"] if r["title"] == "Fresh news")
    assert fresh["date"] == TODAY.isoformat() == fresh["last_updated"]
    fake_search.requests.clear()
    with api(settings, "google") as client:
        ask(client, search_after_date_filter="2026-01-02")
    (_, asked), *_ = fake_search.requests
    assert asked["sort"] == "date:r:20260102:99991231"


async def test_a_filter_the_provider_cannot_apply_is_said(client, fake_model, fake_search):
    fake_search.extra[:] = OTHER_WEB
    events = await sse_chat(
        client, chat_body(RELEVANT_QUESTION, focusMode="webSearch", search={"recency": "hour"})
    )
    progress = [e.data["data"] for e in events if e.type == "progress"]
    assert any("cannot filter by date" in p and "without a date kept" in p for p in progress)
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert "https://news.example/old" not in [s["metadata"]["url"] for s in sources]


async def test_bad_search_controls_are_refused(client):
    for search in ({"recency": "fortnight"}, {"domains": ["not a domain"]}, {"after": "soon"}):
        response = await client.post("/api/chat/sse", json=chat_body("q", search=search))
        assert response.status_code == 400 and response.json()["key"] == "BAD_REQUEST"


def test_context_size_sets_how_much_is_searched(settings, fake_model, fake_search):
    with api(settings, "tavily") as client:
        ask(client, web_search_options={"search_context_size": "low"})
        ask(client, web_search_options={"search_context_size": "high"})
    assert [body["max_results"] for _, body in fake_search.requests] == [4, 12]


def test_images_related_questions_and_search_count(settings, fake_model, fake_search):
    with api(settings, "tavily") as client:
        completion = ask(client, return_images=True, return_related_questions=True)
        stream = client.chat.completions.create(
            model="webSearch",
            messages=[{"role": "user", "content": RELEVANT_QUESTION}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_related_questions": True},
        )
        chunks = list(stream)
    extra = completion.model_extra
    assert extra["images"][0]["image_url"] == fake_search.image_url(0)
    assert extra["images"][0]["origin_url"]
    assert extra["related_questions"][0] == "What is next?"
    assert completion.usage.model_extra["num_search_queries"] == 1
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.model_extra["related_questions"][0] == "What is next?"
    assert len(last.model_extra["citations"]) == 8  # the last chunk repeats them
    assert chunks[-1].usage.model_extra["num_search_queries"] == 1


def test_disable_search_and_academic_mode(settings, fake_model, fake_search):
    with api(settings, "tavily") as client:
        ask(client, disable_search=True)
        assert fake_search.requests == []
        ask(client, search_mode="academic")
    (_, asked), *_ = fake_search.requests
    assert "arxiv.org" in asked["include_domains"]


def test_the_responses_api_takes_them_as_a_web_search_tool(settings, fake_model, fake_search):
    fake_search.extra[:] = OTHER_WEB
    with api(settings, "searxng") as client:
        response = client.responses.create(
            model="webSearch",
            input=RELEVANT_QUESTION,
            tools=[{"type": "web_search", "filters": {"allowed_domains": ["arxiv.org"]}}],
            extra_body={"search_recency_filter": "month"},
        )
    (_, asked), *_ = fake_search.requests
    assert asked["time_range"] == "month"
    assert [r["url"] for r in response.model_extra["search_results"]] == [OTHER_WEB[1]["url"]]
    assert response.usage.model_extra["num_search_queries"] == 1


def test_the_native_request_takes_the_same_controls(settings, fake_model, fake_search):
    fake_search.extra[:] = OTHER_WEB
    with serve(create_app(settings)) as server:
        body = chat_body(
            RELEVANT_QUESTION,
            focusMode="webSearch",
            search={"domains": ["-pinterest.com"], "recency": "day"},
        )
        with httpx.stream("POST", server.url + "/api/chat/sse", json=body, timeout=10) as response:
            text = "".join(response.iter_text())
    (_, asked), *_ = fake_search.requests
    assert asked["exclude_domains"] == ["pinterest.com"] and asked["time_range"] == "day"
    assert "pinterest.com/pin" not in text


async def test_deep_research_keeps_its_searches_to_the_filters(client, fake_model, fake_search):
    body = chat_body(RELEVANT_QUESTION, focusMode="deepResearch", search={"recency": "year"})
    await sse_chat(client, body)
    assert fake_search.requests
    assert all(asked["time_range"] == "year" for _, asked in fake_search.requests)
