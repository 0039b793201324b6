"""`dapo run` end to end: the real services as processes, a few steps, the run folder, live /metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from deploy.check_dashboard import dashboard_metric_names, live_series_names  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 4  # the scrape happens after step 1: the steps after it keep the services up meanwhile
OVERRIDES = [
    f"learner.total_steps={STEPS}", "learner.batch.prompts_per_step=4", "learner.eval_every=2",
    "learner.checkpoints.every=2", "sampling.n=4", "eval_sampling.n=2", "data.eval_size=16",
]


def metric_families(text: str) -> set[str]:
    """Every family a /metrics page declares (labelled families with no sample yet still have # TYPE)."""
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return families | live_series_names(text)


def test_dapo_run_end_to_end_with_weights_broadcast_to_two_generators(short_tmp):
    """One `dapo run` serves both end-to-end checks (a run costs most of this test): the default run's folder,
    plots, secrets and live /metrics, with two generators and `weights.transport=collective`, where after every
    update each generator that serves and is not loading a version is in the round and takes the version from the
    stream (their logs say so), and none fails.
    The default file transport runs end to end in tests/e2e/test_run_survives.py and test_run_learner_ranks.py."""
    run_dir = Path(short_tmp) / "run"
    command = [sys.executable, "-m", "cli", "run", "--no-display", "--generators", "2", "-s", f"run_dir={run_dir}",
               "-s", "weights.transport=collective"]
    for override in OVERRIDES:
        command += ["-s", override]
    env = {**os.environ, "DAPO_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scraped: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 600
        # While it runs: scrape every service's /metrics once the first training step is logged.
        while proc.poll() is None and time.monotonic() < deadline:
            metrics_file = run_dir / "metrics.jsonl"
            services = run_dir / "services.json"
            if not scraped and services.exists() and metrics_file.exists() and any(
                json.loads(line).get("step", 0) >= 1 for line in metrics_file.read_text().splitlines() if line.strip()
            ):
                for name, url in json.loads(services.read_text())["http"].items():
                    scraped[name] = httpx.get(f"{url}/metrics", timeout=10).text
            time.sleep(0.1)  # a step of this run takes well under a second: look often, or the run is over
        output = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 0, output[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if r.get("step", 0) >= 1]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    for row in trained:
        assert row["groups_trained"] >= 1
        assert -1.0 <= row["reward_all"] <= 1.0 and 0.0 <= row["accuracy_train"] <= 1.0
        assert row["response_length"] > 0 and row["entropy"] >= 0 and row["lr"] > 0
    evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
    assert len(evals) >= 2 and all(0.0 <= e <= 1.0 for e in evals)  # baseline and at least one more

    # The weights went by broadcast: every round reached both generators, which loaded every version from it. The
    # default's max_staleness (2) delivers a version in the background while the next step runs: a step's record
    # lists the deliveries that ended during it; an evaluating step's own and the last step's are among them (they
    # are announced before the evaluation's tasks ask for them, and before the run ends).
    deliveries = [d for r in trained for d in r.get("deliveries", [])]
    assert [d["delivered_version"] for d in deliveries] == list(range(1, STEPS + 1)), trained
    for r in trained:
        if r.get("eval_accuracy") is not None or r["step"] == STEPS:
            assert r["version"] in [d["delivered_version"] for d in r["deliveries"]], r
    # `dapo run` trains as soon as one generator serves, and rounds come back to back (max_staleness 2): a generator
    # that is still loading a version (from the files: its engine came up after a round read its members; or from
    # the last round, draining) is listed `busy` and sits that round out, taking the version from the files. So:
    # no round failed, all on the learner's host (sealed memory, not the chain: tests/integration/test_generator.py),
    # each version was loaded by broadcast by exactly its round's members, and each generator took some by
    # broadcast and served every version once at most, in order, up to the last.
    rounds = [(d["broadcast_members"], d["broadcast_nearby"], d["broadcast_failed"]) for d in deliveries]
    assert all(failed == 0 and nearby == members >= 1 for members, nearby, failed in rounds), rounds
    assert all(d["broadcast_bytes"] > 0 and d["broadcast_seconds"] > 0 for d in deliveries)
    streamed_to = dict.fromkeys(range(1, STEPS + 1), 0)
    for name in ("generator-0", "generator-1"):
        log_text = (run_dir / "logs" / f"{name}.log").read_text()
        served = [line for line in log_text.splitlines() if "now serving weights" in line]
        versions = [int(line.split("now serving weights v")[1].split()[0]) for line in served]
        assert versions == sorted(set(versions)) and versions[0] == 0 and versions[-1] == STEPS, served
        streamed = [version for version, line in zip(versions, served) if "broadcast" in line]
        assert streamed, served
        for version in streamed:
            streamed_to[version] += 1
    assert [streamed_to[version] for version in range(1, STEPS + 1)] == [members for members, _, _ in rounds]

    for plot in ("reward", "eval_accuracy", "response_length", "entropy", "clip_fractions"):
        png = run_dir / "plots" / f"{plot}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["eval_accuracy_first"] is not None
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoints" / "latest").exists()

    # Secrets: the run made its own token; the file the children read holds none and is private; no pickles.
    launch = run_dir / "launch-config.yaml"
    assert launch.stat().st_mode & 0o777 == 0o600 and "token" not in yaml.safe_load(launch.read_text())
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".yaml", ".json", ".jsonl", ".log") and "change-me" in p.read_text()]
    assert not [p for p in files if p.suffix in (".pkl", ".bin", ".pt")]

    # The Grafana dashboard only uses names that the live services really export.
    assert set(scraped) == {"learner", "generator-0", "generator-1", "reward-0"}, scraped.keys()
    exported = set().union(*(metric_families(text) for text in scraped.values()))
    referenced = dashboard_metric_names()
    base = {name for name in referenced if name.removesuffix("_total").removesuffix("_bucket")
            .removesuffix("_sum").removesuffix("_count") in exported or name in exported}
    assert base == referenced, sorted(referenced - base)
    step_line = next(line for line in scraped["learner"].splitlines() if line.startswith("dapo_learner_step "))
    assert float(step_line.split()[1]) >= 1  # scraped after the first step
