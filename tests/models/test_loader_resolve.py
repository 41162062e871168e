"""Resolving model names: local directories, the HF cache through huggingface_hub's real code
path (offline, and with the Hub unreachable), Hub errors from a local fake endpoint, and the
one-line errors that name the model and suggest the bundled one."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from model_fixtures import GPT2_COMMIT

from flowllm.config import BUNDLED_MODEL
from flowllm.models.load_errors import HubUnreachableError, ModelLoadError, ModelNotFoundError
from flowllm.models.loader import ResolvedModel, hub_cache_dir, load_model, resolve_model

CLOSED_PORT_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens, connect refused


def _one_line(err: BaseException, *needles: str) -> str:
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    return text


def _go_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear offline mode, including huggingface_hub's copy of it, which it reads from the
    environment once, at import, and which would otherwise depend on test order."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def empty_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache, online (tests point HF_ENDPOINT somewhere local)."""
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    _go_online(monkeypatch)
    return home


def test_local_directory(gpt2_tiny_dir: Path) -> None:
    resolved = resolve_model(str(gpt2_tiny_dir))
    assert resolved == ResolvedModel(path=gpt2_tiny_dir.resolve(), name=str(gpt2_tiny_dir))


def test_local_directory_relative(gpt2_tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(gpt2_tiny_dir.parent)
    resolved = resolve_model(f"./{gpt2_tiny_dir.name}")
    assert resolved.path == gpt2_tiny_dir.resolve()


@pytest.mark.parametrize("name", ["./no-such-model", "/no/such/model/dir", "a/b/c"])
def test_missing_local_directory(name: str, empty_hf_home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(name)
    _one_line(e.value, name, "does not exist")


def test_invalid_name(empty_hf_home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("not a model!")
    _one_line(e.value, "not a model!", "local directory", "Hub id")


def test_local_file_is_not_a_model(gpt2_tiny_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(gpt2_tiny_dir / "config.json"))
    _one_line(e.value, "config.json", "directory")


def test_hf_cache_env_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "a"))
    assert hub_cache_dir() == tmp_path / "a" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "b"))
    assert hub_cache_dir() == tmp_path / "b"


@pytest.mark.parametrize("name", ["gpt2", "openai-community/gpt2"])
def test_gpt2_from_hf_cache_offline(name: str, hf_home_with_gpt2: Path) -> None:
    resolved = resolve_model(name)
    snapshots = hf_home_with_gpt2 / "hub" / "models--openai-community--gpt2" / "snapshots"
    assert resolved.path == snapshots / GPT2_COMMIT
    assert resolved.name == name
    assert (resolved.path / "config.json").is_file()


def test_load_gpt2_from_hf_cache_offline(hf_home_with_gpt2: Path) -> None:
    loaded = load_model("gpt2", dtype="float32", device="cpu")
    assert loaded.name == "gpt2" and loaded.path.name == GPT2_COMMIT
    assert loaded.hf_config.n_layer == 2
    assert loaded.generation_config["eos_token_id"] == 50256


def test_cached_model_used_when_hub_unreachable(
    hf_home_with_gpt2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not offline, but the Hub refuses connections: the cached snapshot is still served."""
    _go_online(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT_ENDPOINT)
    assert resolve_model("gpt2").path.name == GPT2_COMMIT


def test_offline_and_not_cached(empty_hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachableError) as e:
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    _one_line(e.value, "HuggingFaceTB/SmolLM2-360M-Instruct", BUNDLED_MODEL, "HF_HUB_OFFLINE")


def test_gpt2_alias_named_in_error(empty_hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachableError) as e:
        load_model("gpt2", dtype="float32", device="cpu")
    _one_line(e.value, "'gpt2'", "openai-community/gpt2", BUNDLED_MODEL)


def test_hub_unreachable_fails_fast(empty_hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT_ENDPOINT)
    start = time.monotonic()
    with pytest.raises(HubUnreachableError) as e:
        resolve_model("gpt2")
    assert time.monotonic() - start < 10.0
    _one_line(e.value, "gpt2", "cannot be reached", BUNDLED_MODEL)


def test_incomplete_cache_when_offline(
    hf_home_with_gpt2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = hf_home_with_gpt2 / "hub" / "models--openai-community--gpt2" / "snapshots"
    link = snapshot / GPT2_COMMIT / "tokenizer.json"
    target = link.readlink()
    link.unlink()
    try:
        with pytest.raises(HubUnreachableError) as e:
            resolve_model("gpt2")
        _one_line(e.value, "gpt2", "partly", BUNDLED_MODEL)
    finally:
        link.symlink_to(target)


class _FakeHub:
    """A local HTTP endpoint answering every request with one status and error code,
    recording each request's path and Authorization header."""

    def __init__(self, status: int, error_code: str) -> None:
        self.requests: list[tuple[str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.requests.append((self.path, self.headers.get("Authorization")))
                body = json.dumps({"error": f"{error_code} (fake hub)"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Error-Code", error_code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub_factory(
    empty_hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[type[_FakeHub]]:
    monkeypatch.setenv("HF_TOKEN", "hf_flowllm_test_token")
    yield _FakeHub


@pytest.mark.parametrize(
    ("status", "code", "needle"),
    [(404, "RepoNotFound", "HF_TOKEN"), (401, "RepoNotFound", "HF_TOKEN"),
     (403, "GatedRepo", "gated")],
)
def test_hub_errors_and_token(
    fake_hub_factory: type[_FakeHub],
    monkeypatch: pytest.MonkeyPatch,
    status: int,
    code: str,
    needle: str,
) -> None:
    with fake_hub_factory(status, code) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(ModelNotFoundError) as e:
            resolve_model("someone/not-a-model")
    _one_line(e.value, "someone/not-a-model", needle)
    repo_requests = [auth for path, auth in hub.requests if path.startswith("/api/models/")]
    assert repo_requests and all(a == "Bearer hf_flowllm_test_token" for a in repo_requests)


def test_all_errors_are_model_load_errors() -> None:
    for cls in (HubUnreachableError, ModelNotFoundError):
        assert issubclass(cls, ModelLoadError)


def test_hub_download_selects_serving_files_only() -> None:
    """The patterns, applied by huggingface_hub's own filter, keep config, tokenizer and
    HF-format safetensors, and drop pickles, duplicates and sub-folders."""
    from huggingface_hub.utils import filter_repo_objects

    from flowllm.models.loader import HUB_ALLOW_PATTERNS, HUB_IGNORE_PATTERNS

    repo = [
        "README.md", "config.json", "generation_config.json", "model.safetensors",
        "model-00001-of-00002.safetensors", "model.safetensors.index.json",
        "consolidated.safetensors", "pytorch_model.bin", "onnx/model.safetensors",
        "original/params.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
        "merges.txt", "special_tokens_map.json", "chat_template.jinja", "flax_model.msgpack",
    ]
    kept = set(
        filter_repo_objects(
            repo, allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS
        )
    )
    assert kept == {
        "config.json", "generation_config.json", "model.safetensors",
        "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
        "chat_template.jinja",
    }
