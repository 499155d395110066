"""Knowledge collections through the real server (uvicorn, the embedded engine for real,
the fake model with its embeddings, the fake search and reader): import a zipped folder
tree of generated documents with known answers, ask it over SSE, WebSocket, /v1 and in
deepResearch, share it, refuse every kind of bad input by name, cancel a search."""

from __future__ import annotations

import asyncio
import io
import stat
import time
import zipfile
from pathlib import Path

import httpx
import orjson
import pytest
from fpdf import FPDF
from httpx_ws import aconnect_ws

from app.collections.base import Hit, Passage
from app.collections.retrieval import fuse
from app.config import RerankSettings
from app.main import create_app
from bench.corpus import generate
from tests.client import chat_body, iter_sse, sse_chat, wait_for
from tests.conftest import USER
from tests.fakes.rerank import FakeRerank
from tests.servers import serve

pytestmark = pytest.mark.anyio

DOCUMENTS, QUESTIONS = generate(300, pages=2, words_per_page=120)


def zip_of(files: dict[str, bytes], *, symlinks: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, target)
    return out.getvalue()


def pdf_of(text: str, password: str | None = None) -> bytes:
    pdf = FPDF()
    if password:
        pdf.set_encryption(owner_password="owner", user_password=password)
    pdf.set_font("Helvetica", size=12)
    pdf.add_page()
    pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


@pytest.fixture
def server(settings):
    """The server ranking by BM25 alone: the fake embeddings hash words into 64 buckets,
    so their ranking is noise (the fusion with real vectors is tested on its own)."""
    with serve(create_app(settings.replace(embeddings={"model": ""}))) as running:
        yield running


@pytest.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as client:
        yield client


async def create(http, name="handbooks", user="1"):
    response = await http.post("/api/collections", json={"name": name, "userId": user})
    assert response.status_code == 201, response.text
    return response.json()["collection"]


async def finished(http, collection_id, import_id, user="1", timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        progress = (
            await http.get(
                f"/api/collections/{collection_id}/imports/{import_id}", params={"userId": user}
            )
        ).json()
        if progress["done"] == progress["total"]:
            return progress
        await asyncio.sleep(0.1)
    raise AssertionError(f"import {import_id} did not finish: {progress}")


async def add(http, collection_id, files, user="1"):
    """POST files (name → bytes) and wait for the import to end; its progress."""
    response = await http.post(
        f"/api/collections/{collection_id}/documents",
        files=[("files", (name, data)) for name, data in files.items()],
        params={"userId": user},
    )
    assert response.status_code == 202, response.text
    return response.json(), await finished(http, collection_id, response.json()["import"]["id"])


async def search(http, collection_id, query, limit=10, user="1"):
    response = await http.post(
        f"/api/collections/{collection_id}/search",
        json={"query": query, "limit": limit, "userId": user},
    )
    assert response.status_code == 200, response.text
    return response.json()["results"]


@pytest.fixture
async def corpus(http):
    """A collection of the 300 generated documents, imported as one zipped folder tree."""
    collection = await create(http)
    archive = zip_of({d.title: d.text.encode() for d in DOCUMENTS})
    answer, progress = await add(http, collection["id"], {"reports.zip": archive})
    assert answer["import"]["documents"] == len(DOCUMENTS)
    assert progress == {"done": len(DOCUMENTS), "total": len(DOCUMENTS), "failed": []}
    return collection


async def test_a_zipped_folder_tree_becomes_documents_titled_by_their_paths_and_answers(
    http, corpus
):
    listed = (await http.get(f"/api/collections/{corpus['id']}/documents")).json()["documents"]
    assert sorted(d["title"] for d in listed) == sorted(d.title for d in DOCUMENTS)
    assert {d["status"] for d in listed} == {"ready"}
    assert all(d["chunks"] >= 1 for d in listed)
    got = (await http.get(f"/api/collections/{corpus['id']}")).json()["collection"]
    assert got["documents"] == 300 and got["chunks"] == sum(d["chunks"] for d in listed)
    by_title = {d["id"]: d["title"] for d in listed}
    hits = 0
    for question in QUESTIONS[:40]:
        results = await search(http, corpus["id"], question.text)
        titles = [by_title[r["metadata"]["documentId"]] for r in results]
        hits += DOCUMENTS[question.answer].title in titles[:3]
        assert results[0]["metadata"]["collectionId"] == corpus["id"]
    assert hits >= 38  # known answers among the first three


async def test_a_rare_term_outranks_a_common_one_across_documents(http):
    """Per-file statistics judge a term's rarity inside one file, where every term of a
    one-file corpus is equally rare: the document that repeats the common word wins.
    Corpus statistics know that 'turbine' is everywhere and 'zephyrine' in one place."""
    collection = await create(http)
    files = {
        f"common-{i}.txt": f"Turbine maintenance notes {i}. The turbine was checked.".encode()
        for i in range(30)
    }
    files["repeats.txt"] = b"turbine turbine turbine turbine turbine turbine turbine blades."
    files["rare.txt"] = b"The zephyrine coating was applied to one blade in March."
    await add(http, collection["id"], files)
    results = await search(http, collection["id"], "turbine zephyrine")
    assert results[0]["metadata"]["title"] == "rare.txt"


async def test_dense_vectors_find_what_bm25_cannot_and_are_fused(settings, fake_model):
    """The fake embeddings hash words by the sum of their letters, so an anagram is the
    same vector: 'silent' is found by 'listen' only through the vectors."""
    for embeddings in ("fake-embed", ""):
        app = create_app(settings.replace(embeddings={"model": embeddings}))
        with serve(app) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
                collection = await create(h)
                await add(
                    h,
                    collection["id"],
                    {"quiet.txt": b"A silent room.", "loud.txt": b"A noisy hall of drums."},
                )
                titles = [
                    r["metadata"]["title"] for r in await search(h, collection["id"], "listen")
                ]
        assert titles[:1] == (["quiet.txt"] if embeddings else [])


async def _count(items: list[object], at_least: int) -> bool:
    return len(items) >= at_least


def hit(document: str, n: int = 0) -> Hit:
    return Hit("c", Passage(document, n, 1, document, "", document), 1.0)


def test_reciprocal_rank_fusion_prefers_what_both_rankings_agree_on():
    lexical = [hit("a"), hit("b"), hit("c")]
    dense = [hit("d"), hit("b"), hit("a")]
    fused = [h.passage.document_id for h in fuse([lexical, dense], k=60)]
    assert fused[:2] == ["b", "a"] or fused[:2] == ["a", "b"]
    assert set(fused[:2]) == {"a", "b"} and set(fused[2:]) == {"c", "d"}
    assert fuse([lexical, dense])[0].score == pytest.approx(1 / 61 + 1 / 63)
    weighted = fuse([lexical, dense], k=60, weights=[1.0, 0.0])
    assert [h.passage.document_id for h in weighted][:3] == ["a", "b", "c"]


async def test_sharing_is_read_only_and_other_users_see_nothing(http, fake_model):
    collection = await create(http)
    cid = collection["id"]
    await add(http, cid, {"notes.txt": b"The vault code is MARMALADE."})
    as_two = {"userId": "2"}
    assert (await http.get(f"/api/collections/{cid}", params=as_two)).status_code == 404
    assert (await http.get("/api/collections", params=as_two)).json()["collections"] == []
    refused = await http.post(
        "/api/collections/" + cid + "/search", json={"query": "vault", "userId": "2"}
    )
    assert refused.status_code == 404
    body = chat_body("vault code?", userId="2", collections=[cid], copilotEnabled=False)
    asked = await http.post("/api/chat/sse", json=body)
    assert asked.status_code == 400 and cid in asked.json()["data"]

    shared = await http.patch(f"/api/collections/{cid}", json={"shared": ["2"], "name": "Vault"})
    assert shared.json()["collection"]["shared"] == ["2"]
    assert shared.json()["collection"]["name"] == "Vault"
    listed = (await http.get("/api/collections", params=as_two)).json()["collections"]
    assert [c["id"] for c in listed] == [cid]
    assert (await search(http, cid, "vault code", user="2"))[0]["pageContent"].endswith(
        "MARMALADE."
    )
    events = await sse_chat(http, body)
    assert events[-1].type == "messageEnd"
    for method, path in (
        ("PATCH", f"/api/collections/{cid}"),
        ("DELETE", f"/api/collections/{cid}"),
        ("POST", f"/api/collections/{cid}/documents"),
    ):
        answer = await http.request(
            method, path, params=as_two, json={"name": "mine", "urls": ["https://a.example"]}
        )
        assert answer.status_code == 403, (method, path)
    document = (await http.get(f"/api/collections/{cid}/documents", params=as_two)).json()
    doc_id = document["documents"][0]["id"]
    gone = await http.delete(f"/api/collections/{cid}/documents/{doc_id}", params=as_two)
    assert gone.status_code == 403
    assert (await http.get(f"/api/collections/{cid}", params={"userId": "3"})).status_code == 404

    assert (await http.delete(f"/api/collections/{cid}/documents/{doc_id}")).status_code == 200
    assert await search(http, cid, "vault code") == []
    assert (await http.delete(f"/api/collections/{cid}")).status_code == 200
    assert (await http.get(f"/api/collections/{cid}")).status_code == 404


async def test_every_bad_input_is_refused_by_name_and_the_rest_goes_on(http):
    collection = await create(http)
    bomb = b"\0" * (30 * 1024 * 1024)
    archive = zip_of(
        {
            "docs/good.md": b"# Good\nThe ferry leaves at PELICAN o'clock.",
            "docs/bomb.txt": bomb,
            "../escape.txt": b"out of the folder",
            "docs/virus.exe": b"MZ",
        },
        symlinks={"docs/link.txt": "/etc/passwd"},
    )
    files = {
        "tree.zip": archive,
        "empty.txt": b"",
        "locked.pdf": pdf_of("The secret is OSPREY.", password="pw"),
        "fine.txt": b"The harbour opens at dawn.",
    }
    answer, progress = await add(http, collection["id"], files)
    failed = {f["name"]: f for f in progress["failed"]}
    assert failed.keys() == {
        "docs/bomb.txt",
        "tree.zip/../escape.txt",
        "docs/virus.exe",
        "docs/link.txt",
        "empty.txt",
        "locked.pdf",
    }
    assert (
        failed["docs/bomb.txt"]["status"] == 413 and "zip bomb" in failed["docs/bomb.txt"]["error"]
    )
    assert failed["tree.zip/../escape.txt"]["status"] == 400
    assert failed["docs/virus.exe"]["status"] == 415
    assert failed["docs/link.txt"]["status"] == 400 and "link" in failed["docs/link.txt"]["error"]
    assert failed["empty.txt"]["status"] == 400 and "empty" in failed["empty.txt"]["error"]
    assert failed["locked.pdf"]["status"] == 422 and "encrypted" in failed["locked.pdf"]["error"]
    listed = (await http.get(f"/api/collections/{collection['id']}/documents")).json()["documents"]
    ready = sorted(d["title"] for d in listed if d["status"] == "ready")
    assert ready == ["docs/good.md", "fine.txt"]
    assert all(d["chunks"] == 0 for d in listed if d["status"] == "failed")
    assert (await search(http, collection["id"], "PELICAN"))[0]["metadata"][
        "title"
    ] == "docs/good.md"
    assert await search(http, collection["id"], "OSPREY secret passwd folder") == []

    # alone, a bad file is a 4xx that names it, and nothing is recorded
    alone = await http.post(
        f"/api/collections/{collection['id']}/documents", files={"files": ("virus.exe", b"MZ")}
    )
    assert alone.status_code == 415 and "virus.exe" in alone.json()["data"]
    assert len(
        (await http.get(f"/api/collections/{collection['id']}/documents")).json()["documents"]
    ) == len(listed)


async def test_limits_per_collection_and_per_import(settings, fake_model):
    limited = settings.replace(collections={"max_documents": 3, "max_import_bytes": 1000})
    with serve(create_app(limited)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as http:
            collection = await create(http)
            files = {f"n{i}.txt": f"note {i}".encode() for i in range(5)}
            _, progress = await add(http, collection["id"], files)
            assert sorted(f["status"] for f in progress["failed"]) == [413, 413]
            big = await http.post(
                f"/api/collections/{collection['id']}/documents",
                files={"files": ("big.txt", b"x" * 5000)},
            )
            assert big.status_code == 413


async def test_import_progress_streams_until_done(http):
    collection = await create(http)
    files = {f"part-{i}.txt": f"Section {i} of the manual.".encode() for i in range(12)}
    response = await http.post(
        f"/api/collections/{collection['id']}/documents",
        files=[("files", (n, d)) for n, d in files.items()],
    )
    import_id = response.json()["import"]["id"]
    url = f"/api/collections/{collection['id']}/imports/{import_id}"
    async with http.stream("GET", url, params={"stream": "true"}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        seen = [e.data async for e in iter_sse(stream) if not isinstance(e, str)]
    assert seen[-1] == {"done": 12, "total": 12, "failed": []}
    assert [s["done"] for s in seen] == sorted(s["done"] for s in seen)


async def test_urls_are_read_by_the_reader(http, fake_search):
    collection = await create(http)
    response = await http.post(
        f"/api/collections/{collection['id']}/documents",
        json={"urls": ["https://example.com/pages/1", "https://example.com/broken", "ftp://nope"]},
    )
    assert response.status_code == 202
    progress = await finished(http, collection["id"], response.json()["import"]["id"])
    failed = {f["name"]: f["status"] for f in progress["failed"]}
    assert failed.keys() == {"ftp://nope", "https://example.com/broken"}
    assert failed["ftp://nope"] == 400 and 400 <= failed["https://example.com/broken"] < 600
    listed = (await http.get(f"/api/collections/{collection['id']}/documents")).json()["documents"]
    page = next(d for d in listed if d["status"] == "ready")
    assert page["url"] == "https://example.com/pages/1" and page["chunks"] >= 1
    results = await search(http, collection["id"], "FULLTEXT")
    assert results and results[0]["metadata"]["url"] == "https://example.com/pages/1"
    assert "FULLTEXT-1" in results[0]["pageContent"]


def facts_prompt(fake_model) -> str:
    return fake_model.last_system_prompt()


async def test_a_collection_is_asked_over_sse_websocket_v1_and_deep_research(
    http, server, corpus, fake_model, fake_search
):
    question = QUESTIONS[17]
    expected = DOCUMENTS[17]
    body = chat_body(
        question.text, focusMode="webSearch", copilotEnabled=False, collections=[corpus["id"]]
    )

    events = await sse_chat(http, body)
    sources = next(e for e in events if e.type == "sources").data["data"][:-1]
    assert sources[0]["metadata"]["title"] == expected.title
    # a document without pages (markdown) is cited without one, as an upload is
    assert set(sources[0]["metadata"]) == {"title", "url", "collectionId", "documentId"}
    assert sources[0]["metadata"]["collectionId"] == corpus["id"]
    assert expected.value in facts_prompt(fake_model)
    assert fake_search.queries == []  # alone: no web search

    async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient(timeout=10)) as ws:
        await ws.receive_text()
        await ws.send_text(orjson.dumps(body).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("messageEnd", "error"):
            frames.append(orjson.loads(await ws.receive_text()))
    ws_sources = next(f for f in frames if f["type"] == "sources")["data"]
    assert ws_sources[0]["metadata"]["title"] == expected.title

    for model, extra in (
        (f"collection:{corpus['id']}", {}),
        ("webSearch", {"collections": [corpus["id"]]}),
    ):
        fake_search.queries.clear()
        completion = await http.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": question.text}],
                "user": "1",  # with auth off, OpenAI's `user` names the caller
                **extra,
            },
        )
        assert completion.status_code == 200, completion.text
        assert expected.value in facts_prompt(fake_model), model
        results = completion.json()["search_results"]
        assert expected.title in [r["title"] for r in results], model
        assert bool(fake_search.queries) == (model == "webSearch")  # beside the web
    unknown = await http.post(
        "/v1/chat/completions",
        json={"model": "collection:nope", "messages": [{"role": "user", "content": "q"}]},
    )
    assert unknown.status_code == 400

    fake_model.tool_rounds[:] = [
        [
            ("search_collection", {"query": f"{DOCUMENTS[3].attribute} of {DOCUMENTS[3].entity}"}),
            ("search_collection", {"query": question.text}),
            ("web_search", {"query": question.text}),
        ],
        [("done", {})],
    ]
    events = await sse_chat(
        http, chat_body("write a report", focusMode="deepResearch", collections=[corpus["id"]])
    )
    steps = [e.data for e in events if e.type == "progress"]
    searched = [s["step"] for s in steps if s.get("step", {}).get("kind") == "collection"]
    assert len([s for s in searched if s["status"] == "done"]) == 2
    assert "round 2: enough found" in [s["data"] for s in steps]
    sources = next(e for e in events if e.type == "sources").data["data"]
    titles = {s["metadata"]["title"] for s in sources if s["metadata"].get("collectionId")}
    assert {expected.title, DOCUMENTS[3].title} <= titles
    assert any(not s["metadata"].get("collectionId") for s in sources[:-1])  # and the web
    report = facts_prompt(fake_model)
    assert expected.value in report and DOCUMENTS[3].value in report


async def test_unknown_collection_in_a_chat_request_is_a_bad_request(http):
    for collections in (["404"], "not-a-list", ["bad id!"]):
        body = chat_body("q", collections=collections)
        answer = await http.post("/api/chat/sse", json=body)
        assert answer.status_code == 400 and answer.json()["key"] == "BAD_REQUEST"


async def test_a_reranker_reorders_and_cancel_stops_a_slow_search(settings, fake_model):
    rerank = FakeRerank()
    with serve(rerank.app()) as fake:
        reranked = settings.replace(
            collections={"rerank": RerankSettings(url=fake.url + "/rerank", model="rr-1")}
        )
        with serve(create_app(reranked)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as http:
                collection = await create(http)
                await add(
                    http,
                    collection["id"],
                    {
                        "a.txt": b"Harbour harbour harbour schedule.",
                        "b.txt": b"The harbour schedule was reranked.",
                    },
                )
                results = await search(http, collection["id"], "harbour")
                assert results[0]["metadata"]["title"] == "b.txt"
                assert rerank.requests[-1]["model"] == "rr-1"

                rerank.delay = 30.0
                body = chat_body(
                    "harbour?",
                    chatId="c77",
                    copilotEnabled=False,
                    focusMode="webSearch",
                    collections=[collection["id"]],
                )
                started = time.monotonic()
                async with http.stream("POST", "/api/chat/sse", json=body) as response:
                    lines = []
                    async for line in response.aiter_lines():
                        lines.append(line)
                        if "searching your collections" in line:
                            await wait_for(lambda: _count(rerank.requests, 2))
                            cancel = await http.post(
                                "/api/chat/cancel", json={"chatId": "c77", "userId": "1"}
                            )
                            assert cancel.status_code == 200
                assert time.monotonic() - started < 5
                rerank.delay = 0.0
                assert '"status":"cancelled"' in lines[-2]
                assert fake_model.streamed_requests() == []  # never reached the model


async def test_reembedding_is_one_admin_command(settings, fake_model):
    """Imported without an embeddings model, a collection ranks by BM25 alone; once the
    model is configured, `python -m app.collections reembed` gives it vectors."""
    from app.collections.__main__ import run

    plain = settings.replace(embeddings={"model": ""})
    with serve(create_app(plain)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            collection = await create(h)
            await add(h, collection["id"], {"quiet.txt": b"A silent room."})
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            assert await search(h, collection["id"], "listen") == []  # no vectors yet
    said = await run(settings, "reembed", [])
    assert said == "re-embedded 1 passages in 1 spaces with fake-embed"
    assert await run(settings, "spaces", []) == collection["id"]
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            found = await search(h, collection["id"], "listen")
    assert [r["metadata"]["title"] for r in found] == ["quiet.txt"]


def test_the_admin_command_runs_from_the_shell(tmp_path):
    import subprocess
    import sys

    from tests.servers import ROOT

    env = {"COLLECTIONS_URL": f"tantivy:///{tmp_path}/c", "APP_CONFIG": "", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "app.collections", "reembed"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "re-embedded 0 passages in 0 spaces" in done.stdout


async def test_uploads_are_documents_of_their_owners_space_in_the_same_engine(
    settings, fake_model, tmp_path
):
    """`files` in a chat request ride the same retrieval path; an upload made before
    the engine held uploads (its chunks only in the store) is put in it when asked."""
    import shutil

    from app.collections.__main__ import run

    def ask(file_id):
        return chat_body(
            "when does the ferry leave?",
            files=[file_id],
            focusMode="webSearch",
            copilotEnabled=False,
        )

    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            uploaded = await h.post(
                "/api/uploads", files={"files": ("ferry.txt", b"The ferry leaves at PELICAN.")}
            )
            file_id = uploaded.json()["files"][0]["fileId"]
    assert await run(settings, "spaces", []) == "uploads-1"
    shutil.rmtree(tmp_path / "collections")  # as before uploads were in the engine
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            events = await sse_chat(h, ask(file_id))
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert sources[0]["metadata"] == {"title": "ferry.txt", "url": "File", "fileId": file_id}
    assert "PELICAN" in sources[0]["pageContent"]
    assert await run(settings, "spaces", []) == "uploads-1"


# -- deletes that race with indexing, and errors of ours ------------------------------------


def embedding(fake_model) -> bool:
    return any("input" in r for r in fake_model.requests)


async def engine_passages(settings, space):
    """What the engine holds of a space, read after the server stopped."""
    from app.collections import open_engine

    async with open_engine(settings.collections.url) as engine:
        return await engine.passages(space), await engine.spaces()


async def idle(service, timeout=30.0):
    """Until the service has no import running (its sweeper aside)."""

    async def quiet():
        return len(service.imports._chores) <= 1

    await wait_for(quiet, timeout=timeout)


async def test_a_document_or_collection_deleted_while_indexed_leaves_nothing_in_the_engine(
    settings, fake_model
):
    """Deleted while its batch is being embedded: the batch puts its passages in the
    engine afterwards, finds the row gone and takes them back out."""
    fake_model.embedding_delay = 1.5
    app = create_app(settings)
    with serve(app) as server:
        service = app.state.collections
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            collection = await create(h)
            cid = collection["id"]
            answer = await h.post(
                f"/api/collections/{cid}/documents",
                files=[
                    ("files", ("keep.txt", b"The lighthouse keeper logged KESTREL storms.")),
                    ("files", ("drop.txt", b"The vault code is MARMALADE.")),
                ],
            )
            import_id = answer.json()["import"]["id"]
            dropped = next(d["id"] for d in answer.json()["documents"] if d["title"] == "drop.txt")
            await wait_for(lambda: _count([1] if embedding(fake_model) else [], 1))
            gone = await h.delete(f"/api/collections/{cid}/documents/{dropped}")
            assert gone.status_code == 200
            progress = await finished(h, cid, import_id)
            assert progress == {"done": 1, "total": 1, "failed": []}
            found = await search(h, cid, "vault code MARMALADE")
            assert [r["metadata"]["title"] for r in found] == ["keep.txt"]  # by its vector

            fake_model.requests.clear()
            other = (await create(h, "doomed"))["id"]
            answer = await h.post(
                f"/api/collections/{other}/documents",
                files={"files": ("doomed.txt", b"The ferry leaves at PELICAN.")},
            )
            assert answer.status_code == 202
            await wait_for(lambda: _count([1] if embedding(fake_model) else [], 1))
            assert (await h.delete(f"/api/collections/{other}")).status_code == 200
            await idle(service)
    passages, spaces = await engine_passages(settings, cid)
    assert {p.title for p in passages} == {"keep.txt"}
    assert other not in spaces and cid in spaces


async def test_an_unexpected_error_fails_the_batch_and_takes_its_passages_back(
    settings, fake_model, fake_search, monkeypatch
):
    """Not only our own errors: anything a batch meets ends its documents `failed`
    (with why), never `indexing` for ever, and leaves nothing of them in the engine."""
    import app.collections.imports as collections_imports

    def broken_chunks(*_args, **_kwargs):
        raise ValueError("a bug in chunking")

    app = create_app(settings.replace(embeddings={"model": ""}))
    with serve(app) as server:
        service = app.state.collections
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            cid = (await create(h))["id"]
            monkeypatch.setattr(collections_imports, "chunk_pages", broken_chunks)
            answer = await h.post(
                f"/api/collections/{cid}/documents", json={"urls": ["https://example.com/pages/1"]}
            )
            progress = await finished(h, cid, answer.json()["import"]["id"], timeout=20)
            assert [(f["status"], f["error"]) for f in progress["failed"]] == [
                (500, "internal error while indexing")
            ]
            monkeypatch.undo()

            finish = service.store.finish_document

            async def finish_failing_when_ready(record):
                if record.status == "ready":
                    raise RuntimeError("the store broke")
                await finish(record)

            service.store.finish_document = finish_failing_when_ready
            _, progress = await add(h, cid, {"notes.txt": b"The vault code is MARMALADE."})
            assert [f["status"] for f in progress["failed"]] == [500]
            service.store.finish_document = finish
            listed = (await h.get(f"/api/collections/{cid}/documents")).json()["documents"]
            assert {d["status"] for d in listed} == {"failed"}
    passages, _ = await engine_passages(settings, cid)
    assert passages == []


async def test_a_collection_on_a_milvus_server_imports_answers_and_is_reembedded(
    settings, fake_model, tmp_path
):
    """The server engine over the network: Milvus Lite started as a server process on
    loopback, reached at `milvus://127.0.0.1:<port>` as a Milvus server or cluster is."""
    from app.collections.__main__ import run
    from tests.test_collection_engines import milvus_server

    with milvus_server(tmp_path / "milvus") as url:
        on_milvus = settings.replace(collections={"url": url})
        plain = on_milvus.replace(embeddings={"model": ""})
        few = DOCUMENTS[:30]
        with serve(create_app(plain)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
                collection = await create(h)
                cid = collection["id"]
                files = {"reports.zip": zip_of({d.title: d.text.encode() for d in few})}
                files["quiet.txt"] = b"A silent room."
                _, progress = await add(h, cid, files)
                assert progress["done"] == progress["total"] == 31 and not progress["failed"]
                question = QUESTIONS[4]
                results = await search(h, cid, question.text)
                assert results[0]["metadata"]["title"] == few[4].title
                body = chat_body(question.text, copilotEnabled=False, collections=[cid])
                events = await sse_chat(h, body)
                sources = next(e for e in events if e.type == "sources").data["data"]
                assert sources[0]["metadata"]["title"] == few[4].title
                assert few[4].value in fake_model.last_system_prompt()
                assert await search(h, cid, "listen") == []  # no vectors yet
        said = await run(on_milvus, "reembed", [cid])
        with serve(create_app(on_milvus)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
                found = await search(h, cid, "listen")
                assert found[0]["metadata"]["title"] == "quiet.txt"  # by its new vector
                got = (await h.get(f"/api/collections/{cid}")).json()["collection"]
                collection_chunks = got["chunks"]
        chunks = int(said.split()[1])
        assert said == f"re-embedded {chunks} passages in 1 spaces with fake-embed"
        assert chunks == collection_chunks  # every passage, none lost
        with serve(create_app(plain)) as server:  # BM25 alone: the passages as they were
            async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
                results = await search(h, cid, QUESTIONS[4].text)
                assert results[0]["metadata"]["title"] == few[4].title


# -- groups -----------------------------------------------------------------------------------


async def test_a_collection_shared_with_a_group_is_read_only_for_its_members(settings, fake_model):
    """With accounts, the admin makes groups; an owner shares with a group, and each
    member (only while a member) can read and search it, never change it."""
    from tests.identity import browser, sign_up

    accounts = settings.replace(auth={"mode": "accounts"}, embeddings={"model": ""})
    with serve(create_app(accounts)) as server:
        async with (
            browser(server.url) as admin,
            browser(server.url) as owner,
            browser(server.url) as member,
            browser(server.url) as outsider,
        ):
            await sign_up(admin, "admin@example.test")  # the first account: admin
            owner_id = (await sign_up(owner, "owner@example.test"))["id"]
            member_id = (await sign_up(member, "member@example.test"))["id"]
            await sign_up(outsider, "outsider@example.test")

            refused = await owner.post("/api/admin/groups", json={"name": "ops"})
            assert refused.status_code == 403
            made = await admin.post(
                "/api/admin/groups", json={"name": "ops", "members": [member_id, owner_id]}
            )
            assert made.status_code == 201, made.text
            group = made.json()["group"]
            assert group["members"] == sorted([member_id, owner_id])
            listed = (await member.get("/api/groups")).json()["groups"]
            assert [g["id"] for g in listed] == [group["id"]]
            assert (await outsider.get("/api/groups")).json()["groups"] == []

            cid = (await owner.post("/api/collections", json={"name": "runbooks"})).json()[
                "collection"
            ]["id"]
            await owner.post(
                f"/api/collections/{cid}/documents",
                files={"files": ("pager.txt", b"The pager rotation starts on OSPREY day.")},
            )
            assert (await member.get(f"/api/collections/{cid}")).status_code == 404
            unknown = await owner.patch(f"/api/collections/{cid}", json={"groups": ["404"]})
            assert unknown.status_code == 400
            shared = await owner.patch(f"/api/collections/{cid}", json={"groups": [group["id"]]})
            assert shared.json()["collection"]["groups"] == [group["id"]]

            async def ready():
                got = (await owner.get(f"/api/collections/{cid}/documents")).json()
                return got["documents"][0]["status"] == "ready"

            await wait_for(ready, timeout=30)
            assert [
                c["id"] for c in (await member.get("/api/collections")).json()["collections"]
            ] == [cid]
            found = await member.post(f"/api/collections/{cid}/search", json={"query": "OSPREY"})
            assert found.json()["results"][0]["metadata"]["title"] == "pager.txt"
            assert (
                await member.patch(f"/api/collections/{cid}", json={"name": "x"})
            ).status_code == 403
            assert (await member.delete(f"/api/collections/{cid}")).status_code == 403
            assert (await outsider.get(f"/api/collections/{cid}")).status_code == 404
            assert (await outsider.get("/api/collections")).json()["collections"] == []

            changed = await admin.patch(
                f"/api/admin/groups/{group['id']}", json={"members": [owner_id]}
            )
            assert changed.json()["group"]["members"] == [owner_id]
            assert (await member.get(f"/api/collections/{cid}")).status_code == 404
            await admin.patch(f"/api/admin/groups/{group['id']}", json={"members": [member_id]})
            assert (await member.get(f"/api/collections/{cid}")).status_code == 200
            assert (await admin.delete(f"/api/admin/groups/{group['id']}")).status_code == 200
            assert (await member.get(f"/api/collections/{cid}")).status_code == 404
            got = (await owner.get(f"/api/collections/{cid}")).json()["collection"]
            assert got["groups"] == []
            assert (await admin.get("/api/admin/groups")).json()["groups"] == []


async def test_groups_need_accounts(http):
    answer = await http.post("/api/admin/groups", json={"name": "ops"})
    assert answer.status_code == 403 and "accounts" in answer.json()["data"]
    assert (await http.get("/api/groups")).json() == {"groups": []}


# -- imports: progress, limits, memory ---------------------------------------------------------


async def test_import_progress_stream_says_retry_and_a_reconnect_after_the_end_is_204(
    settings, fake_model
):
    """An EventSource reconnects when a stream closes: `retry:` once, each progress
    event with an id, and a reconnect to an import that has ended is 204 (it stops).
    A watcher is woken by the batches, not by reading the store four times a second."""
    fake_model.embedding_delay = 2.0
    app = create_app(settings)
    with serve(app) as server:
        store = app.state.collections.store
        reads = []
        for name in ("import_progress", "list_documents"):
            method = getattr(store, name)

            def counted(*args, _method=method, **kwargs):
                reads.append(args)
                return _method(*args, **kwargs)

            setattr(store, name, counted)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            cid = (await create(h))["id"]
            answer = await h.post(
                f"/api/collections/{cid}/documents",
                files=[("files", (f"n{i}.txt", f"note {i}".encode())) for i in range(3)],
            )
            url = f"/api/collections/{cid}/imports/{answer.json()['import']['id']}"
            reads.clear()
            async with h.stream("GET", url, params={"stream": "true"}) as stream:
                lines = [line async for line in stream.aiter_lines()]
            assert lines[0] == f"retry: {settings.stream.retry_ms}"
            assert lines.count(f"retry: {settings.stream.retry_ms}") == 1
            ids = [line[4:] for line in lines if line.startswith("id: ")]
            assert (
                ids[-1] == "3"
                and "data: " + orjson.dumps({"done": 3, "total": 3, "failed": []}).decode() in lines
            )
            assert len(reads) <= 4  # 2 s of waiting: ~8 reads if it polled every 0.25 s

            again = await h.get(url, params={"stream": "true"}, headers={"last-event-id": "3"})
            assert again.status_code == 204
            again = await h.get(url, params={"stream": "true", "lastEventId": "3"})
            assert again.status_code == 204
            late = await h.get(url, params={"stream": "true"})  # first look, after the end
            assert late.status_code == 200 and '"done":3' in late.text
            missed = await h.get(url, params={"stream": "true"}, headers={"last-event-id": "1"})
            assert missed.status_code == 200 and "id: 3" in missed.text


async def test_imports_running_at_once_are_capped_per_user_and_per_process(settings, fake_model):
    fake_model.embedding_delay = 1.5
    for limits, status in (
        ({"max_imports_per_user": 1, "max_imports": 5}, 429),
        ({"max_imports_per_user": 5, "max_imports": 1}, 503),
    ):
        app = create_app(settings.replace(collections=limits))
        with serve(app) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
                cid = (await create(h))["id"]
                first = await h.post(
                    f"/api/collections/{cid}/documents",
                    files={"files": ("a.txt", b"The first import.")},
                )
                assert first.status_code == 202
                second = await h.post(
                    f"/api/collections/{cid}/documents",
                    files={"files": ("b.txt", b"The second import.")},
                )
                assert second.status_code == status, second.text
                assert second.headers["retry-after"] == "10"
                urls = await h.post(
                    f"/api/collections/{cid}/documents", json={"urls": ["https://a.example"]}
                )
                assert urls.status_code == status
                await finished(h, cid, first.json()["import"]["id"])
                third = await h.post(
                    f"/api/collections/{cid}/documents",
                    files={"files": ("c.txt", b"Once the first has ended.")},
                )
                assert third.status_code == 202


def test_a_zip_of_many_small_entries_of_nothing_is_a_bomb_as_a_whole(tmp_path):
    """Each entry is under the per-entry check's floor (1 MiB), together they unpack to
    far more than 200 times the zip: entries past that are refused by name."""
    from app.collections.archive import MAX_RATIO, entries

    archive = zip_of({f"docs/n{i:03d}.txt": b"\0" * 900_000 for i in range(100)})
    path = tmp_path / "nothing.zip"
    path.write_bytes(archive)
    spool = tmp_path / "spool"
    spool.mkdir()
    with path.open("rb") as upload:
        found, refused = entries(
            "nothing.zip",
            upload,
            spool,
            max_file_bytes=10 << 20,
            max_total_bytes=500 << 20,
            max_files=1000,
        )
    assert sum(e.size for e in found) <= MAX_RATIO * len(archive) + (1 << 20)
    assert refused and all(r.status == 413 and "zip bomb" in r.error for r in refused)
    assert len(found) + len(refused) == 100
    assert sorted(p.name for p in spool.iterdir()) == sorted(Path(e.path).name for e in found)


async def test_imported_files_wait_on_disk_and_are_gone_once_indexed(settings, fake_model):
    """An import's files are copied into the spool folder, not held in memory until
    their batch runs, and each is removed once read."""
    fake_model.embedding_delay = 1.5
    app = create_app(settings)
    with serve(app) as server:
        service = app.state.collections
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
            cid = (await create(h))["id"]
            files = {f"part-{i}.txt": f"Section {i} of the manual.".encode() for i in range(40)}
            answer = await h.post(
                f"/api/collections/{cid}/documents",
                files=[("files", (n, d)) for n, d in files.items()],
            )
            spooled = list(service.imports._spool.iterdir())
            assert 0 < len(spooled) <= 40  # the second batch's files wait on disk
            await finished(h, cid, answer.json()["import"]["id"])
            await idle(service)
            assert list(service.imports._spool.iterdir()) == []


async def test_ownership_is_checked_before_the_body_is_read(server):
    """Another user's collection: 404 at once, without waiting for a 50 MB body."""
    import socket

    async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as h:
        cid = (await create(h))["id"]
    head = (
        f"POST /api/collections/{cid}/documents?userId=2 HTTP/1.1\r\n"
        f"host: 127.0.0.1\r\ncontent-type: multipart/form-data; boundary=x\r\n"
        f"content-length: {50 << 20}\r\n\r\n--x\r\n"
    ).encode()

    def send() -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head)
            return sock.recv(4096)

    answer = await asyncio.to_thread(send)
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]


async def test_failed_documents_do_not_count_against_the_collection_limit(settings, fake_model):
    limited = settings.replace(collections={"max_documents": 3})
    with serve(create_app(limited)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as http:
            cid = (await create(http))["id"]
            _, progress = await add(
                http, cid, {"a.txt": b"", "b.txt": b"", "c.txt": b"The only real one."}
            )
            assert len(progress["failed"]) == 2
            _, progress = await add(http, cid, {"d.txt": b"Two more.", "e.txt": b"And this."})
            assert progress["failed"] == []
            over = await http.post(
                f"/api/collections/{cid}/documents", files={"files": ("f.txt", b"One too many.")}
            )
            assert over.status_code == 413 and "3 documents" in over.json()["data"]


# -- ranking across collections, and pages ------------------------------------------------------


async def test_several_collections_are_ranked_by_score_not_each_by_its_own_rank(tmp_path):
    """A collection with nothing relevant ranks its best weak match first among its
    own; merged by BM25 score it does not sit beside another's best answer."""
    from app.collections import open_engine
    from app.collections.retrieval import Retriever
    from app.config import CollectionSettings, EmbeddingsSettings
    from app.model import Embedder

    def passage(document, text):
        return Passage(document, 0, 0, document, "File", text)

    async with open_engine(f"tantivy:///{tmp_path}/fuse") as engine:
        await engine.add(
            "relevant",
            [
                passage("a1", "zephyrine coating of the harbour crane"),
                passage("a2", "the zephyrine coating was renewed on the harbour crane"),
                *(passage(f"a-other{i}", f"unrelated note {i}") for i in range(20)),
            ],
        )
        await engine.add(
            "noise", [passage(f"b{i}", f"harbour notes {i}, the harbour") for i in range(30)]
        )
        embedder = Embedder(EmbeddingsSettings(model=""))
        retriever = Retriever(CollectionSettings(), engine=engine, embedder=embedder)
        hits = await retriever.search(["noise", "relevant"], "zephyrine coating harbour crane", 4)
        await embedder.aclose()
    assert [h.passage.document_id for h in hits[:2]] in (["a1", "a2"], ["a2", "a1"])


async def test_a_page_is_cited_alike_for_uploads_and_collections(http, fake_model):
    """A PDF's passages carry their page; a text file's none, whether it was uploaded
    for a chat or imported into a collection."""
    from tests.test_files import make_pdf

    uploaded = await http.post(
        "/api/uploads",
        files=[("files", ("atlas.pdf", make_pdf())), ("files", ("ferry.txt", b"PELICAN ferry."))],
    )
    ids = {f["name"]: f["fileId"] for f in uploaded.json()["files"]}
    cid = (await create(http))["id"]
    await add(http, cid, {"atlas.pdf": make_pdf(), "ferry.txt": b"PELICAN ferry."})

    async def pages(body):
        events = await sse_chat(http, body)
        sources = next(e for e in events if e.type == "sources").data["data"]
        found: dict[str, set] = {}
        for s in sources[:-1]:
            found.setdefault(s["metadata"]["title"], set()).add(s["metadata"].get("page"))
        return found

    glaze = "what glaze was fired in the kiln? PELICAN ferry"
    from_files = await pages(chat_body(glaze, files=list(ids.values()), copilotEnabled=False))
    from_collection = await pages(chat_body(glaze, collections=[cid], copilotEnabled=False))
    assert from_files["ferry.txt"] == from_collection["ferry.txt"] == {None}
    assert from_files["atlas.pdf"] == from_collection["atlas.pdf"] == {1, 2, 3}
    searched = await search(http, cid, "PELICAN ferry")
    assert searched[0]["metadata"]["page"] == 0  # the search answer always says
