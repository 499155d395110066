"""Admin commands of the collections engine, with the server's settings (config.toml
and the environment, as `python -m app` reads them):

    python -m app.collections reembed [SPACE ...]   embed every passage again with
                                                    embeddings.model (all spaces: every
                                                    collection and every user's uploads)
    python -m app.collections spaces                list the engine's spaces

Run `reembed` after changing the embeddings model; searches go on meanwhile, with the
old vectors until a space's new ones are all made and swapped in at once (a model that
fails midway leaves the space as it was). Run it while no import is running: passages
added to a space after it was read keep the vectors they were given. With several
server processes on the embedded engine, run it while they are idle: the engine has
one writer per space at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from .. import config
from ..model import Embedder
from . import open_engine
from .retrieval import reembed


async def run(settings: config.Settings, command: str, spaces: Sequence[str]) -> str:
    """Run one command; what it prints."""
    async with open_engine(
        settings.collections.url, vector_cache_bytes=settings.collections.vector_cache_mb << 20
    ) as engine:
        if command == "spaces":
            return "\n".join(await engine.spaces())
        embedder = Embedder(settings.embeddings)
        try:
            chosen = list(spaces) or await engine.spaces()
            count = await reembed(engine, embedder, chosen, settings.uploads.embed_batch)
        finally:
            await embedder.aclose()
        model = settings.embeddings.model or "none (BM25 alone)"
        return f"re-embedded {count} passages in {len(chosen)} spaces with {model}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.collections",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["reembed", "spaces"])
    parser.add_argument("spaces", nargs="*", help="collection ids or uploads-<userId>")
    args = parser.parse_args(argv)
    print(asyncio.run(run(config.load(), args.command, args.spaces)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
