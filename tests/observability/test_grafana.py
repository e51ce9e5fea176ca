"""The Grafana dashboard reads only series that /metrics exposes, with the labels it uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from control_plane.observability.metrics import OpsMetrics
from tests.observability.helpers import observe
from worker.protocol import WorkerAnnounce, WorkerHeartbeat

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tokenmill.json"
SERIES = re.compile(r"\b(vllm:[a-z0-9_]+|tokenmill_[a-z0-9_]+)")
BY_LABELS = re.compile(r"by \(([^)]*)\)")


def exposition() -> str:
    """/metrics once each API has been called; the gateway and the worker name the model
    differently (a Hugging Face id, the SKU name), as in `tokenmill up`."""
    m = OpsMetrics()
    observe(
        m, sku="s", model="org/Model-7B", itl_s=[0.01], e2e_s=0.3, prompt_tokens=1, cached_tokens=1
    )
    m.refuse_admission("rate_limited", "s")
    m.set_open_reservations("s", 1, tokens=10)
    m.set_projection_lag("usage_ledger", 1, seconds=0.1)
    m.observe_event_append("control", 0.001)
    m.update_worker(
        WorkerAnnounce(worker_id="w", sku_id="s", model="worker-name", backend="t", capacity=1)
    )
    m.update_worker(
        WorkerHeartbeat(worker_id="w", sku_id="s", running=1, waiting=0, kv_pressure=0.1, ts=0)
    )
    return m.exposition().decode()


def label_values() -> dict[str, dict[str, set[str]]]:
    """Per sample name: each label's values."""
    out: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(exposition()):
        for sample in family.samples:
            for label, v in sample.labels.items():
                out.setdefault(sample.name, {}).setdefault(label, set()).add(v)
            out.setdefault(sample.name, {})
    return out


def exposed() -> dict[str, set[str]]:
    """Every sample name /metrics emits, with its label names."""
    return {name: set(labels) for name, labels in label_values().items()}


LABEL_VALUES = re.compile(r"label_values\(([^,]+), *([a-z_]+)\)")
MATCHER = re.compile(r'([a-z_]+)=~"\$([a-z_]+)\|?"')


def test_each_filter_value_selects_series_on_every_panel_that_filters_by_it() -> None:
    """A variable's values (from one series' label) must be values of the label each panel
    matches it against: a model filter that blanks the load panels is a broken dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = label_values()
    choices: dict[str, set[str]] = {}
    for var in dashboard["templating"]["list"][1:]:
        found = LABEL_VALUES.search(var["query"]["query"])
        assert found, var["query"]
        series, label = found.group(1).strip(), found.group(2)
        choices[var["name"]] = values[series][label]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    checked = 0
    for expr in exprs:
        for name in SERIES.findall(expr):
            for label, var in MATCHER.findall(expr):
                assert var in choices, f"{expr!r} uses an undefined ${var}"
                assert choices[var] <= values[name].get(label, set()), (
                    f"${var} = {sorted(choices[var])} selects nothing of {name}{{{label}}}"
                    f" = {sorted(values[name].get(label, set()))}"
                )
                checked += 1
    assert checked >= 15


def test_every_panel_query_uses_exposed_series_and_labels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    available = exposed()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    for expr in exprs:
        used = SERIES.findall(expr)
        assert used, expr
        for name in used:
            assert name in available, f"{name} (in {expr!r}) is not exposed"
            for group in BY_LABELS.findall(expr):
                for label in (x.strip() for x in group.split(",")):
                    assert label == "le" or label in available[name], f"{name} has no label {label}"
    for var in dashboard["templating"]["list"][1:]:
        name = SERIES.search(var["query"]["query"])
        assert name and name.group(1) in available


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        assert g["x"] + g["w"] <= 24
        cells |= mine
