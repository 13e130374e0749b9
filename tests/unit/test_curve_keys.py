"""shared/curve.py key folders: what `conveyor keys generate` writes and what each link's
start-up check refuses (the e2e side, handshakes on real sockets: tests/e2e/test_curve.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shared.curve import (
    AUTHORIZED_FRONTENDS_DIR,
    check_frontend_keys,
    check_server_keys,
    frontend_secret_path,
    generate_keys,
)


def test_a_folder_without_the_frontend_pair_is_refused_with_the_fix(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    check_frontend_keys(keys)  # a fresh folder has everything
    check_server_keys(keys, AUTHORIZED_FRONTENDS_DIR)
    frontend_secret_path(keys).unlink()  # as made before the tokenizer -> scheduler link had CURVE
    with pytest.raises(ValueError, match="conveyor keys generate"):
        check_frontend_keys(keys)
    shutil.rmtree(keys / AUTHORIZED_FRONTENDS_DIR)
    with pytest.raises(ValueError, match=AUTHORIZED_FRONTENDS_DIR):
        check_server_keys(keys, AUTHORIZED_FRONTENDS_DIR)
