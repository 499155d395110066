"""The models the server offers (PROTOCOL §13): the default (`[llm]`, provider id
`default`) and one `ChatModel` per `[providers.<id>]`, each with the models it lists.

`ModelRegistry` builds the providers' clients, lists their models in the background
(a provider's own list when `models` is not configured; refreshed every
`REFRESH_SECONDS`) and chooses the model of an answer (`choose`): a `Choice` whose
`llm` answers with the chosen model and does the answer's small tasks with its
provider's `small_model`, else the default's. A chat never waits for a listing: a
provider not (yet) listed takes any model name, and a provider that is down says so
in its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import openai

from ..chores import Chores
from ..config import DEFAULT_PROVIDER, LLMSettings, ProviderSettings, Settings
from ..errors import AppError, BadRequest, ModelError, StreamError
from .anthropic import AnthropicModel
from .base import Short, Traits
from .client import ChatModel, LLMClient
from .tokens import REASONING
from .wire import Delta, Message, Sink, Tool, ToolMessage, ToolTurn

log = logging.getLogger("app.llm")

#: how often the providers' model lists are read again
REFRESH_SECONDS = 300.0
#: how long one provider's listing may take
LIST_SECONDS = 10.0
#: how long `GET /api/providers` waits for the first listing before answering
FIRST_LISTING_SECONDS = 3.0

STATUSES = ("ok", "unreachable", "unauthorized")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    name: str
    context_tokens: int
    #: it thinks for sure (an Anthropic provider with `thinking_tokens`); else its name says
    thinks: bool = False

    def to_json(self, known: Traits) -> dict[str, Any]:
        """`tools` and `reasoning` are what is `known` of it (its provider's model list,
        its answers), null while nothing is."""
        return {
            "id": self.id,
            "name": self.name,
            "contextTokens": self.context_tokens,
            "tools": known.tools,
            "reasoning": True if self.thinks or REASONING.search(self.id) else known.reasoning,
        }


@dataclass(slots=True)
class Provider:
    """One provider: its client, what it is configured with (`llm`: `[llm]` with its
    keys over it), and what its last listing found."""

    id: str
    name: str
    type: str
    llm: LLMSettings
    client: ChatModel
    configured_models: tuple[str, ...]
    admin_only: bool = False
    #: its answers think (an Anthropic provider with `thinking_tokens`)
    thinks: bool = False
    #: whose small tasks: this provider's (its `small_model`), else None (the default's)
    small_model: str = ""
    models: list[ModelInfo] = field(default_factory=list)
    status: str = "ok"
    error: str | None = None
    listed: bool = False

    def model_ids(self) -> list[str]:
        return [m.id for m in self.models]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "type": self.type,
            "status": self.status,
            "models": [m.to_json(self.client.traits(m.id)) for m in self.models],
        }
        if self.error:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class Choice:
    """The model of one answer: who answers (`llm`, bound to `model`), and its name."""

    provider: str
    model: str
    llm: ChatModel
    settings: LLMSettings

    def to_json(self) -> dict[str, str]:
        return {"provider": self.provider, "model": self.model}


def stored_choice(stored: str | None) -> dict[str, str] | None:
    """The `chatModel` of an answer's stored model name: the name alone for the
    default's, `@<provider>/<model>` for another's (as `/v1` model names say it)."""
    if not stored:
        return None
    if stored.startswith("@") and "/" in stored:
        provider, _, model = stored[1:].partition("/")
        return {"provider": provider, "model": model}
    return {"provider": DEFAULT_PROVIDER, "model": stored}


class ModelRegistry:
    """Every provider, by id, the default first. `open` starts the listing in the
    background (on `chores`); `aclose` closes the clients it made (not the default's)."""

    def __init__(self, settings: Settings, default: ChatModel) -> None:
        self.settings = settings
        self.default = default
        self.providers: dict[str, Provider] = {}
        llm = settings.llm
        default_models = list(dict.fromkeys([llm.model, llm.effective_small_model]))
        self.providers[DEFAULT_PROVIDER] = Provider(
            DEFAULT_PROVIDER,
            "Default",
            "openai",
            llm,
            default,
            tuple(default_models),
            small_model=llm.effective_small_model,
            models=[ModelInfo(m, m, llm.context_tokens) for m in default_models],
            listed=True,
        )
        for pid, p in settings.providers.items():
            merged = provider_llm(llm, p)
            thinks = p.type == "anthropic" and p.thinking_tokens > 0
            client: ChatModel = (
                AnthropicModel(merged, pid, thinking_tokens=p.thinking_tokens)
                if p.type == "anthropic"
                else LLMClient(merged)
            )
            self.providers[pid] = Provider(
                pid,
                p.name or pid,
                p.type,
                merged,
                client,
                p.models,
                p.admin_only,
                thinks,
                p.small_model,
                models=[ModelInfo(m, m, merged.context_tokens, thinks) for m in p.models],
            )
        self._listed = asyncio.Event()

    # -- choosing --------------------------------------------------------------------------

    def visible(self, *, restricted: bool) -> list[Provider]:
        """The providers a caller may use: all, or without the admins' own."""
        return [p for p in self.providers.values() if not (restricted and p.admin_only)]

    def choose(
        self, provider: str | None, model: str | None, *, restricted: bool = False
    ) -> Choice:
        """The model an answer asked for (`provider` None: the default's); `BadRequest`
        naming what exists for an unknown provider, or a model its provider does not
        list (a provider not listed yet takes any name: it is never waited for)."""
        pid = provider or DEFAULT_PROVIDER
        visible = {p.id: p for p in self.visible(restricted=restricted)}
        chosen = visible.get(pid)
        if chosen is None:
            raise BadRequest(
                f"chatModel.provider {pid!r} does not exist: one of {', '.join(visible)}"
            )
        name = model or (chosen.configured_models or (chosen.llm.model,))[0]
        if not name and chosen.models:
            name = chosen.models[0].id
        known = chosen.model_ids()
        if known and name not in known:
            shown = ", ".join(known[:20]) + (", …" if len(known) > 20 else "")
            raise BadRequest(f"provider {pid!r} has no model {name!r}: one of {shown}")
        if not name:
            raise BadRequest(f"provider {pid!r} lists no model yet: name one in chatModel.model")
        small: ChatModel
        small_name: str
        if chosen.small_model or not self.default.configured:
            small, small_name = chosen.client, chosen.small_model or name
        else:
            default = self.providers[DEFAULT_PROVIDER]
            small, small_name = self.default, default.small_model
        bound = Bound(chosen.client, name, small, small_name, chosen.id)
        return Choice(pid, name, bound, dataclasses.replace(chosen.llm, model=name))

    def find(
        self, model: str, provider: str | None, *, restricted: bool = False
    ) -> tuple[str, str] | None:
        """A model the Perplexica UI names (`chatModel`, `chatModelProvider`): of the
        provider it names, else of the default, else of the first that lists it."""
        visible = {p.id: p for p in self.visible(restricted=restricted)}
        order = [provider] if provider in visible else []
        for pid in [*order, *visible]:
            if model in visible[pid].model_ids():
                return pid, model
        return None

    # -- listing ---------------------------------------------------------------------------

    def open(self, chores: Chores) -> None:
        if len(self.providers) == 1:
            self._listed.set()
            return
        chores.loop("model lists", self._refresh_forever)

    async def first_listing(self, timeout: float = FIRST_LISTING_SECONDS) -> None:
        """Wait (at most `timeout`) until every provider was listed once."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._listed.wait()

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            self._listed.set()
            await asyncio.sleep(REFRESH_SECONDS)

    async def refresh(self) -> None:
        """Read every provider's models (or, with `models` configured, ask it whether it
        answers), all at once; each provider's status says how it went."""
        others = [p for pid, p in self.providers.items() if pid != DEFAULT_PROVIDER]
        await asyncio.gather(*(self._list(p) for p in others))

    async def _list(self, provider: Provider) -> None:
        try:
            async with asyncio.timeout(LIST_SECONDS):
                found = await _listing(provider)
        except TimeoutError:
            provider.status, provider.error = "unreachable", "it did not answer in time"
            return
        except AppError as exc:
            unauthorized = _refused_key(exc)
            provider.status = "unauthorized" if unauthorized else "unreachable"
            provider.error = exc.message
            return
        provider.status, provider.error, provider.listed = "ok", None, True
        if not provider.configured_models:
            window, thinks = provider.llm.context_tokens, provider.thinks
            provider.models = [ModelInfo(i, n, window, thinks) for i, n in found]

    def to_json(self, *, restricted: bool) -> dict[str, Any]:
        default = self.providers[DEFAULT_PROVIDER]
        return {
            "default": {"provider": DEFAULT_PROVIDER, "model": default.llm.model},
            "providers": [p.to_json() for p in self.visible(restricted=restricted)],
        }

    async def aclose(self) -> None:
        for pid, provider in self.providers.items():
            if pid != DEFAULT_PROVIDER:
                await provider.client.aclose()


def provider_llm(llm: LLMSettings, p: ProviderSettings) -> LLMSettings:
    """`[llm]` with a provider's keys over it: every per-model key added to `[llm]`
    carries over to the providers that do not set it."""
    return dataclasses.replace(
        llm,
        base_url=p.base_url or ("https://api.anthropic.com" if p.type == "anthropic" else ""),
        api_key=p.api_key,
        model=p.models[0] if p.models else "",
        small_model=p.small_model,
        context_tokens=p.context_tokens or llm.context_tokens,
        max_output_tokens=p.max_output_tokens or llm.max_output_tokens,
        system_prompt=p.system_prompt or llm.system_prompt,
        think_tags=p.think_tags or llm.think_tags,
    )


async def _listing(provider: Provider) -> list[tuple[str, str]]:
    """The provider's models, (id, name); `ModelError`/`StreamError` when it cannot say."""
    client = provider.client
    if isinstance(client, AnthropicModel):
        return await client.models()
    llm = provider.llm
    if not llm.api_key:
        raise StreamError("no api_key is configured (a 401 is what it would answer)")
    lister = openai.AsyncOpenAI(
        base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=LIST_SECONDS
    )
    try:
        page = await lister.models.list()
        if isinstance(client, LLMClient):  # what the list says of each: tools, reasoning
            client.learned.learn_listed([m.to_dict() for m in page.data])
        return [(m.id, m.id) for m in page.data]
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 403):
            raise StreamError(f"it refused the server's API key ({exc.status_code})") from exc
        if provider.configured_models:  # some servers have no model list: it answered
            return []
        raise StreamError(f"its model list answered {exc.status_code}") from exc
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:
        raise ModelError("it cannot be reached") from exc
    finally:
        await lister.close()


def _refused_key(exc: AppError) -> bool:
    cause = exc.__cause__
    status = getattr(cause, "status_code", None)
    return status in (401, 403) or "API key" in exc.message or "api_key" in exc.message


class Bound:
    """A provider's client bound to one model: answers and tool turns with `model`,
    the small tasks (`complete`) with `small` and its `small_model`. Errors of an
    OpenAI-compatible provider other than the default name it and the model."""

    def __init__(
        self, client: ChatModel, model: str, small: ChatModel, small_model: str, provider: str
    ) -> None:
        self.client = client
        self.model = model
        self.small = small
        self.small_model = small_model
        self.provider = provider

    @property
    def configured(self) -> bool:
        return self.client.configured

    async def stream(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> AsyncIterator[Delta]:
        with self._named(model or self.model):
            async for delta in self.client.stream(messages, model=model or self.model):
                yield delta

    async def answer(
        self, messages: Sequence[Message], sink: Sink, *, model: str | None = None
    ) -> None:
        with self._named(model or self.model):
            await self.client.answer(messages, sink, model=model or self.model)

    async def complete(self, messages: Sequence[Message], **call: Unpack[Short]) -> str:
        name = call.get("model") or self.small_model
        with self._named(name):
            named: Short = {**call, "model": name or None}
            return await self.small.complete(messages, **named)

    async def tool_turn(
        self, messages: Sequence[ToolMessage], tools: Sequence[Tool], *, model: str | None = None
    ) -> ToolTurn:
        with self._named(model or self.model):
            return await self.client.tool_turn(messages, tools, model=model or self.model)

    def traits(self, model: str) -> Traits:
        return self.client.traits(model)

    async def probe(self) -> str | None:
        return await self.client.probe()

    async def aclose(self) -> None:
        """The clients are the registry's to close."""

    @contextlib.contextmanager
    def _named(self, model: str) -> Any:
        if self.provider == DEFAULT_PROVIDER or isinstance(self.client, AnthropicModel):
            yield
            return
        try:
            yield
        except (ModelError, StreamError) as exc:
            named = type(exc)(f"{exc.message} (provider {self.provider}, model {model})")
            raise named from exc
