"""The built-in reader refuses non-public addresses on every hop (SSRF), unless allowed."""

from __future__ import annotations

import ipaddress

import pytest

from app.config import ReaderSettings
from app.errors import SearchError
from app.extract import extract_main_text
from app.search.reader import BuiltinReader, address_allowed
from tests.fakes.search import FakeSearch
from tests.servers import serve

pytestmark = pytest.mark.anyio


@pytest.fixture
def internal():
    """A server on 127.0.0.2 standing in for an internal service."""
    with serve(FakeSearch().app(), host="127.0.0.2") as server:
        yield server


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/secret",
        "http://10.0.0.1/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:9/",
        "http://[::ffff:127.0.0.1]:9/",
        "http://localhost:9/",
        "http://0.0.0.0:9/",
        "http://100.64.1.1/",
        "http://192.168.1.1/",
    ],
)
async def test_non_public_addresses_are_refused_before_connecting(url):
    reader = BuiltinReader(ReaderSettings(provider="builtin", timeout_seconds=2))
    try:
        with pytest.raises(SearchError, match="non-public"):
            await reader.read(url)
    finally:
        await reader.aclose()


async def test_a_redirect_to_an_internal_address_is_refused(fake_search_server, internal):
    _, public = fake_search_server
    trusted = (ipaddress.ip_network("127.0.0.1/32"),)  # the "public" site, for this test
    target = f"{public.url}/redirect?to={internal.url}/secret"

    guarded = BuiltinReader(ReaderSettings(provider="builtin", timeout_seconds=2), trusted=trusted)
    try:
        assert "FULLTEXT-1" in await guarded.read(
            f"{public.url}/pages/1"
        )  # the public site is read
        with pytest.raises(SearchError, match="non-public"):
            await guarded.read(target)
    finally:
        await guarded.aclose()

    allowed = BuiltinReader(
        ReaderSettings(provider="builtin", timeout_seconds=2, allow_private_networks=True)
    )
    try:
        assert await allowed.read(target) == "SECRET-INTERNAL-DATA"
    finally:
        await allowed.aclose()


async def test_only_http_pages_of_text_are_read(fake_search_server):
    reader = BuiltinReader(
        ReaderSettings(provider="builtin", timeout_seconds=2, allow_private_networks=True)
    )
    try:
        for url in ("file:///etc/passwd", "ftp://example.com/x", "gopher://x"):
            with pytest.raises(SearchError, match="only http"):
                await reader.read(url)
    finally:
        await reader.aclose()


def test_address_policy():
    for public in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "8.8.8.8"):
        assert address_allowed(ipaddress.ip_address(public))
    for private in (
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.0.1",
        "169.254.169.254",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:10.0.0.1",
        "224.0.0.1",
        "0.0.0.0",
        "100.100.100.100",
    ):
        assert not address_allowed(ipaddress.ip_address(private)), private


def test_main_text_extraction_drops_page_furniture():
    html = (
        "<html><head><title>Guide</title><style>p{}</style></head><body>"
        "<header>SITE HEADER</header><nav>menu</nav><main><h1>Guide</h1><p>Real text.</p>"
        "<script>evil()</script><aside>ads</aside><p>More.</p></main><footer>legal</footer></body></html>"
    )
    text = extract_main_text(html)
    assert text == "Guide\nReal text.\nMore."
