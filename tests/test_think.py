"""`<think>` tags inside content become reasoning, wherever the chunks are cut."""

from __future__ import annotations

import pytest

from app.model.wire import ThinkSplitter, split_think, strip_think

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
