"""The model client's stream: read by the small streaming client (`app.model.upstream`)
for direct connections, with the SDK's headers, errors, timeouts and keep-alive;
through the SDK when a proxy is configured."""

from __future__ import annotations

import asyncio
import datetime
import gzip
import ssl
from collections.abc import Callable
from typing import Any

import openai
import pytest

import app.model.client
from app.config import LLMSettings
from app.errors import ConfigError, ModelError, StreamError
from app.model import ContextTooLong, LLMClient
from app.model.client import body_reader
from app.model.errors import refuses_tools
from app.model.upstream import StreamedResponse, StreamingClient
from tests.client import wait_for
from tests.test_first_minutes import closed_port
from tests.test_first_minutes import silent_port as silent_port  # a fixture

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "count #tokens=40 #reasoning=5"}]


async def deltas(client: LLMClient, content: str = MESSAGES[0]["content"]) -> list[tuple[str, str]]:
    messages = [{"role": "user", "content": content}]
    return [(d.kind, d.text) async for d in client.stream(messages)]  # type: ignore[arg-type]


async def answered(
    client: LLMClient, content: str, got: list[tuple[str, str]] | None = None
) -> list[tuple[str, str]]:
    """What `answer` hands its sink, as (kind, text)."""
    got = [] if got is None else got
    keep = got.append
    await client.answer([{"role": "user", "content": content}], lambda d: keep((d.kind, d.text)))
    return got


def llm(model_url: str, key: str, **settings: Any) -> LLMClient:
    return LLMClient(LLMSettings(base_url=model_url, api_key=key, model="m", **settings))


async def test_the_stream_is_read_by_the_streaming_client_and_gives_what_the_sdk_would(
    model_url, fake_model, monkeypatch
):
    client = llm(model_url, fake_model.api_key)
    readers = []

    def recording(http):
        reader = body_reader(http)
        readers.append(reader)
        return reader

    monkeypatch.setattr(app.model.client, "body_reader", recording)
    fast = await deltas(client)
    assert isinstance(readers[0], StreamedResponse)
    # the SDK's path (a proxy's), read as before: the same deltas
    streaming, client._streaming = client._streaming, None
    try:
        assert await deltas(client) == fast
        assert not isinstance(readers[1], StreamedResponse)
    finally:
        client._streaming = streaming
        await client.aclose()
    assert [kind for kind, _ in fast].count("reasoning") == 5
    assert "".join(text for kind, text in fast if kind == "content").count("tok") == 40
    # the SDK's headers went with it: its key, its user agent
    assert fake_model.requests[0]["stream_options"] == {"include_usage": True}


async def test_an_answer_handed_to_a_sink_is_what_the_stream_yields_on_both_paths(
    model_url, fake_model
):
    """`answer` parses in the callback that read the bytes (direct connections) or
    hands on what the SDK's path yields (a proxy's): either way the same deltas as
    `stream`, think tags split, a malformed chunk a StreamError after what came before
    it, and an error of the sink's own ends the answer with it."""
    client = llm(model_url, fake_model.api_key)
    content = "count #tokens=30 #reasoning=3 #think"
    try:
        streamed = await deltas(client, content)
        for direct in (True, False):
            streaming = client._streaming
            if not direct:
                client._streaming = None
            try:
                assert await answered(client, content) == streamed
                got: list[tuple[str, str]] = []
                with pytest.raises(StreamError, match="malformed"):
                    await answered(client, "#tokens=9 #malformed=4", got)
                assert "".join(t for k, t in got if k == "content") == "tok0 tok1 tok2 tok3 "

                def refusing(delta):
                    if delta.kind == "content":
                        raise LookupError("the sink's own")

                with pytest.raises(LookupError):
                    await client.answer([{"role": "user", "content": "#tokens=5"}], refusing)
            finally:
                client._streaming = streaming
    finally:
        await client.aclose()


async def test_connections_are_kept_alive_and_reused(model_url, fake_model):
    client = llm(model_url, fake_model.api_key)
    try:
        pool = client._streaming
        assert pool is not None
        await deltas(client, "#tokens=3")
        await wait_for(
            lambda: asyncio.sleep(0, len(pool._idle) == 1)
        )  # the message's end came after [DONE]
        first = pool._idle[0]
        await deltas(client, "#tokens=3")
        await wait_for(
            lambda: asyncio.sleep(0, pool._idle == [first])
        )  # the same connection, back again
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (404, openai.NotFoundError),
        (500, openai.InternalServerError),
    ],
)
async def test_a_non_2xx_answer_is_raised_as_the_sdk_raises_it(
    model_url, fake_model, status, error
):
    client = llm(model_url, fake_model.api_key)
    try:
        with pytest.raises(StreamError) as raised:
            await deltas(client, f"#fail={status}")
        cause = raised.value.__cause__
        assert type(cause) is error and cause.status_code == status
        assert cause.body == {
            "message": f"fake failure {status}",
            "type": "fake_error",
            "code": str(status),
        }
        # the connection that carried the error serves the next request
        assert [k for k, _ in await deltas(client, "#tokens=2")].count("content") == 2
    finally:
        await client.aclose()


async def test_a_429_is_retried_once_after_its_retry_after(model_url, fake_model):
    client = llm(model_url, fake_model.api_key)
    try:
        started = asyncio.get_running_loop().time()
        got = await deltas(client, "#flaky=429 #tokens=3")
        assert asyncio.get_running_loop().time() - started >= 0.2  # Retry-After: 0.2
        assert [k for k, _ in got].count("content") == 3
        assert len([r for r in fake_model.requests if r.get("stream")]) == 2
    finally:
        await client.aclose()


async def test_a_stream_that_stalls_ends_with_a_stream_error(model_url, fake_model):
    client = llm(model_url, fake_model.api_key, read_timeout_seconds=0.3)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(StreamError, match="nothing came in time"):
            await deltas(client, "#tokens=2 #hang")
        assert asyncio.get_running_loop().time() - started < 2
    finally:
        await client.aclose()


async def test_a_model_that_never_answers_is_out_of_time(silent_port):
    client = llm(f"http://127.0.0.1:{silent_port}/v1", "k", read_timeout_seconds=0.3)
    try:
        with pytest.raises(ModelError, match="did not answer in time") as raised:
            await deltas(client, "hi")
        assert isinstance(raised.value.__cause__, openai.APITimeoutError)
    finally:
        await client.aclose()


async def test_a_refused_connection_is_said_as_before():
    client = llm(f"http://127.0.0.1:{closed_port()}/v1", "k")
    try:
        with pytest.raises(ModelError, match="refused the connection"):
            await deltas(client, "hi")
    finally:
        await client.aclose()


async def test_closing_the_stream_closes_the_upstream_response(model_url, fake_model):
    client = llm(model_url, fake_model.api_key)
    try:
        stream = client.stream([{"role": "user", "content": "#tokens=3 #hang"}])
        assert (await anext(stream)).kind in ("reasoning", "content")
        await stream.aclose()  # as a cancel does
        record = await fake_model.wait_stream_end()
        assert record.outcome == "client_closed"
        assert client._streaming is not None and client._streaming._idle == []
    finally:
        await client.aclose()


async def test_a_break_mid_stream_is_a_stream_error(model_url, fake_model):
    client = llm(model_url, fake_model.api_key)
    try:
        with pytest.raises(StreamError, match="broke off"):
            await deltas(client, "#tokens=10 #break=3")
    finally:
        await client.aclose()


def test_with_a_proxy_configured_the_sdk_reads_the_stream(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = llm("https://models.example/v1", "k")
    assert proxied.configured and proxied._streaming is None
    monkeypatch.setenv("NO_PROXY", "models.example")
    assert llm("https://models.example/v1", "k")._streaming is not None


# -- bodies of every shape, from a raw server ------------------------------------------

SSE = b'data: {"choices":[{"delta":{"content":"one "}}]}\n\ndata: {"choices":[{"delta":{"content":"two"}}]}\n\ndata: [DONE]\n\n'


def chunked(body: bytes, size: int = 7) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def raw_server(answer: Callable[[int], bytes], *, close: bool = False):
    """A server answering its n-th request with `answer(n)` (closing after it with
    `close`); yields its URL and the requests' count."""
    count = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                count[0] += 1
                writer.write(answer(count[0]))
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", count


def streaming(url: str, **kwargs) -> StreamingClient:
    client = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0)
    return StreamingClient(
        url,
        headers={"authorization": "Bearer k"},
        make_status_error=client._make_status_error_from_response,
        connect_timeout=2,
        read_timeout=2,
        pool_timeout=2,
        **kwargs,
    )


async def body_of(client: StreamingClient) -> bytes:
    response = await client.post("/chat/completions", b"{}")
    try:
        return await response.aread()
    finally:
        await response.aclose()


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


@pytest.mark.parametrize(
    ("response", "close"),
    [
        (HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunked(SSE), False),
        (HEAD + b"content-length: %d\r\n\r\n%s" % (len(SSE), SSE), False),
        (HEAD + b"connection: close\r\n\r\n" + SSE, True),  # delimited by the end
        (
            HEAD
            + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(gzip.compress(SSE))
            + gzip.compress(SSE),
            False,
        ),
    ],
    ids=["chunked", "content-length", "until-close", "gzip"],
)
async def test_every_shape_of_body_is_read_whole(response, close):
    server, url, _ = await raw_server(lambda n: response, close=close)
    client = streaming(url)
    try:
        assert await body_of(client) == SSE
        assert await body_of(client) == SSE  # again: pooled or, after a close, anew
    finally:
        await client.aclose()
        server.close()


async def test_a_pooled_connection_the_server_closed_is_replaced():
    """A server that closes a kept-alive connection while it is idle: the next request
    goes out on a new connection, not into an error."""
    answer = HEAD + b"content-length: %d\r\n\r\n%s" % (len(SSE), SSE)
    server, url, count = await raw_server(lambda n: answer, close=True)
    client = streaming(url)
    try:
        response = await client.post("/chat/completions", b"{}")
        await response.aread()
        await response.aclose()  # pooled: the server said nothing of closing
        await asyncio.sleep(0.05)  # … and closes it now
        assert await body_of(client) == SSE
        assert count[0] == 2
    finally:
        await client.aclose()
        server.close()


async def test_https_upstreams_are_read_over_tls(tmp_path):
    cert, key, trusted = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    answer = HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunked(SSE)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    client = streaming(f"https://localhost:{port}/v1", ssl_context=trusted)
    untrusting = streaming(f"https://localhost:{port}/v1")
    try:
        assert await body_of(client) == SSE
        with pytest.raises(openai.APIConnectionError) as raised:
            await body_of(untrusting)  # a certificate no one vouches for
        assert isinstance(raised.value.__cause__, ssl.SSLError)
    finally:
        await client.aclose()
        await untrusting.aclose()
        server.close()


def self_signed(tmp_path) -> tuple[str, str, ssl.SSLContext]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    trusted = ssl.create_default_context(cafile=str(cert_path))
    return str(cert_path), str(key_path), trusted


async def test_a_redirect_is_left_to_the_sdk_as_before(model_url, fake_model):
    """A model behind an address that redirects (307, here to another origin): the SDK
    follows it as it did before the streaming client read the stream — to the same
    end (httpx drops the key on a redirect to another origin, and the model refuses)."""
    target = model_url + "/chat/completions"
    redirect = b"HTTP/1.1 307 Temporary Redirect\r\nlocation: %s\r\ncontent-length: 0\r\n\r\n"
    server, url, count = await raw_server(lambda n: redirect % target.encode(), close=True)
    client = llm(url, fake_model.api_key)
    try:
        with pytest.raises(StreamError) as ours:
            await deltas(client, "#tokens=3")
        assert count[0] == 2  # the streaming client's request, then the SDK's
        client._streaming = None  # the SDK alone
        with pytest.raises(StreamError) as sdk:
            await deltas(client, "#tokens=3")
        assert ours.value.message == sdk.value.message
        assert type(ours.value.__cause__) is type(sdk.value.__cause__) is openai.AuthenticationError
    finally:
        await client.aclose()
        server.close()


async def test_a_completion_that_leaves_the_opening_tag_out_is_split_and_remembered(
    model_url, fake_model
):
    fake_model.replies.insert(0, ("Name it", "They want a name. Maybe this.</think>Fake Title"))
    client = llm(model_url, fake_model.api_key)
    try:
        assert await client.complete([{"role": "user", "content": "Name it"}]) == "Fake Title"
        # the model is known now: its first streamed answer is split from its start
        got = await deltas(client, "explain #lonethink #reasoning=0")
    finally:
        await client.aclose()
    assert "".join(t for kind, t in got if kind == "reasoning") == "Let me think."
    assert "".join(t for kind, t in got if kind == "content") == "The answer."


async def test_a_reasoning_model_is_given_room_to_reason_in_short_calls(model_url, fake_model):
    ask = [{"role": "user", "content": "Name it"}]
    plain = llm(model_url, fake_model.api_key)
    r1 = LLMClient(LLMSettings(base_url=model_url, api_key=fake_model.api_key, model="DeepSeek-R1"))
    try:
        await plain.complete(ask, max_tokens=300)
        assert fake_model.requests[-1]["max_tokens"] == 300
        await r1.complete(ask, max_tokens=300)
        assert fake_model.requests[-1]["max_tokens"] >= 300 + 4000
        # a model whose name says nothing, seen to reason: room from then on
        fake_model.replies.insert(0, ("Name it", "Hmm.</think>Fake Title"))
        await plain.complete(ask, max_tokens=300)
        await plain.complete(ask, max_tokens=300)
        assert fake_model.requests[-1]["max_tokens"] >= 300 + 4000
    finally:
        await plain.aclose()
        await r1.aclose()


@pytest.mark.parametrize(
    ("detail", "refused"),
    [
        ("registry.ollama.ai/library/gemma3 does not support tools", True),
        ("tool_choice is not supported", True),
        ("unknown field `tools`", True),
        ("tools param requires --jinja flag", True),
        ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser', True),
        ("deepseek-reasoner does not support Function Calling", True),
        ("Unrecognized request argument supplied: tools", True),
        # these name tools or functions, and are about something else
        (
            "This model's maximum context length is 8192 tokens. However, your messages "
            "resulted in 9000 tokens (8000 in the messages, 1000 in the functions).",
            False,
        ),
        (
            "Invalid parameter: messages with role 'tool' must be a response to a "
            "preceeding message with 'tool_calls'.",
            False,
        ),
        ("Invalid 'messages[2].tool_calls[0].id': empty string.", False),
        ("temperature is not supported with this model", False),
        ("the function name is too long", False),
    ],
)
def test_only_a_refusal_of_tools_marks_a_model_as_without_them(detail, refused):
    assert refuses_tools(400, detail) is refused
    assert refuses_tools(500, detail) is False


async def test_connections_idle_past_their_keep_alive_are_closed_unused():
    """A pool that served many streams at once does not keep their sockets: what
    waits in it longer than `keepalive_seconds` is closed, used again or not."""
    answer = HEAD + b"content-length: %d\r\n\r\n%s" % (len(SSE), SSE)
    server, url, _ = await raw_server(lambda n: answer)
    pool = streaming(url, keepalive_seconds=0.3)
    try:
        responses = await asyncio.gather(*(pool.post("/chat/completions", b"{}") for _ in range(4)))
        for response in responses:
            assert await response.aread() == SSE
            await response.aclose()
        assert len(pool._idle) == 4
        pooled = list(pool._idle)
        await asyncio.sleep(0.8)
        assert pool._idle == []
        assert all(connection.lost.done() for connection in pooled)
    finally:
        await pool.aclose()
        server.close()


async def test_an_answer_asks_for_at_most_max_output_tokens_and_says_when_it_was_cut(
    model_url, fake_model
):
    client = LLMClient(
        LLMSettings(base_url=model_url, api_key=fake_model.api_key, model="m", max_output_tokens=7)
    )
    try:
        streamed = await deltas(client, "never stops #endless #reasoning=0")
        handed = await answered(client, "never stops #endless #reasoning=0")
        whole = await answered(client, "short #tokens=3 #reasoning=0")
        tool = {"type": "function", "function": {"name": "done", "parameters": {}}}
        await client.tool_turn([{"role": "user", "content": "research"}], [tool])
    finally:
        await client.aclose()
    assert [r["max_tokens"] for r in fake_model.streamed_requests()] == [7, 7, 7]
    # a research round is model output too: a model that never stops is cut there
    assert [r["max_tokens"] for r in fake_model.tool_requests()] == [7]
    for got in (streamed, handed):
        assert [kind for kind, _ in got].count("content") == 7
        assert ("finish", "length") in got
    assert "finish" not in [kind for kind, _ in whole]  # it stopped by itself


async def test_a_short_call_abandoned_closes_its_request(model_url, fake_model):
    fake_model.slow_replies["Name it"] = 30
    client = llm(model_url, fake_model.api_key)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await client.complete([{"role": "user", "content": "Name it"}], max_tokens=20)

        async def closed() -> bool:
            return fake_model.replies_closed == ["Name it"]

        await wait_for(closed)
    finally:
        await client.aclose()
    assert fake_model.short_requests()[0]["stream"] is True


@pytest.mark.parametrize("reader", ["stream", "answer"])
@pytest.mark.parametrize("refusal", ["empty", "closed"])
async def test_a_prompt_over_the_window_refused_in_a_200_is_said_so_by_both_readers(
    model_url, fake_model, reader, refusal
):
    # llama.cpp's server answers an empty 200; llama-cpp-python's closes the connection
    # after the head, before a line of the stream
    fake_model.context_limit = 50
    fake_model.overflow_empty = refusal == "empty"
    fake_model.overflow_closed = refusal == "closed"
    client = llm(model_url, fake_model.api_key)
    content = "a question longer than the window " * 4
    try:
        with pytest.raises(ContextTooLong) as raised:
            await (deltas(client, content) if reader == "stream" else answered(client, content))
    finally:
        await client.aclose()
    assert "context window" in raised.value.message and "empty" not in raised.value.message


async def first_text_comes_while_streaming(client: LLMClient, fake_model, content: str) -> bool:
    """Whether the answer's first text reaches the caller before the model sent it all
    (`#tokens=6`)."""
    async for delta in client.stream([{"role": "user", "content": content}]):
        if delta.kind == "content":
            return fake_model.streams[-1].tokens_sent < 6
    raise AssertionError("no text")


async def test_only_the_first_answer_of_a_model_nothing_is_known_of_is_held_back(
    model_url, fake_model
):
    """Its text could be reasoning ended by a lone `</think>`: held until the answer
    shows it is not (its end); from its second answer on it streams at once, as does the
    first answer of a model its list says does not reason."""
    slow = "#tokens=6 #delay=0.05 #reasoning=0"
    client = llm(model_url, fake_model.api_key)
    try:
        assert not await first_text_comes_while_streaming(client, fake_model, slow)
        assert await first_text_comes_while_streaming(client, fake_model, slow)
    finally:
        await client.aclose()
    fake_model.listed[:] = [{"id": "m", "object": "model", "supported_parameters": ["tools"]}]
    client = llm(model_url, fake_model.api_key)
    try:
        assert await client.probe() is None
        assert await first_text_comes_while_streaming(client, fake_model, slow)
    finally:
        await client.aclose()


async def test_a_held_first_answer_cut_short_still_hands_out_its_text(model_url, fake_model):
    client = llm(model_url, fake_model.api_key)
    got: list[tuple[str, str]] = []
    task = asyncio.create_task(answered(client, "#tokens=40 #delay=0.05 #reasoning=0", got))
    try:

        async def three_sent() -> bool:
            return bool(fake_model.streams) and fake_model.streams[-1].tokens_sent >= 3

        await wait_for(three_sent)
        assert got == []  # held: it could still be reasoning
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await client.aclose()
    assert got and {kind for kind, _ in got} == {"content"}
    assert "".join(t for _, t in got).startswith("tok0 tok1 tok2 ")


async def test_a_short_call_that_ended_without_a_lone_tag_lets_the_answers_stream(
    model_url, fake_model
):
    """A short call of the model read to its end (not cut at `max_tokens`) with no lone
    `</think>` shows what the model is, as an answer would: its first answer is not held."""
    client = llm(model_url, fake_model.api_key, small_model="m")
    try:
        assert await client.complete([{"role": "user", "content": "Write a title"}])
        assert await first_text_comes_while_streaming(
            client, fake_model, "#tokens=6 #delay=0.05 #reasoning=0"
        )
    finally:
        await client.aclose()


async def test_think_tags_paired_holds_nothing_back_and_open_left_out_splits_the_first_answer(
    model_url, fake_model
):
    """`llm.think_tags`: an admin who knows the models says so, and nothing is learned
    first — "paired" streams the first answer at once, "open_left_out" takes the text
    before a lone `</think>` for reasoning from the first answer on."""
    client = llm(model_url, fake_model.api_key, think_tags="paired")
    try:
        assert await first_text_comes_while_streaming(
            client, fake_model, "#tokens=6 #delay=0.05 #reasoning=0"
        )
    finally:
        await client.aclose()
    client = llm(model_url, fake_model.api_key, think_tags="open_left_out")
    try:
        got = [
            (d.kind, d.text)
            async for d in client.stream([{"role": "user", "content": "#lonethink"}])
            if d.kind in ("content", "reasoning")
        ]
    finally:
        await client.aclose()
    assert got and got[0][0] == "reasoning"
    with pytest.raises(ConfigError):
        llm(model_url, fake_model.api_key, think_tags="sometimes")


async def test_a_short_call_past_its_max_tokens_is_closed(model_url, fake_model):
    """A model server that ignores `max_tokens` would stream a title as long as an
    answer, holding a connection beside the answers: the call ends with what came up to
    there, and its request is closed."""
    fake_model.endless_replies.add("Name it")
    client = llm(model_url, fake_model.api_key)
    try:
        title = await client.complete([{"role": "user", "content": "Name it"}], max_tokens=20)

        async def closed() -> bool:
            return fake_model.replies_closed == ["Name it"]

        await wait_for(closed)
    finally:
        await client.aclose()
    words = title.split()
    assert words[:3] == ["word0", "word1", "word2"] and 20 <= len(words) < 100
