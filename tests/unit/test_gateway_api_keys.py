"""Several API keys, each with the latency-target class of its requests (services/gateway/
api_keys.py): the key file's syntax and errors, which key a header matches, and through the real
app that every key of the file (and `--api-key` beside it) opens /v1 while others get 401. That
the class reaches the engine is tested on a real stack (tests/e2e/test_slo_policy.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.gateway.api_keys import ApiKey, ApiKeys, parse_key_file
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from shared.logging import configure_logging

KEY_FILE = """\
# team keys
sk-dash   interactive
sk-nightly batch   # the nightly jobs

sk-plain
"""


def _scope(header: bytes | None) -> dict:
    return {"type": "http", "headers": [] if header is None else [(b"authorization", header)]}


def test_key_file_lines_give_keys_and_classes() -> None:
    keys = parse_key_file(KEY_FILE)
    assert keys == [ApiKey("sk-dash", "interactive"), ApiKey("sk-nightly", "batch"),
                    ApiKey("sk-plain", None)]  # fmt: skip


@pytest.mark.parametrize(
    "text, problem",
    [("sk-a x y\n", "line 1: want 'KEY [SLO_CLASS]'"), ("sk-a\nsk-a b\n", "line 2: the same key"),
     ("# nothing\n\n", "holds no key")],
)  # fmt: skip
def test_a_bad_key_file_names_its_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_key_file(text)


def test_a_header_matches_its_key_and_only_it(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    keys = ApiKeys.load("sk-single", path)
    assert keys is not None
    assert keys.match(_scope(b"Bearer sk-dash")) == ApiKey("sk-dash", "interactive")
    assert keys.match(_scope(b"Bearer sk-nightly")) == ApiKey("sk-nightly", "batch")
    assert keys.match(_scope(b"Bearer sk-plain")) == ApiKey("sk-plain")
    assert keys.match(_scope(b"Bearer sk-single")) == ApiKey("sk-single")
    for refused in (None, b"Bearer sk-das", b"Bearer sk-dash ", b"sk-dash", b"Bearer interactive"):
        assert keys.match(_scope(refused)) is None, refused
    assert ApiKeys.load(None, None) is None  # no key at all: no authentication


def test_the_config_refuses_a_missing_or_bad_file_and_a_key_given_twice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="api_key_file"):
        GatewayConfig(api_key_file=tmp_path / "absent")
    bad = tmp_path / "bad"
    bad.write_text("a b c\n")
    with pytest.raises(ValueError, match="line 1"):
        GatewayConfig(api_key_file=bad)
    good = tmp_path / "good"
    good.write_text("sk-x\n")
    with pytest.raises(ValueError, match="also in"):
        GatewayConfig(api_key="sk-x", api_key_file=good)
    assert GatewayConfig(api_key_file=good).requires_key


def test_every_key_of_the_file_opens_v1_and_others_get_401(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    config = GatewayConfig(engine_addr="tcp://127.0.0.1:9", api_key="sk-single", api_key_file=path)
    http = TestClient(create_app(config, configure_logging("gateway-test", "warning")))
    for key in ("sk-dash", "sk-nightly", "sk-plain", "sk-single"):
        r = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, key
    for headers in ({}, {"Authorization": "Bearer sk-other"}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
