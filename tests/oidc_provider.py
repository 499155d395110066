"""A real OpenID Connect provider for tests: npm's oidc-provider (tests/oidc/provider.mjs),
installed into a cache by scripts/oidc_provider.sh and run on a loopback port."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from app.config import Settings
from app.main import create_app
from tests.servers import ROOT, ServerThread, free_port, npm_packages, wait_for_port

CLIENT_ID = "searchchat-test"
CLIENT_SECRET = "a client secret for the tests only"
LOGIN, PASSWORD = "alice", "wonderland-password"
SUB, EMAIL, NAME = "alice-sub", "alice@example.test", "Alice Liddell"


def provider_home() -> str:
    """Where oidc-provider is installed (installed on first use)."""
    return npm_packages("oidc_provider.sh")


class OidcProvider:
    """The provider on 127.0.0.1:<port>, with one client whose redirect URI is given."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="oidc-", suffix=".log", delete=False)  # noqa: SIM115

    def start(self, redirect_uri: str) -> OidcProvider:
        env = {
            **os.environ,
            "OIDC_PROVIDER_HOME": provider_home(),
            "PORT": str(self.port),
            "OIDC_CLIENT_ID": CLIENT_ID,
            "OIDC_CLIENT_SECRET": CLIENT_SECRET,
            "OIDC_REDIRECT_URI": redirect_uri,
            "NODE_ENV": "test",
        }
        self.proc = subprocess.Popen(
            ["node", str(ROOT / "tests" / "oidc" / "provider.mjs")],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.port, timeout=30)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"the OIDC provider did not start:\n{self.output()}") from None
        return self

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()


@contextlib.contextmanager
def server_with_oidc(
    settings: Settings, **auth: object
) -> Iterator[tuple[ServerThread, OidcProvider]]:
    """Our server with accounts and sign-in through a provider started for it (whose one
    client's redirect URI is our callback)."""
    port = free_port()
    configured = settings.replace(
        auth={
            "mode": "accounts",
            "oidc": {
                "issuer": f"http://127.0.0.1:{port}",
                "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET,
                "name": "Test IdP",
            },
            **auth,
        }
    )
    server = ServerThread(create_app(configured))
    provider = OidcProvider(port).start(server.url + "/api/auth/oidc/callback")
    try:
        server.start()
        yield server, provider
    finally:
        server.stop()
        provider.stop()
