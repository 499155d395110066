"""`<think>` tags inside content become reasoning, wherever the chunks are cut."""

from __future__ import annotations

import pytest

from app.model.wire import Delta, ThinkSplitter, split_think, strip_think

TEXT = "<think>Let me <b>think</b>.</think>The answer is <3 and </think> stays."


def split(pieces):
    splitter = ThinkSplitter()
    deltas = [d for piece in pieces for d in splitter.feed(piece)] + splitter.flush()
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    return reasoning, content


def test_whole_text():
    assert split([TEXT]) == ("Let me <b>think</b>.", "The answer is <3 and </think> stays.")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 8])
def test_every_cut(size):
    pieces = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    assert split(pieces) == ("Let me <b>think</b>.", "The answer is <3 and </think> stays.")


def test_plain_content_passes_through_untouched():
    assert split(["a < b", " and <thin", "g>"]) == ("", "a < b and <thing>")


def test_unterminated_tag_at_end_is_kept_as_text():
    assert split(["x <thi"]) == ("", "x <thi")


def test_strip_think():
    assert strip_think("<think>hmm</think>Title here") == "Title here"


def test_a_whole_completion_whose_opening_tag_was_left_out_keeps_only_the_answer():
    # a DeepSeek-R1 template: reasoning, a lone `</think>`, then the answer (JSON here)
    text = 'The user greets me. No search.</think>\n{"skipSearch": true}'
    assert strip_think(text) == '\n{"skipSearch": true}'
    assert split_think(text) == ("The user greets me. No search.", '\n{"skipSearch": true}', True)
    # more than one lone close: everything up to the last one was reasoning
    assert strip_think("a</think>b</think>answer") == "answer"
    # a paired tag is split as a stream splits it; a later `</think>` stays text
    assert split_think("<think>x</think>y </think> z") == ("x", "y </think> z", False)


LONE = "Let me think.</think>The answer."


def held(pieces, *, apart_after: int | None = None):
    """What a splitter that holds the text back (`hold`: nothing known of the model)
    hands out after each piece, and at the end."""
    splitter = ThinkSplitter(hold=True)
    steps = []
    for n, piece in enumerate(pieces):
        got = splitter.feed(piece)
        if apart_after == n:
            got += splitter.reasoning_apart()
        steps.append([(d.kind, d.text) for d in got])
    steps.append([(d.kind, d.text) for d in splitter.flush()])
    return splitter, steps


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, len(LONE)])
def test_a_lone_closing_tag_of_an_unknown_model_splits_its_first_answer(size):
    pieces = [LONE[i : i + size] for i in range(0, len(LONE), size)]
    splitter, steps = held(pieces)
    flat = [delta for step in steps for delta in step]
    assert "".join(t for kind, t in flat if kind == "reasoning") == "Let me think."
    assert "".join(t for kind, t in flat if kind == "content") == "The answer."
    # no text went out as answer before the tag: the reasoning came first, as reasoning
    first_content = next(i for i, (kind, _) in enumerate(flat) if kind == "content")
    assert all(kind == "reasoning" for kind, _ in flat[:first_content])
    assert splitter.lone_close


def test_the_held_text_of_a_plain_answer_goes_out_at_its_end_as_it_came():
    pieces = ["The ", "answer ", "is 3 < 4", "."]
    _, steps = held(pieces)
    assert steps[:-1] == [[], [], [], []]  # held: it could still be reasoning
    assert "".join(t for _, t in steps[-1]) == "The answer is 3 < 4."
    assert {kind for kind, _ in steps[-1]} == {"content"}
    assert [t for _, t in steps[-1]][:2] == ["The ", "answer "]  # the chunks as they came


def test_an_opening_tag_or_reasoning_apart_ends_the_hold_at_once():
    _, steps = held(["<thi", "nk>Hmm.</think>", "The ", "answer."])
    assert steps[1] == [("reasoning", "Hmm.")]  # the tags are paired: nothing more is held
    assert steps[2] == [("content", "The ")]
    _, steps = held(["Hello", " there"], apart_after=0)
    assert steps[0] == [("content", "Hello")]
    assert steps[1] == [("content", " there")]


def test_what_is_held_is_released_as_answer_when_the_stream_stops_early():
    splitter = ThinkSplitter(hold=True)
    assert splitter.feed("half an ") == [] and splitter.feed("answer") == []
    assert [(d.kind, d.text) for d in splitter.release()] == [
        ("content", "half an "),
        ("content", "answer"),
    ]
    assert splitter.feed(" more") == [Delta("content", " more")]  # nothing held from then on


def test_an_answer_held_beside_one_that_showed_the_model_plain_goes_out_at_its_next_chunk():
    known: set[str] = set()
    splitter = ThinkSplitter(hold=True, shown=lambda: "m" in known)
    assert splitter.feed("Started ") == [] and splitter.feed("together") == []
    known.add("m")  # another answer of the model ended without a lone </think>
    assert [(d.kind, d.text) for d in splitter.feed(", went on")] == [
        ("content", "Started "),
        ("content", "together"),
        ("content", ", went on"),
    ]
    assert splitter.feed(" and on") == [Delta("content", " and on")]
