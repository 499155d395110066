"""What this process learned of each model it talks to, from its model list and its
answers: whether it leaves the opening `<think>` out, whether it reasons, whether its
format is known (its text is then not held back), which parameters its server
refuses, whether it takes tools and can stream their calls, and whether its server
counts a system prompt. `LLMClient` keeps one, and asks it how to read and send.

Nothing here does I/O; what is learned lasts as long as the process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson

from ..config import LLMSettings
from .base import Traits
from .quirks import instructions_estimate, instructions_uncounted, listed_traits
from .tokens import OPEN_LEFT_OUT, REASONING
from .wire import AnswerDecoder, Delta, Message, Sink, ThinkSplitter

log = logging.getLogger("app.llm")  # the model's log lines keep one name


class Learned:
    """What is known of each model by its name, for the process."""

    def __init__(self, settings: LLMSettings) -> None:
        self.settings = settings
        #: models seen to leave the opening `<think>` out
        self.open_left_out: set[str] = set()
        #: models seen to reason: their short calls get room for it
        self.reasoners: set[str] = set()
        #: models whose answer ended without a lone `</think>`: their text is not held back
        self.formats_known: set[str] = set()
        #: the parameters each model's server was seen to refuse: never sent to it again
        self.refused: dict[str, set[str]] = {}
        #: models whose server cannot stream tool calls: their tool rounds are not streamed
        self.unstreamed_tools: set[str] = set()
        #: whether a model takes tool calls, as its model list said or a tool turn showed
        self.tools: dict[str, bool] = {}
        #: whether a model reasons, as its model list said
        self.listed_reasoning: dict[str, bool] = {}
        #: models whose prompt count was looked at for a dropped system prompt
        self.counted: set[str] = set()
        self.warned_uncounted: set[str] = set()

    def learn_listed(self, entries: Sequence[Any]) -> None:
        """What the entries of a model list (`GET /models`'s `data`) say of each model:
        its format (`learn_listed_body`), whether it takes tools and whether it reasons
        (`quirks.listed_traits`). What a tool turn showed wins over the list."""
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            name = entry["id"]
            said = [entry.get(key) for key in ("id", "root", "parent")]
            if any(isinstance(what, str) and OPEN_LEFT_OUT.search(what) for what in said):
                self.open_left_out.add(name)
            tools, reasoning = listed_traits(entry)
            if tools is not None:
                self.tools.setdefault(name, tools)
            if reasoning is not None:
                self.listed_reasoning[name] = reasoning

    def learn_listed_body(self, body: bytes) -> None:
        """What the model list says of each model: one served under a name that says
        nothing (an alias) may be listed with what it is (vLLM's `root`, a `parent`);
        the name rules apply to that too, so a template that leaves the opening
        `<think>` out is split from its first answer. A list that cannot be read
        teaches nothing."""
        try:
            models = orjson.loads(body).get("data")
        except (orjson.JSONDecodeError, AttributeError):
            return
        self.learn_listed(models if isinstance(models, list) else [])

    def traits(self, model: str) -> Traits:
        """Whether `model` takes tools (its list said, or a tool turn showed) and whether
        it reasons (its name, its list, or its answers said); None: not known yet."""
        reasoning = self.listed_reasoning.get(model)
        if self.reasons(model) or model in self.open_left_out:
            reasoning = True
        return Traits(tools=self.tools.get(model), reasoning=reasoning)

    def reasons(self, name: str) -> bool:
        """Whether `name` is a reasoning model: its name says so, or it was seen to."""
        return name in self.reasoners or bool(REASONING.search(name))

    def splitter(self, name: str) -> ThinkSplitter:
        """The splitter of an answer by `name`: split from its start when it is known to
        leave the opening `<think>` out; its text held back until its format shows
        (`ThinkSplitter`) when nothing is known of it — no answer of it ended here yet,
        and its model list did not say it never reasons."""
        tags = self.settings.think_tags
        if tags == "open_left_out" or name in self.open_left_out or OPEN_LEFT_OUT.search(name):
            return ThinkSplitter(assume_open=True)
        known = name in self.formats_known or self.listed_reasoning.get(name) is False
        if known or tags == "paired":
            return ThinkSplitter()
        formats_known = self.formats_known
        return ThinkSplitter(hold=True, shown=lambda: name in formats_known)

    def answered(self, name: str, decoder: AnswerDecoder) -> None:
        """What a streamed answer that ended showed of its model (`learn`)."""
        splitter = decoder.splitter
        whole = decoder.finish != "length"
        self.learn(name, lone_close=splitter.lone_close, reasoned=splitter.tagged, whole=whole)

    def learn(self, name: str, *, lone_close: bool, reasoned: bool, whole: bool = False) -> None:
        """Remember what a model's answer showed of it: that it leaves the opening
        `<think>` out (its next answers are split from their start), that it reasons;
        that it does not (a `whole` answer, not cut at its cap, without a lone
        `</think>`): its next answers are not held back."""
        if whole and not lone_close:
            self.formats_known.add(name)
        if lone_close and name not in self.open_left_out:
            log.info(
                "model %s leaves the opening <think> out: its answers are split from their start",
                name,
            )
            self.open_left_out.add(name)
        if (reasoned or lone_close) and name not in self.reasoners:
            self.reasoners.add(name)

    def watch_count(self, name: str, messages: Sequence[Message], sink: Sink) -> Sink:
        """`sink`, behind a look at the answer's `usage` on a model's first answer that
        has instructions (`check_count`); after it, `sink` as it is."""
        if name in self.counted or self.settings.system_prompt != "system":
            return sink
        estimate = instructions_estimate(messages)
        if not estimate:
            return sink
        self.counted.add(name)

        def watched(delta: Delta) -> None:
            if delta.kind == "usage":
                self.check_count(name, delta.usage, estimate)
            sink(delta)

        return watched

    def check_count(self, name: str, usage: dict[str, Any] | None, estimate: int) -> None:
        """Warn, once per model, when a response's `usage` shows its instructions were
        not counted: the server's chat template drops system messages."""
        if name in self.warned_uncounted or not instructions_uncounted(usage, estimate):
            return
        self.warned_uncounted.add(name)
        log.warning(
            "model %s was given a system prompt its server did not count: its chat template"
            ' drops system messages; set llm.system_prompt = "user" (LLM_SYSTEM_PROMPT=user)',
            name,
        )
