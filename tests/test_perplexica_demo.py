"""The Perplexica UI against the built-in demo model and demo search: a newcomer with no
key anywhere gets a streamed, cited answer in it (README "Two commands", `--demo`)."""

from __future__ import annotations

import pytest

from app.config import Settings
from tests import perplexica
from tests.perplexica import FAILED_TO_CONNECT, UI

pytestmark = pytest.mark.perplexica_ui

perplexica_build = perplexica.perplexica_build
perplexica_ui = perplexica.perplexica_ui
backend = perplexica.backend
chromium = perplexica.chromium
ui = perplexica.ui
ui_defaults = perplexica.ui_defaults
searxng_recorder = perplexica.searxng_recorder
searxng = perplexica.searxng


@pytest.fixture(scope="module")
def perplexica_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """What `python -m app --demo` runs, on the port the UI build talks to."""
    store = tmp_path_factory.mktemp("perplexica-demo") / "chat.db"
    return Settings().replace(
        llm={"base_url": "demo://?pace=0.005", "model": "demo", "api_key": ""},
        search={"provider": "demo"},
        store={"url": f"sqlite:///{store}"},
        server={"cors_origins": ("*",), "shutdown_grace_seconds": 2.0},
    )


def test_the_demo_answers_in_the_perplexica_ui_with_sources(ui: UI) -> None:
    ui.home()
    ui.see(ui.page.get_by_text("Research begins here."), "the empty chat")
    ui.ask("What is a methane rocket engine?")
    ui.see(ui.page.get_by_text("Demo answer", exact=False).first, "the demo's answer")
    assert ui.page.get_by_text(FAILED_TO_CONNECT).count() == 0, ui.report()
    titles = ui.source_titles()
    assert titles and all("(demo)" in t or t == "All Sources" for t in titles), titles
    chunks = [f["data"] for f in ui.received("message")]
    assert len(chunks) > 10 and "[1]" in "".join(chunks)
