"""`flowllm serve`'s security flags, without a server: the key, the exposure warning,
CORS and TLS settings."""

from __future__ import annotations

import argparse
import ssl

import pytest

from flowllm.cli import build_parser
from flowllm.cli.serve import ssl_settings
from flowllm.serve_flags import (
    ServeError,
    cors_config,
    exposure_warning,
    is_loopback,
    resolve_api_key,
)


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_resolve_api_key() -> None:
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key("k", {"FLOWLLM_API_KEY": "other"}) == "k"
    assert resolve_api_key(None, {"FLOWLLM_API_KEY": "env"}) == "env"
    with pytest.raises(ServeError, match="--api-key is empty"):
        resolve_api_key("", {})
    with pytest.raises(ServeError, match="FLOWLLM_API_KEY is empty"):
        resolve_api_key(None, {"FLOWLLM_API_KEY": " "})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.5", False),
        ("myhost.example", False),
    ],
)
def test_exposure_warning(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    warning = exposure_warning(host, None)
    assert (warning is None) is loopback
    if warning is not None:
        assert host in warning and "--api-key" in warning
    assert exposure_warning(host, "key") is None


def test_cors_is_off_by_default() -> None:
    assert cors_config(serve_args()) is None


def test_cors_flags_take_json_lists() -> None:
    config = cors_config(
        serve_args(
            "--allowed-origins", '["https://a.example", "https://b.example"]',
            "--allowed-methods", '["GET", "POST"]',
            "--allowed-headers", '["authorization"]',
            "--allow-credentials",
        )
    )  # fmt: skip
    assert config is not None
    assert config.allow_origins == ["https://a.example", "https://b.example"]
    assert config.allow_methods == ["GET", "POST"]
    assert config.allow_headers == ["authorization"]
    assert config.allow_credentials is True
    defaults = cors_config(serve_args("--allowed-origins", '["*"]'))
    assert defaults is not None
    assert (defaults.allow_methods, defaults.allow_headers) == (["*"], ["*"])
    assert defaults.allow_credentials is False


@pytest.mark.parametrize("value", ["https://a.example", '{"a": 1}', "[1]", "["])
def test_cors_flags_refuse_anything_but_a_list_of_strings(value: str) -> None:
    with pytest.raises(SystemExit):
        serve_args("--allowed-origins", value)


def test_cors_flags_without_origins_are_an_error() -> None:
    with pytest.raises(ServeError, match="needs --allowed-origins"):
        cors_config(serve_args("--allow-credentials"))


def test_ssl_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert ssl_settings(serve_args()) == {}
    cert, key, ca = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    for path in (cert, key, ca):
        path.write_text("x")
    settings = ssl_settings(
        serve_args(
            "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
            "--ssl-ca-certs", str(ca), "--ssl-cert-reqs", "2",
        )
    )  # fmt: skip
    assert settings == {
        "ssl_keyfile": str(key),
        "ssl_certfile": str(cert),
        "ssl_ca_certs": str(ca),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    with pytest.raises(ServeError, match="needs --ssl-certfile"):
        ssl_settings(serve_args("--ssl-keyfile", str(key)))
    with pytest.raises(ServeError, match="no such file"):
        ssl_settings(serve_args("--ssl-certfile", str(tmp_path / "missing.pem")))
    with pytest.raises(ServeError, match="needs --ssl-ca-certs"):
        ssl_settings(serve_args("--ssl-certfile", str(cert), "--ssl-cert-reqs", "2"))
    with pytest.raises(ServeError, match="must be 0"):
        ssl_settings(serve_args("--ssl-certfile", str(cert), "--ssl-cert-reqs", "7"))
