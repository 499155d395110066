"""A fake web: Tavily, SearxNG and Google Custom Search APIs, a Jina-style reader,
and the pages the results point at — all one real HTTP server.

Each result N has the snippet `SNIPPET-N …` and a page at `/pages/N` whose
main text holds `FULLTEXT-N`, so a test can tell from the model's system
prompt what was read. Result 3 shares the most words with `RELEVANT_QUESTION`
(for the embeddings ranker).

    /tavily/search                   POST, bearer key
    /searxng/search?q=&format=json   GET
    /google/customsearch/v1?key=&cx=&q=   GET
    /jina/<url>                      GET: the page's text as Markdown
    /pages/<n>                       GET: an HTML page
    /images/<n>.png                  GET: a small PNG (what image results point at)
    /embed/<n>                       GET: a video "player" page

SearxNG answers its `images`, `videos` and `news` categories as SearxNG does;
Tavily its `include_images` and `topic: news`; Google `searchType=image`. Every
request's parameters are kept in `requests` (provider, params). A search (during
`search_delay`) or a page read (during its `page_delay`) whose client goes away is
kept in `closed` as (provider, query) or ("page", n), as the fake model keeps its
streams' `client_closed`.
    /redirect?to=<url>               GET: 302 to <url>
    /secret                          GET: what an SSRF would reach
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Route

RESULT_COUNT = 8
RELEVANT_QUESTION = "how do falcon engines burn methane"
TOPICS = [
    "history of pottery glazes",
    "weather patterns over oceans",
    "recipes for sourdough bread",
    "falcon engines burn methane and oxygen",
    "chess openings for beginners",
    "migratory birds in winter",
    "ancient roman road building",
    "jazz improvisation techniques",
]


def _png() -> bytes:
    """A 4×4 grey PNG (what image results point at)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    pixels = b"".join(b"\x00" + b"\x80\x80\x80" * 4 for _ in range(4))
    header = struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(pixels))
        + chunk(b"IEND", b"")
    )


PNG = _png()


def snippet(n: int) -> str:
    return f"SNIPPET-{n} about {TOPICS[n]}"


def fulltext(n: int) -> str:
    return f"FULLTEXT-{n}: the whole page about {TOPICS[n]}, with every detail."


async def client_went(request: Request, seconds: float) -> bool:
    """Wait `seconds`, or less when the client goes: whether it went."""
    deadline = time.monotonic() + seconds
    while True:
        if await request.is_disconnected():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))


@dataclass
class FakeSearch:
    api_key: str = "search-key"
    fail: int = 0  # answer this status to every search when set
    empty: bool = False
    search_delay: float = 0.0
    page_delay: dict[int, float] = field(default_factory=dict)
    broken_pages: set[int] = field(default_factory=set)
    queries: list[tuple[str, str]] = field(default_factory=list)  # (provider, query)
    searched_at: list[float] = field(default_factory=list)  # when each search came in
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    pages_read: list[tuple[str, int]] = field(default_factory=list)  # (via, n)
    closed: list[tuple[str, Any]] = field(default_factory=list)  # given up by the client
    pages_asked: list[int] = field(default_factory=list)  # reads begun (through the reader)
    base_url: str = ""
    #: results put first; a "date" is given as the provider gives a publish date
    extra: list[dict[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.fail, self.empty, self.search_delay = 0, False, 0.0
        self.extra.clear()
        self.page_delay.clear()
        self.broken_pages.clear()
        self.queries.clear()
        self.searched_at.clear()
        self.requests.clear()
        self.pages_read.clear()
        self.closed.clear()
        self.pages_asked.clear()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/tavily/search", self.tavily, methods=["POST"]),
                Route("/searxng/search", self.searxng),
                Route("/google/customsearch/v1", self.google),
                Route("/jina/{url:path}", self.jina),
                Route("/pages/{n:int}", self.page),
                Route("/images/{n:int}.png", self.image),
                Route("/embed/{n:int}", self.embed),
                Route("/redirect", self.redirect),
                Route("/secret", self.secret),
            ]
        )

    def results(self) -> list[dict[str, str]]:
        if self.empty:
            return []
        return [*self.extra] + [
            {
                "title": f"Result {n}: {TOPICS[n]}",
                "url": f"{self.base_url}/pages/{n}",
                "snippet": snippet(n),
            }
            for n in range(RESULT_COUNT)
        ]

    async def _searched(self, request: Request, provider: str, query: str) -> Response | None:
        self.queries.append((provider, query))
        self.searched_at.append(time.monotonic())
        if self.search_delay and await client_went(request, self.search_delay):
            self.closed.append((provider, query))
            return JSONResponse({"error": "client closed"}, status_code=499)
        if self.fail:
            return JSONResponse({"error": "fake search failure"}, status_code=self.fail)
        return None

    def image_url(self, n: int) -> str:
        return f"{self.base_url}/images/{n}.png"

    async def tavily(self, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"detail": "bad key"}, status_code=401)
        body: dict[str, Any] = await request.json()
        self.requests.append(("tavily", body))
        if failed := await self._searched(request, "tavily", body["query"]):
            return failed
        items = [
            {"title": r["title"], "url": r["url"], "content": r["snippet"], "score": 0.5}
            | ({"published_date": r["date"]} if "date" in r else {})
            for r in self.results()
        ]
        answer: dict[str, Any] = {
            "query": body["query"],
            "results": items[: body.get("max_results", 8)],
        }
        if body.get("include_images"):
            answer["images"] = [
                {"url": self.image_url(n), "description": f"Picture {n} of {TOPICS[n]}"}
                for n in range(4)
            ]
        return JSONResponse(answer)

    async def searxng(self, request: Request) -> Response:
        params = dict(request.query_params)
        if params.get("format") != "json":
            return PlainTextResponse("format must be json", status_code=403)
        self.requests.append(("searxng", params))
        if failed := await self._searched(request, "searxng", params["q"]):
            return failed
        category = params.get("categories", "general")
        if category == "images":
            items = [
                {
                    "title": f"Image {n}: {TOPICS[n]}",
                    "url": f"{self.base_url}/pages/{n}",
                    "img_src": self.image_url(n),
                    "thumbnail_src": self.image_url(n),
                    "resolution": f"{640 + n}x{480 + n}",
                    "engine": "fake images",
                }
                for n in range(6)
            ]
        elif category == "videos":
            items = [
                {
                    "title": f"Video {n}: {TOPICS[n]}",
                    "url": f"{self.base_url}/pages/{n}",
                    "thumbnail": self.image_url(n),
                    "iframe_src": f"{self.base_url}/embed/{n}",
                    "engine": "youtube",
                }
                for n in range(3)
            ]
        elif category == "news":
            items = [
                {
                    "title": f"News about {params['q']}: {TOPICS[n]}",
                    "url": f"{self.base_url}/pages/{n}?topic={params['q']}",
                    "content": f"What happened with {TOPICS[n]}.",
                    "thumbnail": self.image_url(n),
                    "engine": "fake news",
                }
                for n in range(3)
            ]
        else:
            items = [
                {"title": r["title"], "url": r["url"], "content": r["snippet"], "engine": "fake"}
                | ({"publishedDate": r["date"]} if "date" in r else {})
                for r in self.results()
            ]
        return JSONResponse({"query": params["q"], "results": items})

    async def google(self, request: Request) -> Response:
        params = request.query_params
        if params.get("key") != self.api_key or not params.get("cx"):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=400)
        self.requests.append(("google", dict(params)))
        if failed := await self._searched(request, "google", params["q"]):
            return failed
        if params.get("searchType") == "image":
            images = [
                {
                    "title": f"Image {n}",
                    "link": self.image_url(n),
                    "image": {
                        "contextLink": f"{self.base_url}/pages/{n}",
                        "width": 800 + n,
                        "height": 600 + n,
                    },
                }
                for n in range(5)
            ]
            return JSONResponse({"items": images})
        items = [
            {"title": r["title"], "link": r["url"], "snippet": r["snippet"]}
            | (
                {"pagemap": {"metatags": [{"article:published_time": r["date"]}]}}
                if "date" in r
                else {}
            )
            for r in self.results()
        ]
        body: dict[str, Any] = {"kind": "customsearch#search"}
        if items:
            body["items"] = items[: int(params.get("num", 10))]
        return JSONResponse(body)

    async def jina(self, request: Request) -> Response:
        url = request.path_params["url"]
        n = int(url.rstrip("/").rsplit("/", 1)[-1]) if "/pages/" in url else -1
        if n < 0 or n in self.broken_pages:
            return PlainTextResponse("cannot read", status_code=422)
        self.pages_asked.append(n)
        # a read given up on (a later test may be running)
        if await client_went(request, self.page_delay.get(n, 0)):
            self.closed.append(("page", n))
            return PlainTextResponse("gone", status_code=499)
        self.pages_read.append(("jina", n))
        return PlainTextResponse(f"Title: Result {n}\n\nMarkdown Content:\n{fulltext(n)}")

    async def page(self, request: Request) -> Response:
        n = request.path_params["n"]
        if n in self.broken_pages:
            return HTMLResponse("gone", status_code=500)
        await asyncio.sleep(self.page_delay.get(n, 0))
        if await request.is_disconnected():
            return HTMLResponse("gone", status_code=499)
        self.pages_read.append(("page", n))
        return HTMLResponse(
            f"<html><head><title>Result {n}</title><script>var tracking = 1;</script></head><body>"
            f"<nav>Home | About | NAVIGATION-NOISE</nav><article><h1>Result {n}</h1>"
            f"<p>{fulltext(n)}</p></article><footer>FOOTER-NOISE</footer></body></html>"
        )

    async def image(self, request: Request) -> Response:
        return Response(PNG, media_type="image/png")

    async def embed(self, request: Request) -> Response:
        return HTMLResponse(f"<html><body>video player {request.path_params['n']}</body></html>")

    async def redirect(self, request: Request) -> Response:
        return RedirectResponse(request.query_params["to"], status_code=302)

    async def secret(self, request: Request) -> Response:
        return PlainTextResponse("SECRET-INTERNAL-DATA")
