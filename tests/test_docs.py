"""The configuration page is the settings' own definitions, rendered: it cannot drift."""

from __future__ import annotations

from app.config_doc import COMMAND, render
from tests.servers import ROOT


def test_the_configuration_page_is_what_the_settings_render():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), f"docs/configuration.md is stale: run `{COMMAND}`"


def test_every_key_of_every_section_is_described():
    undescribed = [line for line in render().splitlines() if line.endswith("|  |")]
    assert not undescribed, "keys without a `#:` line in app/config.py:\n" + "\n".join(undescribed)
