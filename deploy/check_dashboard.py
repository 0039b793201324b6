"""Check that the Grafana dashboard and the Prometheus rules only query series the services export.

Offline (what tests/unit/deployment/test_monitoring.py runs): every metric name in the dashboard's and the
rules' PromQL must be a series that `services/metrics.py` exports (prometheus_client appends `_total`/`_created`
to counters and `_bucket`/`_sum`/`_count`/`_created` to histograms).

Live (for a running system): also fetch `/metrics` from the services and list the names not seen there yet
(a labelled metric appears only once a label value was set, so "not seen yet" is not always an error):

    python deploy/check_dashboard.py                                   # offline check
    python deploy/check_dashboard.py --live http://localhost:8000/metrics http://localhost:8001/metrics ...

Exit status 1 if a dashboard or rules name is not exported by services/metrics.py, or (with --live
--strict) not seen on any endpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterable

import yaml

DEPLOY_DIR = Path(__file__).resolve().parent
DASHBOARD = DEPLOY_DIR / "grafana" / "dashboards" / "dapo.json"
RULES = DEPLOY_DIR / "prometheus" / "rules.yml"

# Grafana's built-in interval variables stand where PromQL wants a duration; other `$var`s sit in strings.
_GRAFANA_INTERVAL = re.compile(r"\$__(?:rate_interval|interval|range)(?:_ms|_s)?\b"
                               r"|\$\{__(?:rate_interval|interval|range)\}")
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\(\s*(?:(?P<selector>.*),)?\s*[A-Za-z_]\w*\s*\)\s*$", re.S)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (Grafana variables allowed); ValueError if it does not parse.

    Parsed with promql-parser (a port of Prometheus' own parser), so a syntax error fails here too.
    """
    import promql_parser

    label_values = _LABEL_VALUES.match(expr)
    if label_values:  # Grafana templating: label_values([selector,] label)
        expr = label_values.group("selector") or ""
        if not expr.strip():
            return set()
    expr = _GRAFANA_INTERVAL.sub("5m", expr)
    expr = _GRAFANA_VARIABLE.sub("var", expr)
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            names.update(m.value for m in node.matchers.matchers if m.name == "__name__")

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def _dashboard_exprs(node) -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and node.get("type") == "query":
                yield value  # a templating variable's query
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from _dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_exprs(item)


def dashboard_exprs(path: str | Path = DASHBOARD) -> list[str]:
    """Every PromQL expression in a Grafana dashboard JSON (panel targets and templating queries)."""
    return list(_dashboard_exprs(json.loads(Path(path).read_text())))


def dashboard_metric_names(path: str | Path = DASHBOARD) -> set[str]:
    """Every metric name the dashboard's queries select."""
    return set().union(*(promql_metric_names(e) for e in dashboard_exprs(path)))


def rules_exprs(path: str | Path = RULES) -> list[str]:
    """Every `expr` of a Prometheus rules file (or of a PrometheusRule's spec)."""
    doc = yaml.safe_load(Path(path).read_text())
    groups = doc.get("spec", doc).get("groups", [])
    return [rule["expr"] for group in groups for rule in group.get("rules", [])]


def rules_metric_names(path: str | Path = RULES) -> set[str]:
    """Every metric name the rules' expressions select."""
    return set().union(*(promql_metric_names(e) for e in rules_exprs(path)))


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
}


def exported_series_names(module=None) -> set[str]:
    """Series names the metric objects of `services.metrics` export, suffixes included."""
    from prometheus_client.metrics import MetricWrapperBase

    if module is None:
        import services.metrics as module
    names: set[str] = set()
    for value in vars(module).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def live_series_names(metrics_text: str) -> set[str]:
    """Series names present in one /metrics response (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name for family in text_string_to_metric_families(metrics_text) for sample in family.samples}


def unknown_names(referenced: set[str], known: set[str]) -> list[str]:
    return sorted(referenced - known)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dashboard", default=str(DASHBOARD))
    parser.add_argument("--rules", default=str(RULES))
    parser.add_argument("--live", nargs="*", default=[], metavar="URL", help="/metrics URLs of running services")
    parser.add_argument("--strict", action="store_true", help="with --live: fail on names not seen yet")
    args = parser.parse_args(argv)

    referenced = dashboard_metric_names(args.dashboard) | rules_metric_names(args.rules)
    missing = unknown_names(referenced, exported_series_names())
    print(f"{len(referenced)} metric names referenced by the dashboard and rules")
    for name in missing:
        print(f"NOT IN services/metrics.py: {name}")
    status = 1 if missing else 0
    if args.live:
        import httpx

        seen: set[str] = set()
        for url in args.live:
            response = httpx.get(url, timeout=10)
            response.raise_for_status()
            seen |= live_series_names(response.text)
        not_seen = unknown_names(referenced, seen)
        print(f"{len(referenced) - len(not_seen)} of them seen on {len(args.live)} endpoint(s)")
        for name in not_seen:
            print(f"not seen yet: {name}")
        if args.strict and not_seen:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
