"""Knowledge collections (PROTOCOL §12): the engine interface (`base.py`) and its
engines, chosen here by URL, the one retrieval path (`retrieval.py`) and the service.

The engines are siblings, each in a module of its own that imports its driver; this
package imports them only when a URL names them.
"""

from __future__ import annotations

from .base import Engine


def open_engine(url: str, *, vector_cache_bytes: int = 512 << 20) -> Engine:
    """`tantivy:////abs/folder` (embedded, the default; it keeps at most
    `vector_cache_bytes` of vectors in memory), `milvus:////abs/file.db` (Milvus Lite)
    or `milvus://host:19530` (a Milvus server or cluster; `?token=…&db=…`). Drivers are
    imported lazily. Raises ValueError for another scheme."""
    scheme = url.partition(":")[0].lower()
    if scheme == "tantivy":
        from .tantivy_engine import TantivyEngine

        return TantivyEngine(url, vector_cache_bytes=vector_cache_bytes)
    if scheme in ("milvus", "milvus+https"):
        from .milvus_engine import MilvusEngine

        return MilvusEngine(url)
    raise ValueError(
        f"unsupported collections URL {url!r}: use tantivy:///folder, milvus:///file.db"
        " or milvus://host:19530"
    )
