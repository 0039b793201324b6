"""The docker-compose deployment end to end, on a real Docker engine: learns, scraped, survives a kill, scales, resumes.

    python -m benchmarks.compose [--generators 3] [--steps 12] [--build]
    python -m benchmarks.compose --check --generators 2 --steps 10 --build     # CI (scripts/compose_check.sh)

Needs root (or a docker group member), Docker Compose v2 (`docker compose`), and the images: dapo:0.1.0-cpu and,
without Docker Hub, the local Redis and Prometheus images that `deploy/local-images.sh` builds (`--build` runs
it first and times it). Starts `dockerd` if no engine answers (and stops it at the end). Then, as its own
Compose project (`dapo-bench`, host ports 18000/19090, fresh volumes):

1. seeds the model-cache volume from the host's tiny-model cache when there is one (`--model-cache`; building
   the model inside a container takes 6+ minutes on 2 cores; the `bootstrap` service still runs and finds it),
   and `docker compose up -d --scale generator=N` of redis, bootstrap, learner, generator, reward, prometheus;
2. waits until Prometheus lists the N generator targets as up and has scraped `dapo_generator_tokens_total`
   above 0 from each (its HTTP API);
3. `docker kill` of one generator container after step `--kill-at`; SIGKILL of redis-server after step
   `--kill-redis-at` (from the host, so Docker sees a crash and restarts it: a `docker kill` is a stop it would
   honour), and checks that the learner lost no task with it; then `docker compose up -d --scale generator=1`
   after step `--scale-at`, and checks the steps go on and Prometheus drops the removed targets;
4. `docker compose down` after step `--down-at` (volumes kept), `up` again, and checks that the learner
   resumed from the checkpoint on the volume ("resuming from" in its log);
5. waits for the learner to finish `--steps` and exit 0, and checks Compose does not restart it; then reads
   the run's ledger.jsonl and metrics.jsonl from the volume: every step once, no task id trained twice,
   held-out accuracy at step 0 and at the end.

Every service's logs are read before each `down` and at the end: a `Traceback`, `ERROR` or `CRITICAL` line fails the
run. At the end `down -v` must leave no volume behind.

It writes benchmarks/results/compose.json and the report between the `compose` markers of benchmarks/README.md,
and removes what it started (containers, network, volumes; `--keep` leaves them for inspection). `--check` (CI)
writes neither and exits 1 when any check failed, after printing each check and the logs of the failing services.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from benchmarks.runs import ROOT, replace_section

PROJECT = "dapo-bench"
RUN = "bench"  # DAPO_RUN: the run the services and the Redis users' ACL name
LEARNER_PORT = 18000
PROMETHEUS_PORT = 19090
SERVICES = ["redis", "bootstrap", "learner", "generator", "reward", "prometheus"]
BAD_LINE = re.compile(r"Traceback|\bERROR\b|\bCRITICAL\b")
LOST = re.compile(r"Redis restarted \(run id \w+\); (\d+) tasks in flight were lost")
LOADED = re.compile(r"now serving weights v\d+ \(was v\d+\): (broadcast|pull\+verify)")
T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[compose {time.monotonic() - T0:7.1f}s] {message}", flush=True)


def run(*command: str, check: bool = True, capture: bool = True, timeout: float = 900, env=None) -> str:
    proc = subprocess.run(command, capture_output=capture, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {(proc.stderr or '')[-2000:]}")
    return proc.stdout if capture else ""


def docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def start_dockerd(log: Path) -> subprocess.Popen | None:
    if docker_answers():
        return None
    say("no Docker engine answers: starting dockerd")
    proc = subprocess.Popen(["dockerd"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not docker_answers():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"dockerd did not start (see {log})")
        time.sleep(1)
    return proc


def project_secrets(folder: Path) -> dict[str, str]:
    """The role keys, Redis users and token of a fresh project, as docker-compose.yml mounts them (`dapo keys
    compose`): DAPO_SECRETS_DIR, and DAPO_TOKEN for the learner's authenticated routes."""
    from cli.keys import write_compose_secrets

    made = write_compose_secrets(folder, run=RUN)
    return {"DAPO_SECRETS_DIR": str(folder), "DAPO_TOKEN": (made / "dapo_token").read_text().strip()}


class Stack:
    """One Compose project of docker-compose.yml plus a small override (bench settings, host ports)."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.override = workdir / "compose.bench.yml"
        learner_env = {
            "DAPO_LEARNER__TOTAL_STEPS": str(args.steps),
            "DAPO_LEARNER__EVAL_EVERY": str(args.eval_every),
            "DAPO_LEARNER__CHECKPOINTS__EVERY": str(args.checkpoint_every),
            "DAPO_DATA__EVAL_SIZE": str(args.eval_size),
        }
        # Given to every dapo service, so that they all resolve the same settings.
        body = {"services": {name: {"environment": learner_env} for name in ("bootstrap", "learner", "generator",
                                                                              "reward")}}
        self.override.write_text(json.dumps(body, indent=1))
        self.env = {
            **os.environ,
            # fresh secrets unless given (--no-reset onto a running project needs the ones it started with)
            **({} if os.environ.get("DAPO_SECRETS_DIR") else project_secrets(workdir / "secrets")),
            "DAPO_RUN": RUN,
            "DAPO_LEARNER_PORT": str(LEARNER_PORT),
            "PROMETHEUS_PORT": str(PROMETHEUS_PORT),
        }
        self.image = self.env.setdefault("DAPO_IMAGE", "dapo:0.1.0-cpu")

    def compose(self, *args: str, check: bool = True, timeout: float = 900) -> str:
        files = [ROOT / "docker-compose.yml", *(Path(extra).resolve() for extra in self.args.override), self.override]
        command = ["docker", "compose", "-p", PROJECT, *(flag for file in files for flag in ("-f", str(file))), *args]
        return run(*command, check=check, timeout=timeout, env=self.env)

    def up(self, generators: int, *flags: str) -> float:
        started = time.monotonic()
        said = self.compose("up", "-d", "--no-build", *flags, "--scale", f"generator={generators}", "--scale",
                            "reward=1", *SERVICES, timeout=1800)
        if not self.containers("learner", all_states=True):  # Compose can exit 0 having started nothing (an image
            # it could not pull); a learner whose run is over exits at once, so stopped ones count
            raise RuntimeError(f"`docker compose up` started no learner container: {said[-2000:]}")
        return time.monotonic() - started

    def containers(self, service: str, all_states: bool = False) -> list[str]:
        flags = ["-a"] if all_states else []
        return self.compose("ps", *flags, "-q", service).split()

    def logs(self) -> str:
        """Every service's logs as Compose prints them (`service-N | line`), while its containers exist."""
        return self.compose("logs", "--no-color", check=False, timeout=300)

    def inspect(self, container: str) -> dict:
        return json.loads(run("docker", "inspect", container))[0]

    def volume(self, name: str) -> str:
        return f"{PROJECT}_{name}"

    def read_run_file(self, name: str) -> str:
        """A file of the learner's run folder, read from the volume by a throwaway container."""
        return run("docker", "run", "--rm", "--entrypoint", "sh", "-v", f"{self.volume('learner-run')}:/data/run:ro",
                   self.image, "-c", f"cat /data/run/{name} 2>/dev/null || true", timeout=120)

    def jsonl(self, name: str) -> list[dict]:
        rows = []
        for line in self.read_run_file(name).splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
        return rows


def prometheus(query_path: str, params: dict | None = None) -> dict:
    url = f"http://127.0.0.1:{PROMETHEUS_PORT}{query_path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)["data"]


def generator_targets() -> list[dict]:
    try:
        targets = prometheus("/api/v1/targets", {"state": "active"})["activeTargets"]
    except OSError:
        return []
    return [t for t in targets if t["labels"].get("job") == "generator"]


def generator_tokens() -> dict[str, float]:
    try:
        result = prometheus("/api/v1/query", {"query": 'dapo_generator_tokens_total{service="generator"}'})["result"]
    except OSError:
        return {}
    return {r["metric"]["instance"]: float(r["value"][1]) for r in result}


def wait(what: str, check, timeout: float, every: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def seed_model_cache(stack: Stack, cache: Path) -> float:
    """Copy the host's tiny-model cache into the model-cache volume (owned by the image's user 10001)."""
    started = time.monotonic()
    run("docker", "volume", "create", stack.volume("model-cache"))
    run("docker", "run", "--rm", "--user", "0", "--entrypoint", "sh", "-v", f"{stack.volume('model-cache')}:/cache",
        "-v", f"{cache}:/src:ro", stack.image, "-c",
        "mkdir -p /cache/dapo && cp -a /src/. /cache/dapo/ && chown -R 10001:10001 /cache", timeout=600)
    return time.monotonic() - started


def scenario(stack: Stack, args: argparse.Namespace, result: dict) -> None:
    events = result["events"]

    def event(name: str, **fields) -> None:
        fields = {"at_s": round(time.monotonic() - T0, 1), **fields}
        events.append({"event": name, **fields})
        say(f"{name}: {fields}")

    def steps() -> int:
        return len(stack.jsonl("ledger.jsonl"))

    if args.no_reset:
        event("attached to the running project", steps=steps(),
              seconds=round(stack.up(args.generators, "--no-recreate"), 1))
    else:
        stack.compose("down", "-v", "--remove-orphans", check=False)
        if args.model_cache and Path(args.model_cache).is_dir():
            event("model cache seeded", seconds=round(seed_model_cache(stack, Path(args.model_cache)), 1))
        event("up", generators=args.generators, seconds=round(stack.up(args.generators), 1))

    wait("step 1", lambda: steps() >= 1, args.timeout)
    event("first step", steps=steps())

    def all_scraped():
        targets = [t for t in generator_targets() if t["health"] == "up"]
        tokens = generator_tokens()
        live = {t["labels"]["instance"] for t in targets}
        if len(targets) == args.generators and all(tokens.get(i, 0) > 0 for i in live):
            return {"targets_up": len(targets), "tokens": {i: tokens[i] for i in sorted(live)}}
        return None

    scraped = wait(f"{args.generators} generator targets up, each with tokens", all_scraped, args.timeout)
    result["prometheus_full"] = scraped
    event("prometheus scraped every generator", **scraped)

    wait(f"step {args.kill_at}", lambda: steps() >= args.kill_at, args.timeout)
    victim = stack.containers("generator")[0]
    victim_name = stack.inspect(victim)["Name"].lstrip("/")
    run("docker", "kill", victim)
    event("docker kill", container=victim_name, at_step=steps())
    time.sleep(15)
    state = stack.inspect(victim)["State"]
    event("killed container after 15 s", status=state["Status"], restart_count=stack.inspect(victim)["RestartCount"])

    if args.kill_redis_at:
        wait(f"step {args.kill_redis_at}", lambda: steps() >= args.kill_redis_at, args.timeout)
        (redis_container,) = stack.containers("redis")
        os.kill(stack.inspect(redis_container)["State"]["Pid"], signal.SIGKILL)  # a crash, which Docker restarts
        killed_at = steps()
        event("redis-server SIGKILLed", at_step=killed_at)

        def redis_back():
            info = stack.inspect(redis_container)
            return info["RestartCount"] >= 1 and info["State"].get("Health", {}).get("Status") == "healthy"

        wait("Docker to restart Redis, healthy", redis_back, 120, every=2)
        event("redis restarted by Docker", restart_count=stack.inspect(redis_container)["RestartCount"])
        wait("a step after the Redis restart", lambda: steps() > killed_at, args.timeout)
        event("step after the Redis restart", steps=steps())

    wait(f"step {args.scale_at}", lambda: steps() >= args.scale_at, args.timeout)
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "generator=1", "--scale", "reward=1",
                  *SERVICES, timeout=600)
    event("scaled to 1 generator", at_step=steps(), containers=len(stack.containers("generator")))
    scaled_from = steps()
    wait("Prometheus down to 1 generator target",
         lambda: len([t for t in generator_targets()]) == 1, 120)
    event("prometheus lists 1 generator target")
    wait("a step with 1 generator", lambda: steps() > scaled_from, args.timeout)
    event("step with 1 generator", steps=steps())

    wait(f"step {args.down_at}", lambda: steps() >= args.down_at, args.timeout)
    before_down = steps()
    started = time.monotonic()
    stack.compose("stop", "--timeout", "60", timeout=600)  # the shutdown lines too, before `down` removes them
    result["logs"].append(stack.logs())
    stack.compose("down", timeout=600)
    event("compose down", at_step=before_down, seconds=round(time.monotonic() - started, 1))
    event("up again", seconds=round(stack.up(1), 1))
    learner = stack.containers("learner", all_states=True)[0]  # (one whose run is over exits at once)

    def resumed():
        logs = run("docker", "logs", learner, check=False, timeout=60) + \
            subprocess.run(["docker", "logs", learner], capture_output=True, text=True).stderr
        return next((line for line in logs.splitlines() if "resuming from" in line), None)

    line = wait("the learner to resume", resumed, args.timeout)
    event("learner resumed", log=line.strip()[-160:])

    def finished():
        state = stack.inspect(learner)["State"]
        return state if state["Status"] == "exited" else None

    state = wait(f"the learner to finish {args.steps} steps", finished, args.timeout * 3, every=10)
    event("learner exited", exit_code=state["ExitCode"], steps=steps())
    time.sleep(30)
    after = stack.inspect(learner)
    event("learner 30 s later", status=after["State"]["Status"], restart_count=after["RestartCount"])
    result["learner_stays_down"] = after["State"]["Status"] == "exited" and after["RestartCount"] == 0
    result["learner_exit_code"] = state["ExitCode"]
    stack.compose("stop", "--timeout", "60", timeout=600)
    result["logs"].append(stack.logs())
    kept = stack.read_run_file("logs/learner-*.log")  # DAPO_LOG_DIR, on the learner's volume
    result["learner_log_file_kept_down"] = "stopped by signal" in kept and "resuming from" in kept


def checks(result: dict, args: argparse.Namespace) -> dict[str, bool]:
    """What CI requires of the run (issue 44): each check by name, True when it held."""
    ledger = result.get("ledger", {})
    logs = "\n".join(result.get("logs", []))
    lost = [int(n) for n in LOST.findall(logs)]
    named = {event["event"] for event in result["events"]}
    found = {
        "the run finished without an error": not result.get("error"),
        f"steps 1..{args.steps} trained, each once": ledger.get("steps") == list(range(1, args.steps + 1)),
        "no task trained twice": ledger.get("tasks_trained", 0) > 0
                                 and ledger["tasks_trained"] == ledger["distinct_tasks_trained"],
        "held-out accuracy reported at the start and the end": len(result.get("eval_accuracy", [])) >= 2,
        f"Prometheus: {args.generators} generator targets up, each scraped": bool(result.get("prometheus_full")),
        "a killed generator: the steps went on": "killed container after 15 s" in named,
        "the learner resumed after down and up": "learner resumed" in named,
        "the learner's log file (DAPO_LOG_DIR) kept its lines across down":
            bool(result.get("learner_log_file_kept_down")),
        "the finished learner exited 0 and stayed down": bool(result.get("learner_stays_down"))
                                                          and result.get("learner_exit_code") == 0,
        "no Traceback, ERROR or CRITICAL line in any service's logs": not result.get("bad_log_lines"),
        "down -v left no volume": result.get("volumes_left") == 0,
    }
    if "broadcast" in result:  # weights.transport collective (deploy/compose.broadcast.yml)
        rounds, loads = result["broadcast"], result["loads"]
        found["weights streamed into the running engines: loaded by broadcast, most rounds reached every member"] = \
            loads.get("broadcast", 0) > 0 and 2 * rounds["rounds_all_received"] >= rounds["rounds"]
    if args.kill_redis_at:
        found["a SIGKILLed Redis: restarted, no task lost (the learner's count)"] = \
            "step after the Redis restart" in named and bool(lost) and not any(lost)
    return found


def summarize(stack: Stack, result: dict) -> None:
    ledger = stack.jsonl("ledger.jsonl")
    metrics = stack.jsonl("metrics.jsonl")
    trained = [task for row in ledger for task in row["trained"]]
    result["ledger"] = {
        "steps": [row["step"] for row in ledger],
        "tasks_trained": len(trained),
        "distinct_tasks_trained": len(set(trained)),
        "every_step_once": [row["step"] for row in ledger] == list(range(1, len(ledger) + 1)),
    }
    evals = [(m["step"], m["eval_accuracy"]) for m in metrics if m.get("eval_accuracy") is not None]
    result["eval_accuracy"] = evals
    step_seconds = [m["step_seconds"] for m in metrics if m.get("step", 0) > 0 and m.get("step_seconds")]
    result["mean_step_seconds"] = round(sum(step_seconds) / len(step_seconds), 1) if step_seconds else None
    listing = run("docker", "run", "--rm", "--entrypoint", "sh", "-v", f"{stack.volume('learner-run')}:/r:ro",
                  stack.image, "-c", "ls /r/checkpoints 2>/dev/null || true", timeout=60)
    result["checkpoints"] = listing.split()
    result["bad_log_lines"] = [line for text in result.get("logs", []) for line in text.splitlines()
                               if BAD_LINE.search(line)]
    loads = LOADED.findall("\n".join(result.get("logs", [])))
    result["loads"] = {way: loads.count(way) for way in ("broadcast", "pull+verify")}
    # every delivery of weights.transport collective that had members (a step record lists those that ended in it)
    rounds = [d for m in metrics for d in m.get("deliveries", []) if "broadcast_members" in d]
    if rounds:
        result["broadcast"] = {
            "rounds": len(rounds),
            "rounds_all_received": sum(1 for m in rounds if m["broadcast_members"] and not m["broadcast_failed"]),
            "members": [m["broadcast_members"] for m in rounds],
            "mean_seconds": round(sum(m["broadcast_seconds"] for m in rounds) / len(rounds), 2),
            "megabytes": round(rounds[-1]["broadcast_bytes"] / 1e6, 1),
        }


def report(result: dict, command: str) -> str:
    ledger = result.get("ledger", {})
    evals = result.get("eval_accuracy", [])
    lines = [f"`{command}`", "", f"Conditions: {result['conditions']}", "",
             "| check | measured |", "| --- | --- |"]
    if result.get("build"):
        lines.append(f"| `deploy/local-images.sh` (clean engine) | {result['build']} |")
    lines.append(f"| dapo image size | {result.get('image_size', '?')} |")
    if evals:
        (s0, a0), (s1, a1) = evals[0], evals[-1]
        lines.append(f"| learned: held-out accuracy | {100 * a0:.1f} % at step {s0} -> {100 * a1:.1f} % at step {s1} "
                     f"({', '.join(f'{s}: {100 * a:.1f}' for s, a in evals)}) |")
    lines.append(f"| mean step (s) | {result.get('mean_step_seconds')} |")
    full = result.get("prometheus_full")
    if full:
        tokens = ", ".join(f"{v:.0f}" for v in full["tokens"].values())
        lines.append(f"| Prometheus: generator targets up | {full['targets_up']} of {result['generators']}, "
                     f"`dapo_generator_tokens_total` from each: {tokens} |")
    for event in result["events"]:
        if event["event"] in ("docker kill", "killed container after 15 s", "scaled to 1 generator",
                              "redis-server SIGKILLed", "redis restarted by Docker", "step after the Redis restart",
                              "prometheus lists 1 generator target", "compose down", "learner resumed",
                              "learner exited", "learner 30 s later", "up", "first step", "up again",
                              "attached to the running project", "model cache seeded"):
            fields = ", ".join(f"{k} {v}" for k, v in event.items() if k != "event")
            lines.append(f"| {event['event']} | {fields} |")
    if ledger:
        lines.append(f"| ledger.jsonl | steps {ledger['steps'][0]}..{ledger['steps'][-1]} each once: "
                     f"{ledger['every_step_once']}; {ledger['tasks_trained']} task ids trained, "
                     f"{ledger['distinct_tasks_trained']} distinct |")
    if "learner_stays_down" in result:
        lines.append(f"| finished learner not restarted (restart: on-failure) | {result['learner_stays_down']} "
                     f"(exit code {result['learner_exit_code']}) |")
    if result.get("broadcast"):
        rounds = result["broadcast"]
        lines.append(f"| weights by broadcast (`{' '.join(result['overrides'])}`) | {rounds['rounds_all_received']} "
                     f"of {rounds['rounds']} rounds reached every member (members per round: "
                     f"{', '.join(map(str, rounds['members']))}), {rounds['megabytes']} MB in "
                     f"{rounds['mean_seconds']} s on average; versions loaded by the generators: "
                     f"{result['loads']['broadcast']} by broadcast, {result['loads']['pull+verify']} from the files |")
    if "bad_log_lines" in result:
        lines.append(f"| `Traceback`, `ERROR` or `CRITICAL` lines in the services' logs "
                     f"| {len(result['bad_log_lines'])} |")
    if "volumes_left" in result:
        lines.append(f"| volumes left after `down -v` (named and anonymous) | {result['volumes_left']} |")
    if result.get("error"):
        lines.append(f"| **failed** | {result['error']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="learner.total_steps")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=2, help="docker kill a generator after this step")
    parser.add_argument("--scale-at", type=int, default=4, help="scale the generators to 1 after this step")
    parser.add_argument("--kill-redis-at", type=int, default=3,
                        help="SIGKILL redis-server after this step (0: never)")
    parser.add_argument("--down-at", type=int, default=6, help="compose down, then up, after this step")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds for each wait")
    parser.add_argument("--no-reset", action="store_true",
                        help="go on with the project as it runs "
                             "(same DAPO_TOKEN and DAPO_SECRETS_DIR in the environment)")
    parser.add_argument("--model-cache", default=str(Path("~/.cache/dapo").expanduser()),
                        help="host folder of built tiny models to seed the volume with ('' to let bootstrap build)")
    parser.add_argument("--override", action="append", default=[], metavar="FILE",
                        help="a Compose file laid over docker-compose.yml (repeatable), e.g. "
                             "deploy/compose.broadcast.yml")
    parser.add_argument("--build", action="store_true", help="run deploy/local-images.sh first and time it")
    parser.add_argument("--keep", action="store_true", help="leave the containers and volumes")
    parser.add_argument("--check", action="store_true",
                        help="CI: print each check, exit 1 if one failed; write no result and no report")
    parser.add_argument("--conditions", default="2 shared CPU cores (other jobs running), 24 GiB, no GPU")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="dapo-compose-"))
    dockerd = start_dockerd(workdir / "dockerd.log")
    result: dict = {"generators": args.generators, "steps": args.steps, "events": [], "logs": [],
                    "conditions": args.conditions, "overrides": args.override}
    if args.build:  # its last line: `export DAPO_IMAGE=... REDIS_IMAGE=... PROMETHEUS_IMAGE=...`
        started = time.monotonic()
        exports = subprocess.run([str(ROOT / "deploy" / "local-images.sh")], stdout=subprocess.PIPE, text=True,
                                 check=True, timeout=7200).stdout
        os.environ.update(pair.split("=", 1) for pair in exports.split("export ")[-1].split())
        result["build"] = f"{(time.monotonic() - started) / 60:.1f} min"
    stack = Stack(args, workdir)
    volumes_before = set(run("docker", "volume", "ls", "-q").split())
    try:
        size = run("docker", "image", "inspect", "-f", "{{.Size}}", stack.image).strip()
        result["image_size"] = f"{int(size) / 1e9:.2f} GB"
        scenario(stack, args, result)
    except Exception as error:  # noqa: BLE001 - reported, then the stack is still cleaned up
        result["error"] = f"{type(error).__name__}: {error}"[:500]
        say(f"FAILED: {result['error']}")
        result["logs"].append(stack.logs())
        for service in ("learner", "generator", "reward", "redis", "bootstrap"):
            print(stack.compose("logs", "--tail", "40", service, check=False)[-6000:], file=sys.stderr)
    finally:
        try:
            summarize(stack, result)
        except Exception as error:  # noqa: BLE001
            result.setdefault("error", f"summary: {error}")
        if not args.keep:
            stack.compose("down", "-v", "--remove-orphans", check=False)
            left = [v for v in run("docker", "volume", "ls", "-q", check=False).split() if v not in volumes_before]
            result["volumes_left"] = len(left)
        if dockerd is not None:
            dockerd.terminate()
            dockerd.wait(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)

    if args.check:
        found = checks(result, args)
        for line in result.get("bad_log_lines", [])[:40]:
            print(f"  log: {line[:300]}", file=sys.stderr)
        evals = ", ".join(f"step {step}: {100 * accuracy:.1f} %" for step, accuracy in result.get("eval_accuracy", []))
        print(f"[compose check] held-out accuracy: {evals or 'none'}; ledger: {result.get('ledger')}; "
              f"versions loaded: {result.get('loads')}; broadcast rounds: {result.get('broadcast')}")
        for name, held in found.items():
            print(f"[compose check] {'ok    ' if held else 'FAILED'} {name}")
        print(f"[compose check] {sum(found.values())} of {len(found)} held in {time.monotonic() - T0:.0f} s")
        return 0 if all(found.values()) else 1

    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    result.pop("logs")  # kept in memory for the checks; the report keeps the offending lines
    # one report per stack: the default, and each override laid over it (compose-broadcast, ...)
    section = "-".join(["compose", *(Path(o).stem.removeprefix("compose.") for o in args.override)])
    (results / f"{section}.json").write_text(json.dumps(result, indent=1))
    command = (f"python -m benchmarks.compose --generators {args.generators} --steps {args.steps}"
               f"{''.join(f' --override {o}' for o in args.override)}{' --build' if args.build else ''}")
    body = report(result, command)
    print(body)
    replace_section(ROOT / "benchmarks" / "README.md", section, body)
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
