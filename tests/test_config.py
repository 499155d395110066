"""Loading `config.toml` and the environment overrides of PROTOCOL §8."""

from __future__ import annotations

import pytest

from app.config import SettingsError, load


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_repository_config_holds_the_documented_defaults():
    settings = load(env={"APP_CONFIG": ""})
    assert settings.server.port == 8080
    assert settings.llm.model == "deepseek-reasoner"
    assert settings.stream.replay_ttl_seconds == 300


def test_file_then_environment(tmp_path):
    path = write(
        tmp_path,
        '[server]\nport = 9000\ncors_origins = ["https://a"]\n[llm]\nmodel = "m"\napi_key = "k"\n'
        '[reader]\nallow_private_networks = true\n[auth]\napi_keys = { "key1" = "11" }\n',
    )
    settings = load(path, env={})
    assert settings.server.port == 9000
    assert settings.server.cors_origins == ("https://a",)
    assert settings.llm.effective_small_model == "m"
    assert settings.embeddings.api_key == "k"  # derived from llm
    assert settings.reader.allow_private_networks is True
    assert dict(settings.auth.api_keys) == {"key1": "11"}

    env = {
        "PORT": "7000",
        "LLM_MODEL": "other",
        "LLM_SMALL_MODEL": "small",
        "LLM_TIMEOUT_SECONDS": "1.5",
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "REDIS_CLUSTER": "true",
        "SERVER_CORS_ORIGINS": "https://x, https://y",
        "READER_ALLOW_PRIVATE_NETWORKS": "false",
        "AUTH_API_KEYS": "key1:user1,key2:22",
        "EMBEDDINGS_API_KEY": "ek",
    }
    settings = load(path, env=env)
    assert settings.server.port == 7000
    assert (settings.llm.model, settings.llm.effective_small_model) == ("other", "small")
    assert settings.llm.timeout_seconds == 1.5
    assert settings.redis.url == "redis://127.0.0.1:1/0"
    assert settings.redis.cluster is True
    assert settings.server.cors_origins == ("https://x", "https://y")
    assert settings.reader.allow_private_networks is False
    assert dict(settings.auth.api_keys) == {"key1": "user1", "key2": "22"}
    assert settings.embeddings.api_key == "ek"


def test_app_config_points_elsewhere(tmp_path):
    path = write(tmp_path, "[search]\nprovider = 'searxng'\n")
    assert load(env={"APP_CONFIG": str(path)}).search.provider == "searxng"
    with pytest.raises(SettingsError, match="not found"):
        load(env={"APP_CONFIG": str(tmp_path / "missing.toml")})


@pytest.mark.parametrize(
    "text",
    [
        "[server]\nport = 'x'\n",
        "[server]\nnope = 1\n",
        "server = 3\n",
        "[llm]\ntimeout_seconds = true\n",
    ],
)
def test_bad_file_values_fail_at_start(tmp_path, text):
    with pytest.raises(SettingsError):
        load(write(tmp_path, text), env={})


def test_bad_environment_values_fail_at_start():
    with pytest.raises(SettingsError, match="PORT"):
        load(env={"APP_CONFIG": "", "PORT": "eighty"})
    with pytest.raises(SettingsError, match="AUTH_API_KEYS"):
        load(env={"APP_CONFIG": "", "AUTH_API_KEYS": "justakey"})


def test_a_relative_sqlite_path_is_beside_the_config_file(tmp_path):
    folder = tmp_path / "deploy"
    folder.mkdir()
    (folder / "config.toml").write_text('[store]\nurl = "sqlite:///data/chat.db"\n')
    settings = load(folder / "config.toml", env={})
    assert settings.store.url == f"sqlite:///{folder}/data/chat.db"
    absolute = load(folder / "config.toml", env={"STORE_URL": "sqlite:////srv/x.db"})
    assert absolute.store.url == "sqlite:////srv/x.db"
    postgres = load(folder / "config.toml", env={"STORE_URL": "postgresql://db/chat"})
    assert postgres.store.url == "postgresql://db/chat"


def test_collections_settings_nest_the_reranker_and_sit_beside_the_config_file(tmp_path):
    text = '[collections]\nurl = "tantivy:///idx"\nrerank.url = "http://r/rerank"\n'
    path = write(tmp_path, text + 'rerank.model = "rr"\n')
    settings = load(path, env={"COLLECTIONS_RERANK_MODEL": "other", "COLLECTIONS_RRF_K": "10"})
    assert settings.collections.url == f"tantivy:///{tmp_path}/idx"
    assert settings.collections.rerank.url == "http://r/rerank"
    assert settings.collections.rerank.model == "other"
    assert settings.collections.rrf_k == 10
    server = load(path, env={"COLLECTIONS_URL": "milvus://milvus:19530"})
    assert server.collections.url == "milvus://milvus:19530"
    with pytest.raises(SettingsError, match=r"collections.rerank"):
        load(write(tmp_path, "[collections]\nrerank.nope = 1\n"), env={})
