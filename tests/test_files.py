"""Your own documents: upload, list, ask, cite, follow up, research, delete, and every
kind of bad file, through real uvicorn with the fake model (embeddings included) and
files the tests make: a PDF with known text on known pages, a DOCX, HTML, Markdown."""

from __future__ import annotations

import asyncio
import io
import zipfile

import docx
import httpx
import orjson
import pytest
from fpdf import FPDF
from httpx_ws import aconnect_ws

from app.main import create_app
from tests.client import chat_body, sse_chat, wait_for
from tests.conftest import USER
from tests.servers import serve

pytestmark = pytest.mark.anyio

#: what page N of the test PDF says (1-based)
PAGE_FACTS = {
    1: "The lighthouse keeper logged forty storms in the winter of 1888.",
    2: "Cobalt blue glaze was fired at twelve hundred degrees in the kiln.",
    3: "The orchard grew seventeen kinds of heritage apples near the river.",
}


def make_pdf(pages: dict[int, str] | None = None, filler: int = 0) -> bytes:
    """A text PDF: each page says its fact (and `filler` more pages of plain text)."""
    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in (pages or PAGE_FACTS).values():
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    for n in range(filler):
        pdf.add_page()
        pdf.multi_cell(0, 8, f"Filler page {n}. " + "Nothing of note happens here. " * 40)
    return bytes(pdf.output())


def make_docx(paragraphs: list[str]) -> bytes:
    document = docx.Document()
    for paragraph in paragraphs:
        document.add_paragraph(paragraph)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


async def upload(http, name, data, **params):
    response = await http.post("/api/uploads", files={"files": (name, data)}, params=params)
    return response


@pytest.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as client:
        yield client


def files_only(content, files, **fields):
    body = chat_body(content, files=files, focusMode="webSearch", **fields)
    body["copilotEnabled"] = False
    return body


async def test_upload_list_and_delete(http, fake_model):
    response = await upload(http, "atlas.pdf", make_pdf())
    assert response.status_code == 200
    (record,) = response.json()["files"]
    assert (record["fileName"], record["fileExtension"], record["type"]) == (
        "atlas.pdf",
        "pdf",
        "pdf",
    )
    assert record["pages"] == 3 and record["chunks"] >= 1 and record["status"] == "ready"
    listed = (await http.get("/api/uploads")).json()["files"]
    assert [f["fileId"] for f in listed] == [record["fileId"]]
    assert (await http.get("/api/uploads", params={"userId": "2"})).json()["files"] == []
    assert (
        await http.get(f"/api/uploads/{record['fileId']}", params={"userId": "2"})
    ).status_code == 403
    assert (await http.delete(f"/api/uploads/{record['fileId']}")).status_code == 200
    assert (await http.get("/api/uploads")).json()["files"] == []
    deleted = await http.post("/api/chat/sse", json=files_only("q", [record["fileId"]]))
    assert deleted.status_code == 400 and "not one of your uploads" in deleted.json()["data"]


async def test_an_answer_cites_the_file_and_the_page(http, fake_model):
    file_id = (await upload(http, "atlas.pdf", make_pdf())).json()["files"][0]["fileId"]
    events = await sse_chat(http, files_only("what glaze was fired in the kiln?", [file_id]))
    sources = next(e for e in events if e.type == "sources").data["data"]
    best = sources[0]
    assert best["metadata"] == {
        "title": "atlas.pdf",
        "url": "File",
        "fileId": file_id,
        "page": 2,
    }
    assert "Cobalt blue glaze" in best["pageContent"]
    prompt = fake_model.last_system_prompt()
    assert "source 1 atlas.pdf (page 2)" in prompt and "Cobalt blue" in prompt


async def test_files_over_the_websocket_too(server, http, fake_model):
    file_id = (await upload(http, "notes.md", b"# Notes\n\nThe code word is PAPAYA.")).json()[
        "files"
    ][0]["fileId"]
    async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient(timeout=10)) as ws:
        await ws.receive_text()
        await ws.send_text(orjson.dumps(files_only("what is the code word?", [file_id])).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("messageEnd", "error"):
            frames.append(orjson.loads(await ws.receive_text()))
    sources = next(f for f in frames if f["type"] == "sources")["data"]
    assert sources[0]["metadata"]["fileId"] == file_id and "PAPAYA" in sources[0]["pageContent"]


async def test_files_and_the_web_are_ranked_together(http, fake_model, fake_search):
    file_id = (await upload(http, "atlas.pdf", make_pdf())).json()["files"][0]["fileId"]
    body = chat_body("how do falcon engines burn methane", files=[file_id], focusMode="webSearch")
    events = await sse_chat(http, body)
    sources = next(e for e in events if e.type == "sources").data["data"][:-1]
    kinds = {"file" if s["metadata"].get("fileId") else "web" for s in sources}
    assert kinds == {"file", "web"}
    # the web result about methane engines outranks the file's unrelated pages
    assert sources[0]["metadata"]["title"].startswith("Result 3")


async def test_a_follow_up_uses_the_chats_files_without_sending_them_again(http, fake_model):
    file_id = (await upload(http, "atlas.pdf", make_pdf())).json()["files"][0]["fileId"]
    await sse_chat(http, files_only("what about the lighthouse?", [file_id], chatId="c1"))
    events = await sse_chat(http, files_only("and the heritage apples orchard?", [], chatId="c1"))
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert sources[0]["metadata"]["page"] == 3
    chat = (await http.get("/api/chats/c1")).json()["chat"]
    assert chat["files"] == [{"fileId": file_id, "name": "atlas.pdf"}]


async def test_deep_research_searches_the_files_in_its_rounds(http, fake_model, fake_search):
    fake_model.tool_rounds[:] = [
        [("search_files", {"query": "lighthouse storms"}), ("web_search", {"query": "kiln"})],
        [("search_files", {"query": "kiln glaze"})],
        [("done", {})],
    ]
    fake_model.replies.insert(0, ("Decide", "orchard apples"))
    file_id = (await upload(http, "atlas.pdf", make_pdf())).json()["files"][0]["fileId"]
    body = chat_body("tell me everything", files=[file_id], focusMode="deepResearch")
    events = await sse_chat(http, body)
    progress = [e.data["data"] for e in events if e.type == "progress"]
    assert sum(p.startswith("searching your files: ") for p in progress) >= 2  # two rounds
    sources = next(e for e in events if e.type == "sources").data["data"]
    pages = {s["metadata"].get("page") for s in sources if s["metadata"].get("fileId")}
    assert {1, 2, 3} <= pages
    assert any(not s["metadata"].get("fileId") for s in sources[:-1])  # and the web


async def test_without_an_embeddings_model_files_are_ranked_with_bm25(settings, fake_model):
    with serve(create_app(settings.replace(embeddings={"model": ""}))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:
            file_id = (await upload(http, "atlas.pdf", make_pdf())).json()["files"][0]["fileId"]
            events = await sse_chat(http, files_only("heritage apples orchard river", [file_id]))
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert sources[0]["metadata"]["page"] == 3
    assert not [r for r in fake_model.requests if "input" in r]  # no embeddings asked


@pytest.mark.parametrize(
    ("name", "data", "status", "fragment"),
    [
        ("virus.exe", b"MZ...", 415, "only"),
        ("empty.txt", b"", 400, "empty"),
        ("blank.pdf", make_pdf({1: " "}), 422, "no text"),
        ("broken.pdf", b"%PDF-1.4\n this is not really a PDF", 422, "cannot be read"),
        ("broken.docx", b"PK\x03\x04 not a zip at all", 422, "not a valid document"),
        ("binary.txt", b"\x00\x01\x02\x03" * 100, 422, "not text"),
    ],
)
async def test_bad_files_are_refused_clearly_and_nothing_is_kept(
    http, fake_model, name, data, status, fragment
):
    response = await upload(http, name, data)
    assert response.status_code == status, response.text
    assert fragment in response.json()["data"] and response.json()["key"] == "BAD_REQUEST"
    assert (await http.get("/api/uploads")).json()["files"] == []
    assert (await http.get("/healthz")).status_code == 200


async def test_an_encrypted_pdf_is_refused(http, fake_model):
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter()
    for page in PdfReader(io.BytesIO(make_pdf())).pages:
        writer.add_page(page)
    writer.encrypt(user_password="secret", owner_password="owner")
    out = io.BytesIO()
    writer.write(out)
    response = await upload(http, "locked.pdf", out.getvalue())
    assert response.status_code == 422 and "encrypted" in response.json()["data"]


async def test_a_docx_zip_bomb_is_refused(http, fake_model):
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", "<Types/>")
        archive.writestr("word/document.xml", "<w:document>" + " " * 300_000_000 + "</w:document>")
    response = await upload(http, "bomb.docx", bomb.getvalue())
    assert response.status_code == 413 and "zip bomb" in response.json()["data"]


async def test_limits_on_size_and_pages(settings, fake_model):
    small = settings.replace(uploads={"max_file_bytes": 2000, "max_pages": 2})
    with serve(create_app(small)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:
            large = await upload(http, "big.txt", b"x" * 3000)
            assert large.status_code == 413 and "larger than 2000" in large.json()["data"]
            pages = await upload(http, "long.pdf", make_pdf())
            assert pages.status_code == 413 and "more than 2" in pages.json()["data"]


async def test_docx_html_and_markdown_are_read(http, fake_model):
    docx_id = (
        await upload(
            http, "plan.docx", make_docx(["Phase one: survey.", "The budget is 42 gold coins."])
        )
    ).json()["files"][0]["fileId"]
    html = b"<html><nav>MENU</nav><article><h1>Report</h1><p>The river flooded in May.</p></article></html>"
    html_id = (await upload(http, "report.html", html)).json()["files"][0]["fileId"]
    events = await sse_chat(
        http, files_only("what is the budget in gold coins?", [docx_id, html_id])
    )
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert "42 gold coins" in sources[0]["pageContent"]
    assert all("MENU" not in s["pageContent"] for s in sources[:-1])


async def test_a_large_pdf_is_indexed_and_can_be_polled(http, fake_model):
    data = make_pdf(filler=300)
    response = await upload(http, "tome.pdf", data, wait="false")
    assert response.status_code == 202
    (record,) = response.json()["files"]
    assert record["status"] == "indexing"

    async def ready():
        got = (await http.get(f"/api/uploads/{record['fileId']}")).json()
        return got if got["status"] != "indexing" else None

    got = await wait_for(ready, timeout=60)
    assert got["status"] == "ready" and got["pages"] == 303 and got["chunks"] > 300
    events = await sse_chat(
        http, files_only("how many storms did the lighthouse keeper log?", [record["fileId"]])
    )
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert sources[0]["metadata"]["page"] == 1


async def test_streams_keep_flowing_while_a_big_pdf_is_read(http, fake_model):
    """Extraction runs in a child process: an answer streaming meanwhile is not held up."""
    data = make_pdf(filler=300)
    reading = asyncio.create_task(upload(http, "tome.pdf", data))
    events = await sse_chat(http, chat_body("count #tokens=40 #delay=0.01"))
    assert events[-1].data["status"] == "completed"
    assert (await reading).status_code == 200
