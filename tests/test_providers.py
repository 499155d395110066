"""Models chosen per chat (PROTOCOL §13, §1 `chatModel`): a second OpenAI-compatible
fake and a fake of Anthropic's Messages API beside the default fake, each a real
server on loopback that records what it was asked."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws
from openai import AsyncOpenAI

from app.config import ProviderSettings, Settings, load
from app.main import create_app
from app.model.anthropic import AnthropicModel
from app.model.providers import provider_llm
from tests.client import answer_of, chat_body, reasoning_of, sse_chat
from tests.conftest import USER
from tests.fakes.anthropic import FakeAnthropic
from tests.fakes.model import FakeModel, short_call
from tests.identity import browser, question, sign_up
from tests.servers import ServerThread, chromium, serve

pytestmark = pytest.mark.anyio

LONG = "how do the engines of the falcon rocket burn their methane fuel?"


@pytest.fixture(scope="session")
def second_server() -> Iterator[tuple[FakeModel, ServerThread]]:
    model = FakeModel(api_key="second-key", models=["other-chat", "other-small"])
    with serve(model.app()) as server:
        yield model, server


@pytest.fixture
def second(second_server):
    model, _ = second_server
    model.reset()
    return model


@pytest.fixture(scope="session")
def anthropic_server() -> Iterator[tuple[FakeAnthropic, ServerThread]]:
    fake = FakeAnthropic()
    with serve(fake.app()) as server:
        yield fake, server


@pytest.fixture
def claude(anthropic_server):
    fake, _ = anthropic_server
    fake.reset()
    return fake


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def providers(settings, second, second_server, claude, anthropic_server):
    return settings.replace(
        providers={
            "second": {
                "base_url": second_server[1].url + "/v1",
                "api_key": "second-key",
                "small_model": "other-small",
                "name": "Second",
            },
            "claude": {
                "type": "anthropic",
                "base_url": anthropic_server[1].url,
                "api_key": "anthropic-key",
                "max_output_tokens": 2000,
                "thinking_tokens": 1024,
            },
            "down": {
                "base_url": f"http://127.0.0.1:{closed_port()}/v1",
                "api_key": "k",
                "models": ["gone-model"],
            },
        }
    )


@pytest.fixture
def server(providers):
    with serve(create_app(providers)) as running:
        yield running


@pytest.fixture
async def client(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:
        await http.get("/api/providers")  # the first listing done
        yield http


def other(model: str = "other-chat") -> dict[str, str]:
    return {"provider": "second", "model": model}


async def test_providers_are_listed_with_a_down_one_unreachable(client):
    listed = (await client.get("/api/providers")).json()
    assert listed["default"] == {"provider": "default", "model": "fake-chat"}
    by_id = {p["id"]: p for p in listed["providers"]}
    assert list(by_id) == ["default", "second", "claude", "down"]
    assert by_id["second"]["status"] == "ok" and by_id["second"]["name"] == "Second"
    assert [m["id"] for m in by_id["second"]["models"]] == ["other-chat", "other-small"]
    assert [m["id"] for m in by_id["claude"]["models"]] == ["claude-test", "claude-small"]
    assert by_id["down"]["status"] == "unreachable" and by_id["down"]["error"]
    assert by_id["claude"]["models"][0]["reasoning"] is True  # it is given thinking tokens
    assert by_id["second"]["models"][0]["reasoning"] is None
    assert set(by_id["claude"]["models"][0]) == {
        "id",
        "name",
        "contextTokens",
        "tools",
        "reasoning",
    }
    text = orjson.dumps(listed).decode()
    assert "second-key" not in text and "anthropic-key" not in text and "127.0.0.1" not in text
    # a chat on a provider that is up is not held up by the one that is down
    events = await sse_chat(client, chat_body("hi", chatModel=other()))
    assert events[-1].data["status"] == "completed"


async def test_sse_answer_by_the_chosen_model_and_its_small_model(client, fake_model, second):
    body = chat_body(LONG, chatModel=other(), focusMode="webSearch", optimizationMode="balanced")
    events = await sse_chat(client, body)
    end = events[-1].data
    assert end["type"] == "messageEnd" and end["chatModel"] == other()
    (asked,) = second.streamed_requests()
    assert asked["model"] == "other-chat"
    assert fake_model.streamed_requests() == []
    small = [r["model"] for r in second.requests if short_call(r)]
    assert small and set(small) == {"other-small"}
    assert not [r for r in fake_model.requests if "messages" in r]
    chat = (await client.get(f"/api/chats/{events[-1].data['chatId']}")).json()
    answer = chat["messages"][-1]
    assert orjson.loads(answer["metadata"])["chatModel"] == other()


async def test_websocket_and_vane_names(server, second):
    async with aconnect_ws(server.ws_url + "/api/chat/ws") as ws:
        assert orjson.loads(await ws.receive_text())["data"] == "open"
        vane = {"providerId": "second", "key": "other-small"}
        await ws.send_text(orjson.dumps(chat_body("hi there", chatModel=vane)).decode())
        while True:
            frame = orjson.loads(await ws.receive_text())
            if frame["type"] in ("messageEnd", "error"):
                break
    assert frame["chatModel"] == {"provider": "second", "model": "other-small"}
    assert second.streamed_requests()[-1]["model"] == "other-small"


async def test_unknown_provider_or_model_is_a_bad_request_naming_what_exists(client):
    response = await client.post("/api/chat/sse", json=chat_body("hi", chatModel=other("nope")))
    assert response.status_code == 400
    assert "other-chat" in response.json()["data"] and "nope" in response.json()["data"]
    response = await client.post(
        "/api/chat/sse", json=chat_body("hi", chatModel={"provider": "x", "model": "y"})
    )
    assert response.status_code == 400 and "second" in response.json()["data"]
    response = await client.post("/api/chat/sse", json=chat_body("hi", chatModel="second"))
    assert response.status_code == 400
    # a model alone is the default's: one it does not have is refused too
    response = await client.post("/api/chat/sse", json=chat_body("hi", chatModel={"model": "x"}))
    assert response.status_code == 400 and "fake-chat" in response.json()["data"]


async def test_suggestions_come_from_the_chosen_models_provider(client, fake_model, second):
    history = [["human", "what is methane?"], ["assistant", "a gas"]]
    body = {"history": history, "chatModel": other()}
    assert (await client.post("/api/suggestions", json=body)).status_code == 200
    assert [r["model"] for r in second.requests] == ["other-small"]
    # a provider the server does not have (the Perplexica UI's own names): the default's
    body = {"history": history, "chatModel": {"provider": "openai", "model": "gpt-4o"}}
    assert (await client.post("/api/suggestions", json=body)).status_code == 200
    assert [r["model"] for r in fake_model.requests] == ["fake-small"]


async def test_without_providers_a_model_the_default_lacks_is_refused(settings, fake_model):
    with serve(create_app(settings)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            body = chat_body("hi", chatModel={"model": "gpt-x"})
            response = await http.post("/api/chat/sse", json=body)
            assert response.status_code == 400 and "fake-chat" in response.json()["data"]
            small = chat_body("hi", chatModel={"provider": "default", "model": "fake-small"})
            events = await sse_chat(http, small)
    assert events[-1].data["chatModel"] == {"provider": "default", "model": "fake-small"}
    assert fake_model.streamed_requests()[-1]["model"] == "fake-small"


async def test_regenerate_with_another_model(client, fake_model, second):
    first = await sse_chat(client, chat_body("hi", chatId="c1", messageId="q1"))
    assert first[-1].data["chatModel"] == {"provider": "default", "model": "fake-chat"}
    assert fake_model.streamed_requests()[-1]["model"] == "fake-chat"
    again = await sse_chat(client, chat_body("hi", chatId="c1", messageId="q1", chatModel=other()))
    assert again[-1].data["chatModel"] == other()
    assert second.streamed_requests()[-1]["model"] == "other-chat"
    messages = (await client.get("/api/chats/c1")).json()["messages"]
    assert [orjson.loads(m["metadata"]).get("chatModel") for m in messages] == [None, other()]


async def test_v1_chat_completions_and_responses_name_a_provider(server, second, claude):
    openai = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    listed = [m.id for m in (await openai.models.list()).data]
    assert "webSearch@second/other-chat" in listed and "deepSeek@claude/claude-test" in listed
    assert "deepSeek" in listed
    completion = await openai.chat.completions.create(
        model="@second/other-chat", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content
    assert second.streamed_requests()[-1]["model"] == "other-chat"
    response = await openai.responses.create(model="deepSeek@claude/claude-test", input="hello")
    assert response.status == "completed"
    assert "Claude says hello." in response.output_text
    assert claude.streamed()[-1]["model"] == "claude-test"
    await openai.close()


async def test_anthropic_thinking_is_reasoning_and_the_usage_counted(client, claude):
    chosen = {"provider": "claude", "model": "claude-test"}
    events = await sse_chat(client, chat_body("hello claude", chatModel=chosen))
    assert answer_of(events).strip() == "Claude says hello."
    assert reasoning_of(events).strip() == "Let me weigh this."
    end = events[-1].data
    assert end["chatModel"] == chosen and end["usage"]["completion_tokens"] == 9
    asked = claude.streamed()[-1]
    assert asked["max_tokens"] == 2000 and asked["system"]
    assert asked["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert [m["role"] for m in asked["messages"]] == ["user"]


async def test_anthropic_tool_use_drives_a_research_round(client, claude, fake_search):
    claude.tool_rounds[:] = [[("web_search", {"query": "raptor methane"})]]
    chosen = {"provider": "claude", "model": "claude-test"}
    body = chat_body(LONG, chatModel=chosen, focusMode="webSearch", optimizationMode="balanced")
    events = await sse_chat(client, body)
    assert events[-1].data["status"] == "completed"
    assert "raptor methane" in [q for _, q in fake_search.queries]
    with_tools = [r for r in claude.requests if r.get("tools")]
    assert with_tools[0]["tools"][0]["input_schema"]["type"] == "object"
    assert not [r for r in with_tools if "thinking" in r]  # a tool turn does not think
    # the second round sends the first one's call back, and what it found
    assert len(with_tools) >= 2
    turns = with_tools[1]["messages"]
    assert any(b["type"] == "tool_use" for m in turns for b in m["content"])
    results = [b for m in turns for b in m["content"] if b["type"] == "tool_result"]
    assert results and results[0]["tool_use_id"] == "toolu_0"


async def test_a_provider_that_is_down_ends_the_chat_naming_it_and_no_key(client):
    chosen = {"provider": "down", "model": "gone-model"}
    events = await sse_chat(client, chat_body("hi", chatModel=chosen))
    error = events[-1].data
    assert error["type"] == "error" and error["key"] == "CHAT_ERROR"
    assert "down" in error["data"] and "gone-model" in error["data"]
    assert "127.0.0.1" not in error["data"]


async def test_anthropic_stream_cut_at_its_cap_says_finish_length(anthropic_server, claude):
    fake, running = anthropic_server
    llm = provider_llm(
        Settings().llm,
        ProviderSettings(type="anthropic", base_url=running.url, api_key=fake.api_key),
    )
    model = AnthropicModel(llm, "claude")
    try:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "#cut"}]
        deltas = [d async for d in model.stream(messages, model="claude-test")]
    finally:
        await model.aclose()
    assert [d.kind for d in deltas][-2:] == ["usage", "finish"] and deltas[-1].text == "length"
    assert claude.streamed()[-1]["system"] == "be brief"
    assert claude.streamed()[-1]["max_tokens"] == Settings().llm.max_output_tokens


async def test_admin_only_providers_are_for_admins(providers):
    settings = providers.replace(
        auth={"mode": "accounts"},
        providers={**providers.providers, "secret": {**_keys(providers), "admin_only": True}},
    )
    with serve(create_app(settings)) as server:
        async with browser(server.url) as admin, browser(server.url) as user:
            await sign_up(admin, "admin@example.test")
            await sign_up(user, "user@example.test")
            seen = (await admin.get("/api/providers")).json()["providers"]
            assert "secret" in [p["id"] for p in seen]
            hidden = (await user.get("/api/providers")).json()["providers"]
            assert "secret" not in [p["id"] for p in hidden]
            assert "secret" not in (await user.get("/api/models")).json()["chatModelProviders"]
            chosen = {"provider": "secret", "model": "other-chat"}
            refused = await user.post("/api/chat/sse", json=question("hi", chatModel=chosen))
            assert refused.status_code == 400 and "secret" not in refused.json()["data"][-40:]
            events = await sse_chat(admin, question("hi", chatModel=chosen))
            assert events[-1].data["chatModel"] == chosen


def _keys(settings) -> dict[str, object]:
    second = settings.providers["second"]
    return {"base_url": second.base_url, "api_key": second.api_key}


async def test_perplexica_models_lists_every_provider(client):
    models = (await client.get("/api/models")).json()["chatModelProviders"]
    assert set(models["second"]) == {"other-chat", "other-small"}
    assert set(models["claude"]) == {"claude-test", "claude-small"}
    assert any("fake-chat" in listed for listed in models.values())
    # the settings page reads the same, and may send it back unchanged
    config = (await client.get("/api/config")).json()
    assert [m["name"] for m in config["chatModelProviders"]["second"]] == [
        "other-chat",
        "other-small",
    ]
    saved = await client.post("/api/config", json={**config, "chatModel": "other-chat"})
    assert saved.status_code == 200


def test_providers_load_from_toml_and_env_without_showing_keys(tmp_path):
    file = tmp_path / "config.toml"
    file.write_text(
        '[providers.openrouter]\nbase_url = "https://openrouter.ai/api/v1"\n'
        'api_key = "sk-or-secret"\nmodels = ["deepseek/deepseek-r1"]\n'
    )
    env = {"PROVIDERS_LOCAL_BASE_URL": "http://127.0.0.1:8081/v1", "PROVIDERS_LOCAL_API_KEY": "x"}
    settings = load(file, env={**env, "PROVIDERS_OPENROUTER_ADMIN_ONLY": "true"})
    assert list(settings.providers) == ["openrouter", "local"]
    assert settings.providers["openrouter"].admin_only is True
    assert settings.providers["openrouter"].models == ("deepseek/deepseek-r1",)
    assert settings.providers["local"].base_url == "http://127.0.0.1:8081/v1"
    assert "sk-or-secret" not in repr(settings) and "openrouter.ai" not in repr(settings)
    file.write_text('[providers.default]\napi_key = "k"\n')
    with pytest.raises(ValueError, match="default"):
        load(file, env={})
    file.write_text('[providers.x]\ntype = "other"\n')
    with pytest.raises(ValueError, match="type"):
        load(file, env={})


def test_the_web_client_picks_a_model_keeps_it_and_shows_who_answered(providers, second):
    picked = '{"provider":"second","model":"other-chat"}'
    with chromium() as browser, serve(create_app(providers)) as server:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(server.url + "/")
        page.wait_for_selector("#model:not([hidden])", state="attached")
        groups = page.eval_on_selector_all("#model optgroup", "gs => gs.map(g => g.label)")
        assert groups[:2] == ["Default", "Second"] and "down (unreachable)" in groups
        page.select_option("#model", picked)
        page.select_option("#focus", "deepSeek")
        page.fill("#question", "hello there")
        page.click("#send")
        page.wait_for_selector(".turn .answered-by", timeout=15_000)
        assert page.text_content(".turn .answered-by") == "other-chat · second"
        assert second.streamed_requests()[-1]["model"] == "other-chat"
        page.reload()  # the chat again, from the store, and the choice kept
        page.wait_for_selector(".turn .answered-by", timeout=15_000)
        assert page.text_content(".turn .answered-by") == "other-chat · second"
        assert page.input_value("#model") == picked
        assert errors == []


async def test_models_say_whether_they_take_tools_as_listed_or_learned(
    providers, second, fake_model
):
    """`tools`: what a provider's model list says (OpenRouter's `supported_parameters`
    names every parameter a model takes), true on Anthropic's Messages API, and for a
    list that says nothing (the default's) null until a tool turn shows it."""
    second.listed[:] = [
        {"id": "other-chat", "object": "model", "supported_parameters": ["tools", "reasoning"]},
        {"id": "other-small", "object": "model", "supported_parameters": ["max_tokens"]},
    ]
    with serve(create_app(providers)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30, event_hooks=USER) as http:

            async def models() -> dict[tuple[str, str], dict[str, object]]:
                listed = (await http.get("/api/providers")).json()["providers"]
                return {(p["id"], m["id"]): m for p in listed for m in p["models"]}

            found = await models()
            assert found["second", "other-chat"]["tools"] is True
            assert found["second", "other-chat"]["reasoning"] is True
            assert found["second", "other-small"]["tools"] is False
            assert found["second", "other-small"]["reasoning"] is False
            assert found["claude", "claude-test"]["tools"] is True
            assert found["default", "fake-chat"]["tools"] is None  # not known yet

            fake_model.tool_rounds[:] = [[("web_search", {"query": "raptor methane"})]]
            body = chat_body(LONG, focusMode="webSearch", optimizationMode="balanced")
            events = await sse_chat(http, body)
            assert events[-1].data["status"] == "completed"
            assert fake_model.tool_requests()  # the answer ran a tool round
            assert (await models())["default", "fake-chat"]["tools"] is True

            fake_model.tools_refused = True
            body = chat_body(LONG + " again", focusMode="webSearch", optimizationMode="balanced")
            events = await sse_chat(http, body)
            assert events[-1].data["status"] == "completed"
            assert (await models())["default", "fake-chat"]["tools"] is False
