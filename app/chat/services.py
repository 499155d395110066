"""What a generation uses, as one value the chat service builds once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..chores import Chores
from ..config import Settings
from ..files.service import FileService
from ..metrics import Metrics
from ..model import ChatModel
from ..prompts import Prompts
from ..search.web import WebSearch
from ..store import Store
from ..streams import StreamHub
from .agent import Researcher
from .keeper import AnswerKeeper


@dataclass(frozen=True, slots=True)
class Services:
    """What a generation uses, and nothing more: the model and prompts, the sources
    (web, research, files), where its answer goes (the store for its question's
    sources, the keeper for the answer, the hub for the end), how to sign a sources
    link, where background chores run, and the metrics."""

    settings: Settings
    llm: ChatModel
    prompts: Prompts
    search: WebSearch
    researcher: Researcher
    files: FileService
    store: Store
    keeper: AnswerKeeper
    hub: StreamHub
    metrics: Metrics
    chores: Chores
    #: the "All Sources" link of a question, for a request that came to a host
    sources_link: Callable[[str, str], str]
