"""compose/monitoring/: the compose file with the monitoring profile is valid, its mounts exist,
Prometheus scrapes the gateway's port, and every Grafana panel query names only metrics the
gateway really exports: checked against a live /metrics of the session engine after a finished
and a failed request (labelled counters appear on first use). Rough runtime: ~5 s.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_compose import COMPOSE

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "compose" / "monitoring"
DASHBOARDS = sorted((MONITORING / "grafana" / "dashboards").glob("*.json"))
METRIC = re.compile(r"\bconveyor:[A-Za-z_:][A-Za-z0-9_:]*")


def test_monitoring_profile_is_valid_compose() -> None:
    assert COMPOSE.exists(), f"{COMPOSE} is missing: `make test` installs it (Makefile)"
    argv = [str(COMPOSE), "--profile", "monitoring", "config", "-q"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert spec[name]["profiles"] == ["monitoring"]
        for volume in spec[name]["volumes"]:
            assert (ROOT / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
    targets = [t for job in scrape for group in job["static_configs"] for t in group["targets"]]
    gateway_port = spec["gateway"]["ports"][0].split(":")[-1]
    assert targets == [f"gateway:{gateway_port}"], targets


def _panel_queries(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    panels = list(dashboard["panels"])
    for panel in list(panels):  # rows may nest panels
        panels += panel.get("panels", [])
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in panels}


def _exported(http_url: str) -> set[str]:
    text = httpx.get(f"{http_url}/metrics", timeout=30).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_panel_query_names_an_exported_metric(engine: Any) -> None:
    assert DASHBOARDS, "no dashboard under compose/monitoring/grafana/dashboards"
    assert engine.http_url, "the session engine runs no gateway"
    model = httpx.get(f"{engine.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
    done = httpx.post(f"{engine.http_url}/v1/completions", timeout=300,
                      json={"model": model, "prompt": "Hi", "max_tokens": 2})  # fmt: skip
    assert done.status_code == 200, done.text
    too_long = {"model": model, "prompt": "Hi", "max_tokens": 10_000_000}
    failed = httpx.post(f"{engine.http_url}/v1/completions", json=too_long, timeout=60)
    assert failed.status_code == 400, failed.text  # refused by the engine: an error counted
    exported = _exported(engine.http_url)
    for path in DASHBOARDS:
        queries = _panel_queries(json.loads(path.read_text()))
        assert queries, path
        for title, exprs in queries.items():
            named = {m for expr in exprs for m in METRIC.findall(expr)}
            assert named, f"{path.name}: panel {title!r} queries no conveyor metric"
            missing = named - exported
            assert not missing, f"{path.name}: panel {title!r} names {missing}, not exported"
