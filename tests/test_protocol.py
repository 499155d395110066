"""The request validator and the event renderers."""

from __future__ import annotations

import pytest

from app.errors import BadRequest
from app.ids import parse_id
from app.protocol import (
    Event,
    loads,
    parse_chat_request,
    parse_control,
    parse_event_id,
    render_default,
    render_simple,
)


def parse(body, **kw):
    return parse_chat_request(body, max_content_chars=kw.pop("max_content_chars", 100), **kw)


def base(**over):
    body = {"type": "message", "userId": "7130314803843072", "message": {"content": "hi"}}
    body.update(over)
    return body


def test_full_request_is_parsed_with_defaults():
    request = parse(
        {
            "type": "message",
            "userId": 7130314803843072,
            "message": {
                "messageId": "71383373052067817",
                "chatId": 7138337258229764,
                "content": "what is x",
            },
            "history": [["human", "q"], ["assistant", "a"], ["ai", "b"]],
        }
    )
    assert request.user_id == "7130314803843072"
    assert request.chat_id == "7138337258229764"
    assert request.message_id == "71383373052067817"
    assert (
        request.focus_mode,
        request.optimization_mode,
        request.copilot_enabled,
        request.format,
    ) == (
        "webSearch",
        "speed",
        True,
        "default",
    )
    assert request.history == (("user", "q"), ("assistant", "a"), ("assistant", "b"))


def test_missing_ids_are_left_for_the_server_and_user_defaults_to_zero():
    request = parse({"message": {"content": "hi"}})
    assert (request.user_id, request.chat_id, request.message_id) == ("0", None, None)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([], "JSON object"),
        (base(message=None), "message must be"),
        (base(message={"content": "   "}), "non-empty"),
        (base(message={"content": 5}), "non-empty"),
        (base(message={"content": "x" * 101}), "longer than 100"),
        (base(focusMode="nope"), "focusMode"),
        (base(optimizationMode="fast"), "optimizationMode"),
        (base(copilotEnabled="yes"), "copilotEnabled"),
        (base(format="xml"), "format"),
        (base(userId="a b"), "userId"),
        (base(userId=-1), "userId"),
        (base(userId=True), "userId"),
        (base(userId="x" * 65), "userId"),
        (base(message={"content": "x", "chatId": "../0"}), "chatId"),
        (base(message={"content": "x", "messageId": 1.5}), "messageId"),
        (base(history="x"), "history"),
        (base(history=[["human"]]), "history[0]"),
        (base(history=[["human", 3]]), "history[0]"),
        (base(type="cancel"), "type"),
        (base(files="a"), "files"),
    ],
)
def test_bad_requests_say_what_is_wrong(body, fragment):
    with pytest.raises(BadRequest) as info:
        parse(body)
    assert fragment in info.value.message


def test_history_longer_than_the_limit_is_refused():
    with pytest.raises(BadRequest, match="more than 2"):
        parse(base(history=[["human", "a"]] * 3), max_history_messages=2)


def test_format_query_parameter_overrides_body():
    assert parse(base(format="default"), format_override="simple").format == "simple"


def test_loads_refuses_bad_json_and_deep_nesting():
    with pytest.raises(BadRequest, match="not valid JSON"):
        loads(b"{nope")
    with pytest.raises(BadRequest, match="nested deeper"):
        loads(b"[" * 40 + b"]" * 40)
    assert loads(b"[" * 10 + b"]" * 10) == [[[[[[[[[[]]]]]]]]]]


def test_ids_are_opaque_strings_and_integers_become_decimal_text():
    assert parse_id("0012", "x") == "0012"
    assert parse_id(493612582016638976, "x") == "493612582016638976"
    hex_id = "5c2e0d9b1f7a4c3e8d6b2a1f0e9d8c7b6a5f4e3d"  # the Perplexica UI's chat ids
    assert parse_id(hex_id, "x") == hex_id
    assert parse_id("a_B-9", "x") == "a_B-9"
    for bad in ("", "1.5", "١٢", "x" * 65, "a:b", None, 1.0, True, -1):
        with pytest.raises(BadRequest):
            parse_id(bad, "x")


def test_event_ids():
    assert parse_event_id("493612582016638976:7") == ("493612582016638976", 7)
    assert parse_event_id(None) == (None, 0)
    for bad in ("abc", "1:", "1:x", ":3"):
        with pytest.raises(BadRequest):
            parse_event_id(bad)


def test_control_frames():
    control = parse_control({"type": "resume", "chatId": "5", "userId": 0, "lastEventId": "9:2"})
    assert (control.type, control.chat_id, control.user_id, control.last_event_id) == (
        "resume",
        "5",
        "0",
        "9:2",
    )
    with pytest.raises(BadRequest):
        parse_control({"type": "resume", "lastEventId": 3})


def test_default_rendering_puts_ids_as_strings_and_omits_message_id_on_rewrited():
    message = Event("message", "11", "22", {"data": "hi"}, 3)
    assert render_default(message) == {
        "type": "message",
        "data": "hi",
        "messageId": "22",
        "chatId": "11",
    }
    rewrited = Event("rewrited", "11", "22", {"content": "q?"}, 1)
    assert render_default(rewrited) == {"type": "rewrited", "content": "q?", "chatId": "11"}
    end = Event("messageEnd", "11", "22", {"status": "completed", "questionMessageId": "21"}, 9)
    assert render_default(end)["status"] == "completed"
    assert message.event_id == "22:3"


def test_simple_rendering_maps_every_type():
    meta = {"chatId": "11", "messageId": "22"}
    src = [
        {"metadata": {"title": "t", "url": "u"}, "pageContent": "p"},
        {"metadata": {"title": "All Sources", "url": "//h/sources/1"}},
    ]
    cases = [
        (
            Event("rewrited", "11", "22", {"content": "q?"}, 1),
            {"type": "info", "content": "q?"},
            {"kind": "rewrited"},
        ),
        (
            Event("sources", "11", "22", {"data": src}, 2),
            {"type": "info", "content": "1 sources"},
            {"kind": "sources", "sources": src},
        ),
        (
            Event("progress", "11", "22", {"data": "searching"}, 3),
            {"type": "info", "content": "searching"},
            {"kind": "progress"},
        ),
        (
            Event("reasoning", "11", "22", {"data": "hm"}, 4),
            {"type": "info", "content": "hm"},
            {"kind": "reasoning"},
        ),
        (
            Event("message", "11", "22", {"data": "tok"}, 5),
            {"type": "answer", "content": "tok"},
            {},
        ),
        (
            Event("messageEnd", "11", "22", {"status": "cancelled"}, 6),
            {"type": "complete"},
            {"status": "cancelled"},
        ),
        (
            Event("error", "11", "22", {"key": "STREAM_ERROR", "data": "boom"}, 7),
            {"type": "error", "content": "boom"},
            {"key": "STREAM_ERROR"},
        ),
    ]
    for event, expected, extra_meta in cases:
        out = render_simple(event)
        assert out is not None
        for key, value in expected.items():
            assert out[key] == value
        assert out["metadata"] == {**meta, **extra_meta}
        assert out["timestamp"] == event.ts
    assert render_simple(Event("keep-alive", "11", "22")) is None
