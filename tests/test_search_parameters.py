"""Perplexity's search parameters (PROTOCOL §10) and the chat request's `search` controls
(§1): what reaches each provider of the fake web, what is filtered afterwards, and the
response fields (`search_results` with dates, `images`, `related_questions`,
`usage.num_search_queries`), through the `openai` SDK and the chat API."""

from __future__ import annotations

import contextlib
from datetime import UTC, date, datetime, timedelta

import httpx
import openai
import pytest

from app.main import create_app
from app.results import SearchFilters
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
        with openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as client:
            yield client


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
    if provider in ("google", "searxng"):  # SearxNG's engines that know the operators
        assert asked["q"] == f"{RELEVANT_QUESTION} -site:pinterest.com"


def test_an_allow_list_keeps_only_those_domains(settings, fake_model, fake_search):
    fake_search.extra[:] = OTHER_WEB
    with api(settings, "searxng") as client:
        completion = ask(client, search_domain_filter=["arxiv.org", "news.example"])
    assert urls(completion) == [r["url"] for r in OTHER_WEB[1:]]
    (_, asked), *_ = fake_search.requests
    assert asked["q"] == f"{RELEVANT_QUESTION} (site:arxiv.org OR site:news.example)"


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
        completion = ask(client, search_after_date_filter="2026-01-02")
    (_, asked), *_ = fake_search.requests
    assert asked["sort"] == "date:r:20260102:99991231"
    # Google's dates are its pages' metatags
    fresh = next(r for r in completion.model_extra["search_results"] if r["title"] == "Fresh news")
    assert fresh["date"] == TODAY.isoformat() == fresh["last_updated"]


def _ago(**delta: float) -> str:
    return (datetime.now(UTC) - timedelta(**delta)).isoformat(timespec="seconds")


async def test_a_filter_the_provider_cannot_apply_is_said(client, fake_model, fake_search):
    fake_search.extra[:] = [
        *OTHER_WEB,
        {
            "title": "Earlier",
            "url": "https://news.example/earlier",
            "snippet": "",
            "date": _ago(minutes=90),
        },
        {
            "title": "Just now",
            "url": "https://news.example/now",
            "snippet": "",
            "date": _ago(minutes=10),
        },
    ]
    events = await sse_chat(
        client, chat_body(RELEVANT_QUESTION, focusMode="webSearch", search={"recency": "hour"})
    )
    notes = [e.data for e in events if e.type == "progress" and "cannot filter" in e.data["data"]]
    assert len(notes) == 1 and notes[0]["data"].endswith("results without a date kept")
    assert notes[0]["step"]["kind"] == "search" and notes[0]["step"]["note"] == notes[0]["data"]
    found = [
        s["metadata"]["url"] for s in next(e for e in events if e.type == "sources").data["data"]
    ]
    # an hour is an hour: a page of earlier today, more than an hour ago, is dropped
    assert "https://news.example/now" in found
    assert not {"https://news.example/old", "https://news.example/earlier"} & set(found)


def test_an_hour_is_checked_to_the_minute_where_a_date_has_a_time():
    at = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)
    hour = SearchFilters(recency="hour")
    assert hour.allows_date("2026-03-01T08:30:00Z", now=at) is False
    assert hour.allows_date("2026-03-01T09:30:00+00:00", now=at) is True
    assert hour.allows_date("2026-03-01T04:30:00-05:00", now=at) is True  # 09:30 UTC
    assert hour.allows_date("2026-03-01", now=at) is True  # a day only: it may be the hour
    assert hour.allows_date("2026-02-28", now=at) is False
    assert hour.allows_date("soon", now=at) is None
    dated = SearchFilters(after=date(2026, 3, 1), before=date(2026, 3, 1))
    assert dated.allows_date("2026-03-01T23:59:00Z", now=at) is True
    assert dated.allows_date("2026-03-02T00:01:00Z", now=at) is False


def test_a_filter_the_provider_cannot_apply_is_said_on_v1(settings, fake_model, fake_search):
    said = "Tavily cannot filter by date: 8 results without a date kept"
    with api(settings, "tavily") as client:
        completion = ask(client, search_recency_filter="hour")
        response = client.responses.create(
            model="webSearch", input=RELEVANT_QUESTION, extra_body={"search_recency_filter": "hour"}
        )
        stream = client.chat.completions.create(
            model="webSearch",
            messages=[{"role": "user", "content": RELEVANT_QUESTION}],
            stream=True,
            extra_body={"search_recency_filter": "hour"},
        )
        thought = "".join(
            c.choices[0].delta.model_extra.get("reasoning_content") or ""
            for c in stream
            if c.choices
        )
    assert completion.choices[0].message.model_extra["reasoning_content"] == said + "\nwhy0 why1 "
    assert said in thought
    assert [item.type for item in response.output] == [
        "web_search_call",
        "reasoning",
        "reasoning",
        "message",
    ]
    assert response.output[1].summary[0].text == said
    assert response.output[2].summary[0].text == "why0 why1 "


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
        fake_search.requests.clear()
        client.chat.completions.create(
            model="deepResearch",
            messages=[{"role": "user", "content": RELEVANT_QUESTION}],
            extra_body={"search_mode": "academic"},
        )
    assert fake_search.requests
    assert all("arxiv.org" in asked["include_domains"] for _, asked in fake_search.requests)


@pytest.mark.parametrize(
    ("model", "params", "said"),
    [
        ("deepResearch", {"disable_search": True}, "always searches"),
        ("redditSearch", {"search_mode": "academic"}, "searches other sources"),
        ("deepSeek", {"search_mode": "academic"}, "does not search"),
        ("webSearch", {"search_mode": "news"}, "web or academic"),
        ("webSearch", {"return_images": "yes"}, "true or false"),
    ],
)
def test_what_cannot_be_honoured_is_refused(settings, fake_model, model, params, said):
    with api(settings) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "q"}], extra_body=params
        )
    assert said in info.value.body["message"]


def test_null_is_absent(settings, fake_model, fake_search):
    nothing = {"return_images": None, "disable_search": None, "search_mode": None}
    with api(settings, "tavily") as client:
        completion = ask(client, **nothing, search_domain_filter=None)
        response = client.responses.create(
            model="webSearch", input=RELEVANT_QUESTION, extra_body=nothing
        )
    assert len(urls(completion)) == 8 and "images" not in completion.model_extra
    assert response.status == "completed" and len(fake_search.requests) == 2


@pytest.mark.parametrize(
    ("provider", "size"),
    [("searxng", {"width": 640, "height": 480}), ("google", {"width": 800, "height": 600})],
)
def test_images_on_the_responses_api_with_their_size(
    settings, fake_model, fake_search, provider, size
):
    with api(settings, provider) as client:
        response = client.responses.create(
            model="webSearch", input=RELEVANT_QUESTION, extra_body={"return_images": True}
        )
    first = response.model_extra["images"][0]
    assert first["image_url"] == fake_search.image_url(0)
    assert first["origin_url"] == f"{fake_search.base_url}/pages/0"
    assert {k: first[k] for k in ("width", "height")} == size


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
