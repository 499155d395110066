"""Share links and exports (PROTOCOL §15): snapshots under a random link that anyone may
read without signing in, taken back at once on every process; exports for the owner;
pages that run no script whatever the chat holds."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest

from app.main import create_app
from app.store import Chat, ShareRecord, StoredMessage, open_store
from tests.client import chat_body, sse_chat, wait_for
from tests.identity import browser, question, sign_up
from tests.servers import chromium, processes, serve

anyio = pytest.mark.anyio

HOSTILE_QUESTION = 'hi <script>alert("q")</script><img src=x onerror="alert(2)" id=evil>'
HOSTILE_ANSWER = (
    "Raw <script>alert(3)</script> and <img src=x onerror=alert(4) id=evil2> here.\n\n"
    "A [bad link](javascript:alert(5)) and a [good one](https://example.org/ok).\n\n"
    "<iframe id=evil3 src=javascript:alert(6)></iframe>"
)
HOSTILE_SOURCES = [
    {"title": "evil source", "url": "javascript:alert(7)", "snippet": "x"},
    {"title": "tabbed <b id=evil4>", "url": "java\tscript:alert(8)", "snippet": "x"},
]


async def ask(
    http: httpx.AsyncClient, chat_id: str, text: str, user: str | None = "1", **fields: Any
) -> None:
    """Ask in a chat (as `user` with auth off; as the credential's user with None) and
    wait for its title, made in the background."""
    body = question(text, chatId=chat_id, **fields)
    params = {}
    if user is not None:
        body["userId"] = params["userId"] = user
    await sse_chat(http, body)

    async def titled() -> bool:
        chat = (await http.get(f"/api/chats/{chat_id}", params=params)).json()
        return chat["chat"]["title"] != text

    await wait_for(titled)


async def share(http: httpx.AsyncClient, chat_id: str, **body: Any) -> dict[str, str]:
    response = await http.post(f"/api/chats/{chat_id}/share", json=body)
    assert response.status_code == 201, response.text
    link: dict[str, str] = response.json()
    return link


def path_of(url: str) -> str:
    return "/" + url.split("/", 3)[3]


@anyio
async def test_a_shared_chat_is_a_page_anyone_may_read_without_signing_in(
    client, fake_model, fake_search
):
    await ask(client, "71", "what is rust", focusMode="webSearch")
    link = await share(client, "71", userId="1")
    assert re.fullmatch(r"[A-Za-z0-9_-]{32}", link["shareId"])  # 192 random bits
    assert link["url"] == f"{client.base_url}/s/{link['shareId']}"
    async with httpx.AsyncClient(base_url=str(client.base_url), timeout=10) as anyone:
        page = await anyone.get(path_of(link["url"]))
        as_json = await anyone.get(path_of(link["url"]), headers={"accept": "application/json"})
        dot_json = await anyone.get(path_of(link["url"]) + ".json")
        markdown = await anyone.get(path_of(link["url"]) + ".md")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<h2>what is rust</h2>" in page.text
    assert "tok0 tok1 tok2" in page.text
    assert re.search(r'<li><a href="http://127\.0\.0\.1:\d+/pages/0"', page.text)
    assert re.search(r'<time datetime="\d{4}-\d\d-\d\dT[^"]+Z">\d{4}-\d\d-\d\d</time>', page.text)
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp
    assert "frame-ancestors 'none'" in csp
    assert page.headers["x-robots-tag"] == "noindex"
    assert '<meta name="robots" content="noindex">' in page.text
    assert '<meta property="og:title" content="Fake Chat Title">' in page.text
    assert '<meta property="og:description" content="tok0 tok1 tok2 tok3 tok4">' in page.text
    assert "Shared by" not in page.text

    assert as_json.json() == dot_json.json()
    shown = dot_json.json()
    owned = (await client.get("/api/chats/71")).json()
    assert "userId" not in shown["chat"]
    del owned["chat"]["userId"]
    assert shown == owned
    assert markdown.headers["content-type"].startswith("text/markdown")
    text = markdown.text
    assert text.startswith("# Fake Chat Title\n\n## what is rust\n\ntok0 tok1 tok2 tok3 tok4\n")
    assert re.search(r"\n1\. \[Result 0: [^\]]+\]\(http://127\.0\.0\.1:\d+/pages/0\)\n", text)


@anyio
async def test_a_share_is_a_snapshot_refreshed_under_the_same_link(client, fake_model):
    await ask(client, "72", "first question")
    link = await share(client, "72", userId="1")
    await sse_chat(client, chat_body("second question", chatId="72"))
    page = await client.get(path_of(link["url"]))
    assert "first question" in page.text and "second question" not in page.text
    (listed,) = (await client.get("/api/shares")).json()["shares"]
    await asyncio.sleep(0.01)  # so that the refresh is later than the share, to the millisecond
    again = await share(client, "72", userId="1")
    assert again == link
    page = await client.get(path_of(link["url"]))
    assert "first question" in page.text and "second question" in page.text
    (relisted,) = (await client.get("/api/shares")).json()["shares"]
    assert relisted["shareId"] == listed["shareId"] == link["shareId"]
    assert (relisted["chatId"], relisted["title"], relisted["url"]) == (
        "72",
        "Fake Chat Title",
        link["url"],
    )
    assert relisted["createdAt"] == listed["createdAt"] < relisted["updatedAt"]


@anyio
async def test_a_link_taken_back_or_of_a_deleted_chat_answers_404(client, fake_model):
    await ask(client, "73", "q")
    link = await share(client, "73", userId="1")
    assert (await client.delete("/api/chats/73/share")).status_code == 204
    gone = await client.get(path_of(link["url"]))
    assert gone.status_code == 404 and "not shared" in gone.text
    assert (await client.get(path_of(link["url"]) + ".json")).json()["key"] == "NOT_FOUND"
    assert (await client.get("/api/shares")).json() == {"shares": []}

    relinked = await share(client, "73", userId="1")
    assert relinked["shareId"] != link["shareId"]  # a link taken back stays dead
    assert (await client.get(path_of(relinked["url"]))).status_code == 200
    assert (await client.delete("/api/chats/73")).status_code == 200
    assert (await client.get(path_of(relinked["url"]))).status_code == 404
    assert (await client.get(path_of(relinked["url"]) + ".md")).status_code == 404
    assert (await client.get("/api/shares")).json() == {"shares": []}
    assert (await client.get("/s/not-a-share-id-at-all-000")).status_code == 404


@anyio
async def test_only_the_owner_shares_takes_back_lists_or_exports(client, fake_model):
    await ask(client, "74", "q")
    link = await share(client, "74", userId="1")
    other = {"userId": "2"}
    refused = [
        await client.post("/api/chats/74/share", json=other),
        await client.delete("/api/chats/74/share", params=other),
        await client.get("/api/chats/74/export", params=other),
    ]
    assert [r.status_code for r in refused] == [403, 403, 403]
    assert {r.json()["key"] for r in refused} == {"FORBIDDEN"}
    assert (await client.get("/api/shares", params=other)).json() == {"shares": []}
    assert (await client.post("/api/chats/75/share", json={"userId": "1"})).status_code == 404
    assert (await client.get(path_of(link["url"]))).status_code == 200  # still shared


@anyio
async def test_exports_in_each_format_as_attachments(client, fake_model, fake_search):
    fake_model.replies[:] = [("Write a title", "Über Straße: 1/2")]
    await ask(client, "76", "what is rust", focusMode="webSearch")
    md = await client.get("/api/chats/76/export", params={"format": "md"})
    as_json = await client.get("/api/chats/76/export", params={"format": "json"})
    page = await client.get("/api/chats/76/export", params={"format": "html"})
    assert (await client.get("/api/chats/76/export", params={"format": "doc"})).status_code == 400

    disposition = md.headers["content-disposition"]
    assert disposition.startswith('attachment; filename="ber Stra_e_ 1_2.md"')
    assert "filename*=UTF-8''%C3%9Cber%20Stra%C3%9Fe_%201_2.md" in disposition
    assert md.headers["content-type"].startswith("text/markdown")
    assert md.text.startswith("# Über Straße: 1/2\n\n## what is rust\n\ntok0 tok1")
    assert "\nSources:\n\n1. [Result 0" in md.text

    assert as_json.headers["content-disposition"].startswith('attachment; filename="ber')
    assert '.json"' in as_json.headers["content-disposition"]
    assert as_json.json() == (await client.get("/api/chats/76")).json()

    assert '.html"' in page.headers["content-disposition"]
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src" not in page.headers["content-security-policy"]
    assert "<h2>what is rust</h2>" in page.text and "<h1>Über Straße: 1/2</h1>" in page.text
    assert (await client.get("/api/shares")).json() == {"shares": []}  # exporting shares nothing


@anyio
async def test_share_settings_turn_links_off_or_let_pages_be_indexed(settings, fake_model):
    for changes, shared, indexed in (
        ({"enabled": False}, False, False),
        ({"indexable": True}, True, True),
    ):
        with serve(create_app(settings.replace(share=changes))) as running:
            async with httpx.AsyncClient(base_url=running.url, timeout=10) as http:
                await ask(http, "77", "q")
                made = await http.post("/api/chats/77/share", json={"userId": "1"})
                listed = await http.get("/api/shares", params={"userId": "1"})
                exported = await http.get("/api/chats/77/export", params={"userId": "1"})
                assert exported.status_code == 200
                if not shared:
                    assert (made.status_code, listed.status_code) == (404, 404)
                    continue
                page = await http.get(path_of(made.json()["url"]))
                assert ("x-robots-tag" in page.headers) is not indexed
                assert ("noindex" in page.text) is not indexed


@anyio
async def test_with_keys_the_keys_user_shares_and_the_link_needs_no_key(settings, fake_model):
    keyed = settings.replace(
        auth={"api_keys": {"key-a": "alice", "key-b": "bob"}},
        server={"public_url": "https://chat.example.org/"},
    )
    with serve(create_app(keyed)) as running:
        async with (
            httpx.AsyncClient(
                base_url=running.url, timeout=10, headers={"authorization": "Bearer key-a"}
            ) as alice,
            httpx.AsyncClient(
                base_url=running.url, timeout=10, headers={"authorization": "Bearer key-b"}
            ) as bob,
            httpx.AsyncClient(base_url=running.url, timeout=10) as anyone,
        ):
            await ask(alice, "78", "q", user=None)
            assert (await anyone.post("/api/chats/78/share")).status_code == 401
            assert (await bob.post("/api/chats/78/share")).status_code == 403
            link = await share(alice, "78")
            assert link["url"] == f"https://chat.example.org/s/{link['shareId']}"
            assert (await anyone.get("/api/shares")).status_code == 401
            assert (await bob.get("/api/shares")).json() == {"shares": []}
            assert len((await alice.get("/api/shares")).json()["shares"]) == 1
            assert (await anyone.get(path_of(link["url"]))).status_code == 200
            assert (await bob.delete("/api/chats/78/share")).status_code == 403
            assert (await alice.get("/api/chats/78/export")).status_code == 200
            assert (await alice.delete("/api/chats/78/share")).status_code == 204
            assert (await anyone.get(path_of(link["url"]))).status_code == 404


@anyio
async def test_with_accounts_a_page_names_its_owner_only_as_they_chose(settings, fake_model):
    with serve(create_app(settings.replace(auth={"mode": "accounts"}))) as running:
        async with (
            browser(running.url) as alice,
            browser(running.url) as mallory,
            httpx.AsyncClient(base_url=running.url, timeout=10) as anyone,
        ):
            await sign_up(alice, "alice@example.org", name="Alice Liddell")
            await sign_up(mallory, "mallory@example.org")
            await ask(alice, "79", "q", user=None)
            assert (await mallory.post("/api/chats/79/share", json={})).status_code == 403
            assert (await mallory.get("/api/chats/79/export")).status_code == 403
            link = await share(alice, "79")
            page = await anyone.get(path_of(link["url"]))
            assert page.status_code == 200
            assert "Alice" not in page.text and "alice@" not in page.text
            assert "alice" not in (await anyone.get(path_of(link["url"]) + ".json")).text
            named = await share(alice, "79", displayName="  the   White Rabbit ")
            assert named == link
            page = await anyone.get(path_of(link["url"]))
            assert "Shared by the White Rabbit" in page.text and "alice@" not in page.text
            too_long = await alice.post("/api/chats/79/share", json={"displayName": "x" * 81})
            assert too_long.status_code == 400
            assert (await mallory.delete("/api/chats/79/share")).status_code == 403
            assert (await alice.delete("/api/chats/79/share")).status_code == 204


@anyio
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_link_taken_back_is_gone_on_the_other_process_at_once(
    request, backend, tmp_path, model_url, fake_search
):
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-chat",
        "STORE_URL": (
            f"sqlite:///{tmp_path}/chat.db"
            if backend == "sqlite"
            else request.getfixturevalue("postgres_url")
        ),
        "COLLECTIONS_URL": f"tantivy:///{tmp_path}/collections",
        "SEARCH_PROVIDER": "tavily",
        "TAVILY_API_KEY": fake_search.api_key,
        "TAVILY_BASE_URL": fake_search.base_url + "/tavily",
    }
    with processes(2, env) as (a, b):
        async with httpx.AsyncClient(base_url=a.url, timeout=20) as http:
            await sse_chat(http, chat_body("q", chatId="80"))
            made = await http.post(a.url + "/api/chats/80/share", json={"userId": "1"})
            assert made.status_code == 201, made.text
            on_b = b.url + "/s/" + made.json()["shareId"]
            assert (await http.get(on_b)).status_code == 200
            taken_back = await http.delete(a.url + "/api/chats/80/share?userId=1")
            assert taken_back.status_code == 204
            assert (await http.get(on_b)).status_code == 404
            assert (await http.get(on_b + ".json")).status_code == 404


def test_a_hostile_chat_runs_no_script_on_its_shared_page(server, fake_model, fake_search):
    fake_model.answer_text = HOSTILE_ANSWER
    fake_search.extra[:] = HOSTILE_SOURCES
    with httpx.Client(base_url=server.url, timeout=20) as http:
        body = chat_body(HOSTILE_QUESTION, chatId="81", focusMode="webSearch")
        with http.stream("POST", "/api/chat/sse", json=body) as response:
            assert response.status_code == 200
            response.read()
        made = http.post("/api/chats/81/share", json={"userId": "1"})
        assert made.status_code == 201, made.text
        url = made.json()["url"]
        raw = http.get(url).text
    i = raw.find("<script")
    assert i < 0, raw[i - 300 : i + 100]
    hrefs = re.findall(r'href="([^"]*)"', raw)
    assert hrefs and all(h.startswith(("http://", "https://")) for h in hrefs)
    with chromium() as launched:
        for scripts in (True, False):
            context = launched.new_context(java_script_enabled=scripts)
            page = context.new_page()
            dialogs: list[str] = []
            page.on(
                "dialog",
                lambda dialog, seen=dialogs: (seen.append(dialog.message), dialog.dismiss()),
            )
            page.goto(url)
            page.wait_for_load_state("load")
            text = page.inner_text("body")
            assert HOSTILE_QUESTION in text  # shown as the text it is
            assert "good one" in text and "evil source" in text
            assert page.locator("h2").count() == 1
            assert page.locator("a[href='https://example.org/ok']").count() == 1
            if scripts:
                injected = page.evaluate(
                    "() => ['evil', 'evil2', 'evil3', 'evil4']"
                    ".filter((id) => document.getElementById(id))"
                    ".concat([...document.querySelectorAll('script, iframe, img')]"
                    ".map((e) => e.tagName))"
                )
                assert injected == []
            assert dialogs == []
            context.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path}/store.db"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    async with open_store(url) as opened:
        yield opened


@anyio
async def test_the_store_keeps_one_share_per_chat_and_drops_it_with_the_chat(store):
    chat = Chat("c1", "u1", "title", "webSearch", 1.0)
    q = StoredMessage("m1", "c1", "user", "q", 1.0)
    a = StoredMessage("m2", "c1", "assistant", "", 1.0, status="streaming", reply_to="m1")
    await store.begin_answer(chat, q, a)
    first = await store.put_share(
        ShareRecord("s1", "c1", "u1", "title", 2.0, 2.0, snapshot={"chat": {"n": 1}})
    )
    assert (first.id, first.created_at, first.snapshot) == ("s1", 2.0, {"chat": {"n": 1}})
    again = await store.put_share(
        ShareRecord("s2", "c1", "u1", "new", 3.0, 3.0, "Al", snapshot={"chat": {"n": 2}})
    )
    assert (again.id, again.title, again.display_name) == ("s1", "new", "Al")
    assert (again.created_at, again.updated_at) == (2.0, 3.0)
    stored = await store.get_share("s1")
    assert stored is not None and stored.snapshot == {"chat": {"n": 2}}
    assert await store.get_share("s2") is None
    (listed,) = await store.list_shares("u1")
    assert (listed.id, listed.snapshot) == ("s1", None)
    assert await store.list_shares("u2") == []
    assert await store.delete_share("c1") and not await store.delete_share("c1")
    await store.put_share(ShareRecord("s3", "c1", "u1", "t", 4.0, 4.0, snapshot={}))
    assert await store.delete_chat("c1")
    assert await store.get_share("s3") is None and await store.list_shares("u1") == []


def test_the_web_client_shares_copies_lists_takes_back_and_exports(server, fake_model):
    errors: list[str] = []
    with chromium() as launched:
        context = launched.new_context(accept_downloads=True)
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(server.url + "/")
        page.select_option("#focus", "deepSeek")
        page.fill("#question", "what is rust")
        page.click("#send")
        page.wait_for_selector(".turn[data-state=completed]", state="attached", timeout=15_000)
        page.click("#open-share")
        page.click("#share-create")
        page.wait_for_selector("#share-link:not([hidden])")
        url = page.input_value("#share-url")
        assert re.fullmatch(re.escape(server.url) + r"/s/[A-Za-z0-9_-]{32}", url)
        assert page.evaluate("() => navigator.clipboard.readText()") == url
        assert "copied" in page.inner_text("#share-notice")
        page.wait_for_selector("#share-list a")
        assert page.get_attribute("#share-list a", "href") == url
        with page.expect_download() as downloaded:
            page.click("#share-dialog [data-format=md]")
        assert downloaded.value.suggested_filename.endswith(".md")
        with open(downloaded.value.path(), encoding="utf-8") as saved:
            assert "## what is rust" in saved.read()
        shared = httpx.get(url, timeout=10)
        assert shared.status_code == 200 and "what is rust" in shared.text
        page.click("#share-list button:text('Unshare')")
        page.wait_for_selector("#share-list li.hint")
        assert "no chat" in page.inner_text("#share-list")
        assert httpx.get(url, timeout=10).status_code == 404
        context.close()
    assert errors == []
