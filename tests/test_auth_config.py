"""The `[auth]` keys of PROTOCOL §8: nested tables (`[auth.oidc]`, `[auth.jwt]`) from the
file and from `AUTH_OIDC_*` / `AUTH_JWT_*`, the mode they need, and secrets kept out of
reprs."""

from __future__ import annotations

import pytest

from app.config import Settings, SettingsError, auth_mode, load


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_nested_auth_tables_from_the_file_then_the_environment(tmp_path):
    path = write(
        tmp_path,
        '[auth]\nmode = "accounts"\nsignup = "invite"\nsession_days = 7\n'
        '[auth.oidc]\nissuer = "https://idp.example"\nclient_id = "web"\nclient_secret = "s3"\n'
        '[auth.jwt]\njwks_url = "https://idp.example/jwks"\naudience = "api"\n'
        "[limits]\ntokens_per_day = 5000\n",
    )
    settings = load(path, env={})
    auth = settings.auth
    assert (auth.mode, auth.signup, auth.session_days) == ("accounts", "invite", 7.0)
    assert (auth.oidc.issuer, auth.oidc.client_id, auth.oidc.client_secret) == (
        "https://idp.example",
        "web",
        "s3",
    )
    assert (auth.jwt.jwks_url, auth.jwt.audience) == ("https://idp.example/jwks", "api")
    assert settings.limits.tokens_per_day == 5000
    env = {
        "AUTH_OIDC_ISSUER": "https://other.example",
        "AUTH_OIDC_SCOPES": "openid,email",
        "AUTH_JWT_AUDIENCE": "mobile",
        "AUTH_SIGNUP": "closed",
        "LIMITS_TOKENS_PER_DAY": "10",
    }
    settings = load(path, env=env)
    assert settings.auth.oidc.issuer == "https://other.example"
    assert settings.auth.oidc.client_id == "web"  # the file's, where the environment is silent
    assert settings.auth.oidc.scopes == ("openid", "email")
    assert settings.auth.jwt.audience == "mobile"
    assert settings.auth.signup == "closed"
    assert settings.limits.tokens_per_day == 10


def test_unknown_nested_keys_and_bad_values_are_refused(tmp_path):
    with pytest.raises(SettingsError, match=r"\[auth.oidc\]"):
        load(write(tmp_path, '[auth]\nmode = "accounts"\n[auth.oidc]\nissuerr = "x"\n'), env={})
    with pytest.raises(SettingsError, match="auth.mode"):
        load(write(tmp_path, '[auth]\nmode = "sometimes"\n'), env={})
    with pytest.raises(SettingsError, match="auth.signup"):
        load(write(tmp_path, '[auth]\nmode = "accounts"\nsignup = "maybe"\n'), env={})
    with pytest.raises(SettingsError, match="accounts"):  # OIDC users are accounts
        load(write(tmp_path, '[auth.oidc]\nissuer = "https://i"\nclient_id = "c"\n'), env={})
    with pytest.raises(SettingsError, match="audience"):  # any app of the issuer otherwise
        load(
            write(tmp_path, '[auth]\nmode = "accounts"\n[auth.jwt]\nissuer = "https://i"\n'), env={}
        )


def test_static_keys_alone_mean_keys_mode():
    assert auth_mode(Settings().auth) == "off"
    assert auth_mode(Settings().replace(auth={"api_keys": {"k": "1"}}).auth) == "keys"
    assert auth_mode(Settings().replace(auth={"mode": "accounts"}).auth) == "accounts"
    nested = Settings().replace(auth={"mode": "accounts", "jwt": {"secret": "x" * 32}})
    assert nested.auth.jwt.secret == "x" * 32 and nested.auth.jwt.audience == ""


def test_secrets_are_not_in_reprs():
    settings = Settings().replace(
        llm={"api_key": "sk-llm-secret"},
        auth={
            "api_keys": {"static-key-secret": "1"},
            "mode": "accounts",
            "oidc": {"issuer": "https://i", "client_id": "c", "client_secret": "oidc-secret"},
            "jwt": {"secret": "jwt-hs256-secret"},
        },
    )
    text = repr(settings)
    for secret in ("sk-llm-secret", "static-key-secret", "oidc-secret", "jwt-hs256-secret"):
        assert secret not in text
    assert "https://i" in text  # what is not secret stays readable
