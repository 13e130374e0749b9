"""Unit tests share one process: keep global logging configuration from leaking between tests."""

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """A test that calls configure_logging (level, cached loggers) must not filter the log lines
    a later test captures with structlog.testing.capture_logs."""
    yield
    structlog.reset_defaults()
