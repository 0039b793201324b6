"""Monitoring, checked offline: the Prometheus config (deploy/prometheus/prometheus.yml: a scrape job per service,
finding every replica by DNS, and the rule files Compose mounts), the alerting rules (rules.yml: the PrometheusRule
structure, and its copy for the Prometheus operator), the Grafana dashboard (layout, datasource provisioning) and the
metric names: every name in the dashboard's and the rules' PromQL (parsed with promql-parser by
deploy/check_dashboard.py) is exported by services/metrics.py, and every metric there has a panel.

Shared paths and helpers: deploy_helpers.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import jsonschema
import pytest
from deploy_helpers import CRD_SCHEMAS, DEFAULT_PORTS, DEPLOY, K8S, SERVICES, _compose, _load_deploy_module, _yaml

check_dashboard = _load_deploy_module("check_dashboard")


# ---------------------------------------------------------------------------------------------------------------
# Prometheus.


def test_prometheus_scrapes_every_replica_of_each_service_by_dns():
    config = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    compose_services = _compose()["services"]
    for name in SERVICES:
        job = jobs[name]
        assert job.get("metrics_path", "/metrics") == "/metrics"
        (sd,) = job["dns_sd_configs"]
        assert sd["type"] == "A" and sd["names"] == [name] and name in compose_services
        assert sd["port"] == DEFAULT_PORTS[name]
        assert {"target_label": "service", "replacement": name} in job["relabel_configs"]


def test_prometheus_loads_the_rules_compose_mounts():
    config = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    mounts = dict(v.rsplit(":", 2)[:2] for v in _compose()["services"]["prometheus"]["volumes"] if v.startswith("."))
    mounted = {target: source for source, target in mounts.items()}
    for rule_file in config["rule_files"]:
        assert mounted[rule_file] == "./deploy/prometheus/rules.yml"
    assert mounted["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"


def test_rules_have_the_prometheus_rule_structure_and_parse():
    rules = _yaml(DEPLOY / "prometheus" / "rules.yml")
    schema = json.loads(CRD_SCHEMAS[("monitoring.coreos.com/v1", "PrometheusRule")].read_text())
    jsonschema.Draft202012Validator({"$defs": schema["$defs"], **schema["properties"]["spec"]}).validate(rules)
    for expr in check_dashboard.rules_exprs(DEPLOY / "prometheus" / "rules.yml"):
        assert check_dashboard.promql_metric_names(expr), expr


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="needs promtool (Debian's prometheus; .ci/run installs it)")
def test_the_alerts_fire_when_an_operator_wants_them_to_and_not_otherwise():
    """deploy/prometheus/rules_test.yml: a healthy 32B step of hours is no stall, a resumed learner that gets no
    group again is; a starting generator is not a generator far behind; one producer waiting is back-pressure,
    eight waiting a little are not."""
    result = subprocess.run(["promtool", "test", "rules", "rules_test.yml"], cwd=DEPLOY / "prometheus",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_rule_for_the_operator_has_the_same_groups():
    rule = _yaml(K8S / "components" / "prometheus-operator" / "prometheusrule.yaml")
    assert rule["spec"] == _yaml(DEPLOY / "prometheus" / "rules.yml")


# ---------------------------------------------------------------------------------------------------------------
# Grafana and metric names.


def test_dashboard_and_rules_use_only_metrics_from_services_metrics():
    exported = check_dashboard.exported_series_names()
    dashboard = check_dashboard.dashboard_metric_names(DEPLOY / "grafana" / "dashboards" / "dapo.json")
    rules = check_dashboard.rules_metric_names(DEPLOY / "prometheus" / "rules.yml")
    assert len(dashboard) >= 30
    assert check_dashboard.unknown_names(dashboard | rules, exported) == []


def test_every_metric_has_a_dashboard_panel():
    def family(series: str) -> str:
        return re.sub(r"_(bucket|sum|count|created|total)$", "", series)

    used = {family(n) for n in check_dashboard.dashboard_metric_names()}
    missing = {family(n) for n in check_dashboard.exported_series_names()} - used
    assert not missing, \
        f"metrics in services/metrics.py with no panel in deploy/grafana/dashboards/dapo.json: {missing}"


def test_metric_name_check_catches_an_unknown_name_and_a_syntax_error(tmp_path):
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "dapo.json").read_text())
    dashboard["panels"][1]["targets"][0]["expr"] = 'sum(rate(dapo_lerner_refills_total{service="learner"}[5m]))'
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(dashboard))
    unknown = check_dashboard.unknown_names(check_dashboard.dashboard_metric_names(path),
                                            check_dashboard.exported_series_names())
    assert unknown == ["dapo_lerner_refills_total"]
    with pytest.raises(ValueError):
        check_dashboard.promql_metric_names("sum(rate(dapo_learner_refills_total[5m])")


def test_promql_names_handle_grafana_variables_and_grouping():
    names = check_dashboard.promql_metric_names(
        'histogram_quantile(0.95, sum by (le) (rate(dapo_generator_reload_seconds_bucket{instance=~"$instance"}'
        "[$__rate_interval]))) / on() group_left max(dapo_learner_step offset 5m)"
    )
    assert names == {"dapo_generator_reload_seconds_bucket", "dapo_learner_step"}
    assert check_dashboard.promql_metric_names("label_values(dapo_stream_depth, stream)") == {"dapo_stream_depth"}


def test_live_series_names_reads_the_metrics_endpoint_format():
    from prometheus_client import generate_latest

    import services.metrics  # noqa: F401  (registers every metric in the default registry)

    seen = check_dashboard.live_series_names(generate_latest().decode())
    # Unlabelled metrics are exported from the start (labelled ones once a label value is used).
    assert {"dapo_learner_step", "dapo_learner_refills_total", "dapo_generator_reload_seconds_bucket",
            "dapo_generator_reload_seconds_count"} <= seen
    assert seen & check_dashboard.exported_series_names()


def test_dashboard_layout_and_datasource_provisioning():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "dapo.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        cell = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cell & cells, f"panel {panel['title']!r} overlaps another"
        cells |= cell
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
    (variable,) = dashboard["templating"]["list"]
    datasources = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    assert variable["type"] == "datasource" and variable["current"]["value"] == datasources[0]["uid"]
    assert datasources[0]["url"] == "http://prometheus:9090" and "prometheus" in _compose()["services"]
    provider = _yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "dapo.yaml")["providers"][0]
    grafana_mounts = {v.split(":")[1]: v.split(":")[0] for v in _compose()["services"]["grafana"]["volumes"]}
    assert grafana_mounts[provider["options"]["path"]] == "./deploy/grafana/dashboards"


def test_the_stall_gauge_is_read_on_the_learners_own_clock(monkeypatch):
    """DapoLearnerStalled subtracted the learner's wall clock from Prometheus's: a learner clock half an hour off
    fired it for good, or hid a stall as long. Seconds since progress are now counted where they happen."""
    import math

    from services import metrics

    def read() -> float:
        (family,) = metrics.LEARNER_SECONDS_SINCE_PROGRESS.collect()
        return family.samples[0].value

    monkeypatch.setattr(metrics, "_progressed_at", None)
    assert math.isnan(read())  # no progress yet: no stall to measure
    metrics.learner_progressed()
    now = metrics.time.monotonic()
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now + 100.0)
    assert read() == pytest.approx(100.0, abs=1.0)


def test_an_update_in_progress_is_progress_for_the_stall_alert_until_it_runs_far_past_the_last(monkeypatch):
    """The 32B recipe's first update takes 73 minutes, before any train phase is measured: DapoLearnerStalled's
    1,800 s floor fired during it on every fresh run. But a hung update (one rank: no collective timeout ends it)
    must still show: past 3 times the last update's time it is no longer progress."""
    from services import metrics

    def read() -> float:
        (family,) = metrics.LEARNER_SECONDS_SINCE_PROGRESS.collect()
        return family.samples[0].value

    monkeypatch.setattr(metrics, "_progressed_at", None)
    monkeypatch.setattr(metrics, "_update_started", None)
    monkeypatch.setattr(metrics, "_last_update_s", None)
    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    metrics.learner_updating(True)
    clock[0] += 4392.0
    assert read() == 0.0  # the first: all of it
    metrics.learner_updating(False)
    clock[0] += 60.0
    assert read() == pytest.approx(60.0)
    metrics.learner_updating(True)
    clock[0] += 3 * 4392.0
    assert read() == 0.0
    clock[0] += 1.0
    assert read() == pytest.approx(3 * 4392.0 + 1.0)  # hung
