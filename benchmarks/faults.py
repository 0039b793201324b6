"""The fault suite as a benchmark: one `dapo run` with 2 generators, SIGKILLs of every kind of process, bad messages.

    python -m benchmarks.faults [--steps 30] [--preset tiny-cpu] [--set key=value ...] [--no-readme]

One run, not one per kill: the goals are about a run (it finishes by itself, every step once, no group trained
twice), and faults that pile up (a second resume on top of a first, a Redis restart while a restarted learner
catches up, the same generator killed again) only show when they happen to the same run. One run also loads the
models once, which is what lets 12 kills fit the budget of 2 shared cores.

Kills. `dapo run --generators 2` (one reward worker, the learner, the embedded redis-server) is started with a
token made here and its own Redis prefix; this script reads the run's role keys (run_dir/keys), so it can sign
messages as any role, as an insider holding a stolen key would. Then 3 rounds, each
killing a generator (the one holding the most prompt tasks then, waiting up to 60 s for one to hold any), the
reward worker, the learner and redis-server, in that order (SIGKILL of the process itself, not its group: what a
crash or the OOM killer does). Each kill waits for a step completed since the
previous kill, then a fraction of the typical step (0.25, 0.5, 0.75 of the median step time so far, one per
round), so kills land at different phases of a step: while the learner waits for groups, trains or publishes.
For each kill it measures, from the moment of the kill:
- back up (s): the restarted process answers (a new pid whose /readyz says ready; PING for redis-server);
- next step (s): the ledger holds a step beyond the last one it held at the kill;
- steps redone: how far the ledger was cut back (a learner restart resumes from its last checkpoint) and
  written again.

Bad messages, written into the streams while the run goes on (one wave at the start of each round): poison
prompts (signed, schema-valid, but no engine can serve them), malformed entries (signed garbage, an unknown
schema_version, an entry without payload), and forged ones (no signature, a genuine group tampered with, groups
and prompts with made-up task ids signed with the real keys, so only provenance can refuse them), and the
attacks on the roles (services/keys.py): a `scored` group of a real issued task signed with a generator's key, a
task signed with the reward role's key, messages under a retired key id (a key the run does not trust: replayed
after a rotation removed it), a generator's own signed dead letter retiring an issued task it was never
delivered. Each wave also has the generator's Redis user (its password read from the run's
redis.conf, as a compromised generator pod holds it) try commands outside its ACL (services/redis_users.py):
write `scored`, read `issued`, overwrite the weights announcement, FLUSHALL, CONFIG SET, a script writing
`scored`; every one must be refused. And each wave that generator user fills Redis to its maxmemory (64 MB here)
with 2 MB entries in its own stream (fewer than the stream's high-water mark), after which Redis refuses every
write: the learner must free it (`Streams.trim_overfull`), every role wait meanwhile, and the run go on.

Freezes (`--freeze SECONDS`): the same run, each process stopped instead of killed, with its process group (a
reward worker's verifiers, a generator's engine), for that long, then resumed (SIGSTOP, SIGCONT: a VM paused,
`docker pause`, Ctrl-Z): a resumed process still believes it holds what it held. Set the timeouts below the
freeze (`--set streams.visibility_timeout_s=10 --set learner.lease_ttl_s=10`): a frozen generator's tasks are then
reclaimed by the other, a frozen learner's lease lapses (it ends at its wake and is restarted), the verifier's
items outlast their limit, and a frozen Redis outlasts the learner's lease. "Back up" is then the process answering
again, its own pid or its restart's.

Counting, after the run (the pure part is `analyze`, unit-tested on synthetic inputs): the final ledger.jsonl
(steps 1..N each once, no task id trained twice); every ledger row seen while polling (steps cut back and
written again = work redone, and groups trained in a discarded lineage); metrics.jsonl (duplicates dropped,
tasks lost with a Redis restart); the `dead` stream read from the run's Redis AOF after the run, each dead
letter matched to the injection it came from (same stream and bytes, or the same task id), so what is left
unmatched is a legitimate task dead-lettered, and none may carry a ground truth. Results go to
benchmarks/results/faults.json and the table into benchmarks/README.md between the `faults` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack

from learner.records import read_rows  # skips a line being written
from learner.workset import task_id_in_payload  # the learner's own reading of a raw payload

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("generator", "reward", "learner", "redis")
ROUNDS = 3
PHASES = (0.25, 0.5, 0.75)  # when in a step a round's kills land, as a fraction of the median step time
OVERRIDES = [  # small steps: 12 kills fit in about half an hour on 2 shared cores
    "learner.batch.prompts_per_step=8", "sampling.n=8", "sampling.max_tokens=48", "learner.eval_every=0",
    "learner.checkpoints.every=1",
    "redis.embedded_maxmemory_mb=64",  # a flood fills it in seconds (and the AOF stays small)
]
FLOOD_ENTRY_BYTES = 2_000_000  # above any entry a stream needs here (1.3 MB), below the largest value Redis takes
RUN_NAME = "faults"


# -- the pure part: counting ---------------------------------------------------------------------------------
@dataclass
class Injection:
    """One bad message written into a stream, and what should become of it."""

    kind: str  # poison | malformed | forged | flood (entries that fill Redis: counted apart)
    label: str  # what it is, for the table
    stream: str  # where it was written
    expect: str  # the start of the dead letter's reason
    digest: str  # sha256 of the payload as written (as a dead letter keeps it: services.streams.without_ground_truth)
    task_id: str | None = None  # the task id inside, when it has one
    real_task: bool = False  # names a task the learner really issued (its genuine group is trained, rightly)
    at: float = 0.0


@dataclass
class AclAttempt:
    """One thing a role tried outside what it may, and whether it was refused: a Redis command outside its user's
    ACL (`kind` redis), or an HTTP call outside its tokens' audience (`kind` http: refused = 401 or 403)."""

    role: str
    command: str
    refused: bool
    kind: str = "redis"


@dataclass
class Kill:
    round: int
    kind: str
    name: str  # generator-0, reward-0, learner, redis-server
    pid: int
    at: float  # time.time() of the kill
    step_at_kill: int  # the last step in the ledger then
    phase: float  # seconds after the step it waited for
    back_up_s: float | None = None
    next_step_s: float | None = None
    rolled_back_to: int | None = None  # the lowest last step seen in the ledger after the kill
    new_pid: int | None = None
    held: int | None = None  # prompt tasks a killed generator held (the busiest one is killed)
    fault: str = "SIGKILL"  # or "SIGSTOP 25s": stopped with its process group for that long, then resumed


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def ledger_check(rows: list[dict]) -> dict:
    """The final ledger: steps 1..N each once, and task ids trained more than once."""
    steps = [row["step"] for row in rows]
    trained = Counter(task for row in rows for task in row.get("trained", []))
    dropped = {task for row in rows for key, value in row.items() if key.startswith("dropped_") for task in value}
    return {
        "steps": len(steps),
        "steps_once_in_order": steps == list(range(1, len(steps) + 1)),
        "steps_repeated": sorted(s for s, c in Counter(steps).items() if c > 1),
        "groups_trained": sum(trained.values()),
        "groups_unique": len(trained),
        "groups_trained_twice": sorted(t for t, c in trained.items() if c > 1),
        "trained_and_dropped": sorted(set(trained) & dropped),
    }


def redone(seen: list[dict], final: list[dict]) -> dict:
    """Rows written by a lineage a learner restart discarded: seen while polling, absent from the final ledger."""
    final_keys = {(row["step"], tuple(row.get("trained", []))) for row in final}
    discarded = []
    for row in seen:
        key = (row["step"], tuple(row.get("trained", [])))
        if key not in final_keys and key not in [(r["step"], tuple(r.get("trained", []))) for r in discarded]:
            discarded.append(row)
    return {
        "steps_redone": len(discarded),
        "steps": [row["step"] for row in discarded],
        "groups_retrained": sum(len(row.get("trained", [])) for row in discarded),
    }


def recovery(kill_at: float, step_at_kill: int, timeline: list[tuple[float, int]]) -> dict:
    """From (time, last step in the ledger) samples: seconds from the kill until the ledger went beyond the step it
    held at the kill, and the lowest step it was cut back to meanwhile."""
    lowest, next_s = step_at_kill, None
    for at, last in timeline:
        if at < kill_at:
            continue
        lowest = min(lowest, last)
        if last > step_at_kill:
            next_s = at - kill_at
            break
    return {"next_step_s": next_s, "rolled_back_to": lowest}


def with_spilled_payload(row: dict) -> dict:
    """A dead letter whose payload was too large for Redis keeps it in `payload_file` (services/streams.py
    letter_payload): read it back, checked against `payload_sha256`, so it is matched like any other."""
    path = Path(row.get("payload_file") or "")
    if not row.get("data") and path.is_file():
        payload = path.read_bytes()
        if digest(payload) == row.get("payload_sha256"):
            return {**row, "data": payload}
    return row


def match_dead(dead: list[dict], injections: list[Injection]) -> tuple[list[tuple[dict, Injection]], list[dict]]:
    """Pair each dead letter with the injection it came from (same stream and bytes, else the same task id: a
    poison prompt re-encoded by the generator, a forged prompt dead-lettered as a scored group). Returns the
    pairs and the dead letters of nobody's injection (legitimate messages)."""
    free = list(injections)
    pairs, unmatched = [], []
    for row in dead:
        payload = row.get("data", b"")
        task_id = task_id_in_payload(row.get("stream", ""), payload)
        # an oversize entry's letter keeps only the payload's sha256 (services/streams.py: refused by its size)
        sha256 = digest(payload) if payload or not row.get("payload_sha256") else row["payload_sha256"]
        found = next((i for i in free if i.stream == row.get("stream") and i.digest == sha256), None)
        if found is None and task_id is not None:
            found = next((i for i in free if i.task_id == task_id and not i.real_task), None)
        if found is None:
            unmatched.append(row)
        else:
            free.remove(found)
            pairs.append((row, found))
    return pairs, unmatched


def ground_truth_in(stream: str, payload: bytes) -> bool:
    """Whether a dead letter's payload carries a task's ground truth (scored or held groups carry one until the
    learner's letter blanks it: services/streams.py `without_ground_truth`)."""
    if stream not in ("scored", "held"):
        return False
    try:
        return bool(msgpack.unpackb(payload, raw=False)["rollout"]["task"]["ground_truth"])
    except Exception:  # garbage, or a group without a task: nothing to leak
        return False


def analyze(final: list[dict], seen: list[dict], metrics_rows: list[dict], dead: list[dict],
            injections: list[Injection], kills: list[Kill], acl_attempts: list[AclAttempt]) -> dict:
    ledger = ledger_check(final)
    pairs, unmatched = match_dead(dead, injections)
    trained_ever = {task for row in [*final, *seen] for task in row.get("trained", [])}
    by_label: dict[str, dict] = {}
    floods = [i for i in injections if i.kind == "flood"]
    for inj in injections:
        if inj.kind == "flood":
            continue
        entry = by_label.setdefault(inj.label, {"kind": inj.kind, "stream": inj.stream, "expect": inj.expect,
                                                "injected": 0, "dead_as_expected": 0, "dead_otherwise": 0,
                                                "trained": 0, "reasons": []})
        entry["injected"] += 1
        if inj.task_id and not inj.real_task and inj.task_id in trained_ever:
            entry["trained"] += 1
    flood_dead = sum(1 for row, inj in pairs if inj.kind == "flood" and row.get("reason", "").startswith(inj.expect))
    for row, inj in pairs:
        if inj.kind == "flood":
            continue
        entry = by_label[inj.label]
        reason = row.get("reason", "")
        if reason.startswith(inj.expect):
            entry["dead_as_expected"] += 1
        else:
            entry["dead_otherwise"] += 1
        if reason not in entry["reasons"]:
            entry["reasons"].append(reason[:200])
    with_truth = [r.get("id") for r in dead if ground_truth_in(r.get("stream", ""), r.get("data", b""))]
    legit = [{"stream": r.get("stream"), "reason": r.get("reason", "")[:200],
              "task_id": task_id_in_payload(r.get("stream", ""), r.get("data", b""))} for r in unmatched]
    forged = [i for i in injections if i.kind == "forged"]
    per_kind = {}
    for kind in KINDS:
        rows = [k for k in kills if k.kind == kind]
        per_kind[kind] = {
            "kills": len(rows),
            "back_up_s": [k.back_up_s for k in rows],
            "next_step_s": [k.next_step_s for k in rows],
            "steps_redone": [max(0, k.step_at_kill - k.rolled_back_to) if k.rolled_back_to is not None else None
                             for k in rows],
        }
    return {
        "ledger": ledger,
        "redone": redone(seen, final),
        "metrics": {
            "steps": len([r for r in metrics_rows if r.get("step", 0) > 0]),
            "duplicates_dropped": sum(r.get("duplicates") or 0 for r in metrics_rows),
            "lost_with_redis": sum(r.get("lost") or 0 for r in metrics_rows),
            "stale_dropped": sum(r.get("stale_dropped") or 0 for r in metrics_rows),
            "median_step_s": statistics.median(s) if (s := [r["step_seconds"] for r in metrics_rows
                                                          if r.get("step_seconds")]) else None,
        },
        "injections": by_label,
        "flood": {"entries": len(floods), "dead_as_expected": flood_dead},
        "forged_injected": len(forged),
        "forged_trained": sum(by_label[i.label]["trained"] for i in {i.label: i for i in forged}.values()),
        "legit_dead": legit,
        "ground_truth_in_dead": with_truth,
        "dead_letters": len(dead),
        "dead_reasons": dict(Counter(r.get("reason", "").split(":", 1)[0] for r in dead)),
        "per_kind": per_kind,
        "acl_attempts": sum(a.kind == "redis" for a in acl_attempts),
        "acl_accepted": sorted({f"{a.role}: {a.command}" for a in acl_attempts if not a.refused and a.kind == "redis"}),
        "http_attempts": sum(a.kind == "http" for a in acl_attempts),
        "http_accepted": sorted({f"{a.role}: {a.command}" for a in acl_attempts if not a.refused and a.kind == "http"}),
    }


# -- the live part -------------------------------------------------------------------------------------------
def outside_acl(client, role: str, streams) -> list[AclAttempt]:
    """Try, as `role`'s Redis user (`client`), the commands a compromised generator would: each one is recorded
    with whether the server refused it (NOPERM). Writes nothing the run uses when refused."""
    import redis

    key = streams.key
    tries = {
        "XADD scored": lambda: client.xadd(key("scored"), {"data": b"forged", "sig": b"-"}),
        "HGET issued (ground truth)": lambda: client.hgetall(key("issued")),
        "SET weights:latest": lambda: client.set(key("weights:latest"), b"{}"),
        "EVAL XADD scored": lambda: client.eval("return redis.call('XADD', KEYS[1], '*', 'data', 'x')", 1,
                                                key("scored")),
        "FLUSHALL": lambda: client.execute_command("FLUSHALL"),
        "CONFIG SET appendonly no": lambda: client.execute_command("CONFIG", "SET", "appendonly", "no"),
        "DEBUG SLEEP": lambda: client.execute_command("DEBUG", "SLEEP", "0"),
    }
    attempts = []
    for command, attempt in tries.items():
        try:
            attempt()
            attempts.append(AclAttempt(role, command, refused=False))
        except redis.exceptions.NoPermissionError:
            attempts.append(AclAttempt(role, command, refused=True))
    return attempts


def oversize_entry(client, streams) -> AclAttempt:
    """A generator's XADD of an 8 MB entry to its own stream, on a client that does not retry: the run's Redis
    refuses any value larger than a stream entry can need (proto-max-bulk-len), so none reaches a consumer."""
    import redis

    try:
        client.xadd(streams.key("rollouts"), {"data": b"9" * (8 << 20), "sig": b"-"})
        return AclAttempt("generator", "XADD of an 8 MB entry", refused=False)
    except (redis.ResponseError, redis.ConnectionError):
        return AclAttempt("generator", "XADD of an 8 MB entry", refused=True)


def outside_audience(pid: int, urls: dict[str, str]) -> list[AclAttempt]:
    """Try, with every token a live generator holds, the HTTP calls outside a generator's audience: scoring on a
    reward worker, the learner's status, a weights sync on another generator. Each is recorded with whether it was
    refused (401 or 403); the weights' own route is tried too and must answer, so that the refusals are not those of
    a token that opens nothing. The tokens are read from /proc/PID/environ, which every service hides from its own
    user (services.startup.hide_from_same_user): as root the harness reads them anyway, as an attacker who got them
    would use them; as another user that read is the refusal recorded."""
    import httpx

    env = environment_of(pid)
    if env is None:
        return [AclAttempt("generator", "read a generator's tokens from /proc/PID/environ", True, "http")]
    tokens = {name: env[name] for name in ("DAPO_TOKEN", "DAPO_WEIGHTS_TOKEN") if env.get(name)}
    other = next(name for name in urls if name.startswith("generator-") and name != worker_id(pid))
    reward = next(name for name in urls if name.startswith("reward-"))
    tries = {"POST /v1/score": ("POST", f"{urls[reward]}/v1/score", [{"response": "Answer: 1", "ground_truth": "1"}]),
             "GET the learner's /v1/status": ("GET", f"{urls['learner']}/v1/status", None),
             "POST another generator's /v1/weights/sync": ("POST", f"{urls[other]}/v1/weights/sync", None)}
    attempts = []
    for variable, token in tokens.items():
        headers = {"Authorization": f"Bearer {token}"}
        for command, (method, url, body) in tries.items():
            try:
                status = httpx.request(method, url, json=body, headers=headers, timeout=10).status_code
            except httpx.HTTPError:  # a service being restarted after a kill: tried again in the next wave
                continue
            attempts.append(AclAttempt("generator", f"{command} with {variable}", status in (401, 403), "http"))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{urls['learner']}/v1/weights/latest", headers=headers, timeout=10).status_code in (401,
                                                                                                            403):
                raise RuntimeError(f"the generator's {variable} does not open the learner's weights")
    if not tokens:
        raise RuntimeError("the generator holds no token: it could not pull weights")
    return attempts


def children_of(pid: int) -> dict[int, str]:
    """pid -> command line of the direct children of `pid` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return found


def environment_of(pid: int) -> dict[str, str] | None:
    """A process's environment as it started (from /proc); {} once gone, None where it may not be read (a service
    hides it from every process of its user but root's)."""
    try:
        items = (Path("/proc") / str(pid) / "environ").read_bytes().decode(errors="replace").split("\0")
    except PermissionError:
        return None
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in items if "=" in item)


def worker_id(pid: int) -> str | None:
    """The name `dapo run` gave a worker, from its command line (`--worker-id`: readable by any process, where its
    environment is hidden from all but root)."""
    try:
        words = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return words[words.index("--worker-id") + 1] if "--worker-id" in words[:-1] else None


def service_pids(launcher: int) -> dict[str, int]:
    """name -> pid of the launcher's children: learner, generator-i, reward-i, redis-server."""
    out = {}
    for pid, cmd in children_of(launcher).items():
        if "redis-server" in cmd:
            out["redis-server"] = pid
        elif " -m cli learner" in cmd:
            out["learner"] = pid
        elif " -m cli generator" in cmd or " -m cli reward" in cmd:
            name = worker_id(pid)
            if name:
                out[name] = pid
    return out


def pgid_members(groups: set[int]) -> list[str]:
    """Processes still alive in any of these process groups (each child of the launcher leads its own)."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) in groups and fields[0] != "Z":
                left.append(f"{entry.name} {stat.split('(', 1)[1].rsplit(')', 1)[0]}")
        except (OSError, ValueError, IndexError):
            continue
    return left


class Faults:
    def __init__(self, args):
        self.args = args
        self.run_dir = Path(args.run_dir).resolve()
        self.token = "faults-" + uuid.uuid4().hex
        self.injections: list[Injection] = []
        self.acl_attempts: list[AclAttempt] = []
        self.floods: list[dict] = []
        self.kills: list[Kill] = []
        self.seen: dict[tuple, dict] = {}  # every ledger row ever read
        self.timeline: list[tuple[float, int]] = []
        self.groups: set[int] = set()  # pids of every child seen (each leads its own process group)
        self.proc: subprocess.Popen | None = None
        self._streams = None
        self.frozen: list[int] = []  # process groups stopped (--freeze), until their SIGCONT

    # -- the run ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        sets = [f"run_dir={self.run_dir}", f"redis.run={RUN_NAME}", "learner.checkpoints.resume=true",
                f"learner.total_steps={self.args.steps}", *OVERRIDES, *self.args.set]
        self.command = [sys.executable, "-m", "cli", "run", "--no-display", "--generators", "2",
                        "--config", self.args.preset]
        for item in sets:
            self.command += ["--set", item]
        env = {**os.environ, "DAPO_TOKEN": self.token, "PYTHONPATH": str(ROOT)}
        self.out = open(self.run_dir.parent / f"{self.run_dir.name}.out", "w")
        self.started = time.time()
        self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT)
        print(f"[faults] {' '.join(self.command)}", flush=True)

    def poll(self) -> int:
        """Read the ledger (remember every row, sample the last step); the last step."""
        rows = read_rows(self.run_dir / "ledger.jsonl")
        for row in rows:
            self.seen.setdefault((row["step"], tuple(row.get("trained", []))), row)
        last = rows[-1]["step"] if rows else 0
        self.timeline.append((time.time(), last))
        if self.proc is not None:
            self.groups.update(service_pids(self.proc.pid).values())
            if self.proc.poll() is None:
                self.watch_restarts()
        return last

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, what: str, check, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if not self.alive():  # (before a check that would wait on the run's Redis, gone with it)
                raise RuntimeError(f"dapo run exited ({self.proc.returncode}) while waiting for {what}")
            value = check()
            if value:
                return value
            time.sleep(0.25)
        raise TimeoutError(f"timed out waiting for {what}")

    def median_step(self) -> float:
        """The median step time so far; step 1 (which waited for the services to start) only if it is alone."""
        rows = [r for r in read_rows(self.run_dir / "metrics.jsonl") if r.get("step_seconds")]
        seconds = [r["step_seconds"] for r in rows if r["step"] > 1] or [r["step_seconds"] for r in rows]
        return statistics.median(seconds) if seconds else 20.0

    def ready(self, name: str, old_pid: int) -> int | None:
        """The new pid of `name` once it is up (ready on /readyz, or answering PING for redis-server)."""
        pid = service_pids(self.proc.pid).get(name)
        if not pid or (pid == old_pid and not self.args.freeze):  # frozen: its own pid answers again on waking
            return None
        if name == "redis-server":  # one PING, no retries (the services' clients retry; this only looks)
            from services.config import load_settings
            from services.errors import Unavailable
            from services.redis_local import wait_for_redis

            try:
                wait_for_redis(load_settings(self.args.preset,
                                             redis={"url": self.redis_url(), "connect_timeout_s": 0.1}))
                return pid
            except Unavailable:
                return None
        import httpx

        url = json.loads((self.run_dir / "services.json").read_text())["http"][name]
        try:
            return pid if httpx.get(f"{url}/readyz", timeout=2).status_code == 200 else None
        except httpx.HTTPError:
            return None

    def redis_url(self) -> str:
        """The run's embedded server (its saved password, its socket)."""
        from services.redis_local import EmbeddedRedis

        return EmbeddedRedis(self.run_dir / "redis").url

    def generator_client(self, retrying: bool = True):
        """A client as the run's generator Redis user (its password from the server's redis.conf)."""
        from services.redis_local import EmbeddedRedis, client_for, saved_password

        server = EmbeddedRedis(self.run_dir / "redis")
        return client_for(f"unix://generator:{saved_password(server.data_dir, 'generator')}@{server.socket_path}",
                          retrying=retrying)

    # -- kills -----------------------------------------------------------------------------------------------
    def kill(self, round_: int, kind: str, name: str) -> Kill:
        """Wait for a step beyond the one the previous kill happened at, then the round's phase of a step; SIGKILL.
        Whether the process came back is watched by `poll` meanwhile: the next kill does not wait for it (a
        generator's vLLM takes minutes to start on a loaded machine, and the run goes on without it)."""
        before = self.kills[-1].step_at_kill + 1 if self.kills else 1
        self.wait(f"step {before}", lambda: self.poll() >= before, 1800)
        phase = PHASES[round_] * self.median_step()
        end = time.monotonic() + phase
        while time.monotonic() < end:
            self.poll()
            time.sleep(0.25)
        held = None
        if kind == "generator":  # mid-work: the generator holding the most tasks (waiting up to 60 s for one to)
            try:
                name, held = self.wait("a generator holding tasks", self.busiest_generator, 60)
            except TimeoutError:
                held = 0
        pid = self.wait(f"{name} running", lambda: service_pids(self.proc.pid).get(name), 600)
        step = self.poll()
        at = time.time()
        fault = f"SIGSTOP {self.args.freeze:g}s" if self.args.freeze else "SIGKILL"
        if self.args.freeze:  # its whole group (each service leads one): a paused VM or container stops them all
            group = os.getpgid(pid)
            os.killpg(group, signal.SIGSTOP)
            self.frozen.append(group)
            threading.Timer(self.args.freeze, self.thaw, (group,)).start()
        else:
            os.kill(pid, signal.SIGKILL)
        kill = Kill(round_ + 1, kind, name, pid, at, step, phase, held=held, fault=fault)
        self.kills.append(kill)
        print(f"[faults] round {round_ + 1}: {fault} {name} (pid {pid}) at step {step}, {phase:.1f}s after it"
              + (f", holding {held} tasks" if held is not None else ""), flush=True)
        return kill

    def thaw(self, group: int) -> None:
        """SIGCONT a frozen process group (at its time, or when the benchmark ends)."""
        if group in self.frozen:
            self.frozen.remove(group)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)

    def busiest_generator(self) -> tuple[str, int] | None:
        """(name, tasks held) of the generator holding the most prompt tasks, if one holds any."""
        streams, _ = self.streams()
        summary = streams.redis.xpending(streams.key("prompts"), "generator")
        counts = {c["name"].decode(): int(c["pending"]) for c in summary.get("consumers") or []
                  if c["name"].decode().startswith("generator-")}
        busiest = max(counts.items(), key=lambda item: item[1], default=None)
        return busiest if busiest and busiest[1] > 0 else None

    def watch_restarts(self) -> None:
        """Note when each killed process is back up (a new pid, ready)."""
        for kill in self.kills:
            if kill.back_up_s is None:
                pid = self.ready(kill.name, kill.pid)
                if pid:
                    kill.new_pid, kill.back_up_s = pid, time.time() - kill.at
                    print(f"[faults]   {kill.name} back up {kill.back_up_s:.1f}s after its kill", flush=True)

    def settle_kills(self) -> None:
        for kill in self.kills:
            kill.__dict__.update(recovery(kill.at, kill.step_at_kill, self.timeline))

    # -- bad messages ----------------------------------------------------------------------------------------
    def streams(self):
        if self._streams is None:
            from services.config import load_settings
            from services.keys import ROLES
            from services.redis_local import client_for
            from services.streams import Streams

            settings = load_settings(self.args.preset, token=self.token, run_dir=str(self.run_dir),
                                     redis={"run": RUN_NAME})
            client = client_for(self.redis_url())
            self._streams = (Streams(client, settings, signs_as=ROLES), settings)
        return self._streams

    def inject(self, wave: int) -> None:
        """One wave of poison, malformed and forged messages (16 entries)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from services.keys import ROLES, SIGNER_OF, Signer
        from services.messages import (
            PromptTask,
            RolloutGroup,
            Sample,
            SamplingParams,
            Score,
            ScoredGroup,
            from_wire,
            to_wire,
        )
        from services.streams import without_ground_truth

        streams, settings = self.streams()
        r = streams.redis
        # Keys of the right roles whose ids the run does not trust: what a rotation retired (or nobody issued).
        retired = {role: Signer(role, Ed25519PrivateKey.generate()) for role in ROLES}
        s = settings.sampling
        sampling = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)

        def made_up(tag: str, **update) -> PromptTask:
            task = PromptTask(task_id=f"train-{tag}-{uuid.uuid4().hex}", prompt_id=f"{tag}-{wave}",
                              prompt="What is 2 + 3?\n", prompt_token_ids=[17, 10, 18, 28, 30], ground_truth="5",
                              sampling=sampling)
            return task.model_copy(update=update)

        def group(task: PromptTask, n: int | None = None) -> ScoredGroup:
            n = task.sampling.n if n is None else n
            samples = [Sample(token_ids=[20, 21], logprobs=[-0.1, -0.2], text="Answer: 5", finish_reason="stop")] * n
            scores = [Score(reward=1.0 if i % 2 else -1.0, correct=bool(i % 2), overlong=False, rule="answer_line")
                      for i in range(n)]
            rollout = RolloutGroup(task=task, policy_version=0, generator_id="forger", samples=samples)
            return ScoredGroup(rollout=rollout, scores=scores, reward_worker_id="forger")

        def write(kind, label, stream, expect, fields: dict, task_id=None, real_task=False, into=None) -> None:
            r.xadd(streams.key(into or stream), fields)
            # the digest of the bytes as a dead letter keeps them (a scored group's without its ground truth)
            kept = without_ground_truth(stream, fields.get(b"data", b""))
            self.injections.append(Injection(kind, label, stream, expect, digest(kept), task_id, real_task,
                                             time.time()))

        def signed(stream: str, payload: bytes, signer: Signer | None = None) -> dict:
            """Signed by `signer`, by default the key of the role that signs `stream` (the run's own)."""
            signer = signer or streams.signers[SIGNER_OF[stream]]
            return {b"data": payload, b"sig": signer.sign(streams.key(stream), payload)}

        def task_entry(kind, label, expect, task: PromptTask) -> None:
            write(kind, label, "prompts", expect, signed("prompts", to_wire(task)), task.task_id)

        # Poison: signed with the real token, schema-valid, but no engine can serve them.
        task_entry("poison", "token id 10^9", "invalid task: token id 1000000000", made_up(
            "poison", prompt_token_ids=[17, 10, 10**9, 28]))
        task_entry("poison", "prompt longer than the model", "invalid task: prompt of 300 tokens",
                   made_up("poison", prompt_token_ids=[17] * 300))
        # Larger than a prompts entry can be (1.2 MiB at these settings), smaller than the largest value the run's
        # Redis takes (2.2 MiB): stored, and refused by its consumer unread. (8 MB: refused by Redis, `oversize_entry`.)
        task_entry("poison", "1.5 MB prompt text", "oversize: 1,", made_up(
            "poison", prompt_token_ids=None, prompt="1 + " * 400_000))
        task_entry("poison", "max_tokens 10^6", "invalid task: max_tokens 1000000", made_up(
            "poison", sampling=sampling.model_copy(update={"max_tokens": 10**6})))
        # Malformed: signed (a producer with the token that writes garbage), or no payload at all.
        garbage = b"\xff\x00 not msgpack " + uuid.uuid4().bytes
        write("malformed", "garbage bytes (prompts)", "prompts", "unparseable PromptTask", signed("prompts", garbage))
        future = group(made_up("malformed")).rollout.model_dump(context={"wire": True})
        future["schema_version"] = 99
        payload = msgpack.packb(future, use_bin_type=True)
        write("malformed", "schema_version 99 (rollouts)", "rollouts", "unparseable RolloutGroup",
              signed("rollouts", payload), task_id_in_payload("rollouts", payload))
        garbage = b"\x93\x01\x02" + uuid.uuid4().bytes
        write("malformed", "garbage bytes (scored)", "scored", "unparseable ScoredGroup", signed("scored", garbage))
        write("malformed", "entry without a payload (scored)", "scored", "forged: no signature",
              {b"other": uuid.uuid4().hex.encode()})
        # Forged: without a trusted key, with another role's key, or with the right key for tasks never issued.
        fake = made_up("forged")
        write("forged", "scored group, unknown task id, signed", "scored", "provenance: unknown task id",
              signed("scored", to_wire(group(fake))), fake.task_id)
        fake = made_up("forged")
        write("forged", "scored group, under a retired kid", "scored", "forged: key id",
              signed("scored", to_wire(group(fake)), retired["reward"]), fake.task_id)
        fake = made_up("forged")
        write("forged", "scored group, no signature", "scored", "forged: no signature",
              {b"data": to_wire(group(fake))}, fake.task_id)
        fake = made_up("forged")
        task_entry("forged", "prompt with a made-up task id, signed (through the pipeline)",
                   "provenance: unknown task id", fake)
        fake = made_up("forged")
        write("forged", "prompt, under a retired kid", "prompts", "forged: key id",
              signed("prompts", to_wire(fake), retired["learner"]), fake.task_id)
        fake = made_up("forged")
        write("forged", "rollout group, under a retired kid", "rollouts", "forged: key id",
              signed("rollouts", to_wire(group(fake).rollout), retired["generator"]), fake.task_id)
        fake = made_up("forged")
        write("forged", "prompt signed with the reward role's key", "prompts", "forged: signed by the reward role",
              signed("prompts", to_wire(fake), streams.signers["reward"]), fake.task_id)
        # A genuine issued task's group, altered after signing: refused on its bytes (its real group trains).
        issued = [(k, v) for k, v in r.hscan_iter(streams.key("issued"), count=100) if k.startswith(b"train-")]
        if issued:
            task = from_wire(PromptTask, issued[-1][1])
            genuine, tampered = to_wire(group(task)), to_wire(group(task.model_copy(update={"ground_truth": "-1"})))
            write("forged", "issued task's group, tampered after signing", "scored", "forged: bad signature",
                  {b"data": tampered, b"sig": signed("scored", genuine)[b"sig"]}, task.task_id, real_task=True)
            write("forged", "issued task's group, signed with a generator's key", "scored",
                  "forged: signed by the generator role", signed("scored", genuine, streams.signers["generator"]),
                  task.task_id, real_task=True)
            # A reward worker that scored a genuine rollout and rewrote its samples: the rollout's own signature
            # (which the group carries on) no longer holds. The digest is of the group without its ground truth.
            scored = group(task)
            vouched = scored.model_copy(update={"rollout_signature": signed(
                "rollouts", to_wire(scored.rollout.as_generated()))[b"sig"]})
            planted = [Sample(token_ids=[22, 23], logprobs=[-0.3, -0.3], text="planted", finish_reason="stop")]
            rewritten = vouched.model_copy(update={"rollout": vouched.rollout.model_copy(
                update={"samples": planted * task.sampling.n})})
            write("forged", "issued task's rollout, rewritten by its reward worker", "scored",
                  "forged: bad signature", signed("scored", to_wire(rewritten)), task.task_id, real_task=True)
            # A generator's own signed letter retiring an issued task it was never delivered, the task's bytes in
            # it: it retires nothing (the learner reads what a letter retires from the entry its writer parked),
            # so the genuine group still trains; were the task retired, that group would be dead-lettered as
            # unknown, and counted as a legitimate task dead-lettered.
            letter = {b"stream": "prompts", b"entry_id": "1-0", b"reason": "delivered 4 times (max 3)",
                      b"deliveries": 4, b"task_id": task.task_id, b"data": to_wire(task.for_generators())}
            write("forged", "a generator's letter for an issued task it never held", "prompts", "delivered 4 times",
                  {**letter, b"sig": streams.dead_letter_signature(letter)}, task.task_id, real_task=True,
                  into="dead")
        self.acl_attempts += outside_acl(self.generator_client(), "generator", streams)
        self.acl_attempts.append(oversize_entry(self.generator_client(retrying=False), streams))
        self.flood(wave)
        pids = service_pids(self.proc.pid)
        generators = sorted(name for name in pids if name.startswith("generator-"))
        if generators:  # (one being restarted after a kill is tried in the next wave)
            urls = json.loads((self.run_dir / "services.json").read_text())["http"]
            self.acl_attempts += outside_audience(pids[generators[0]], urls)
        print(f"[faults] wave {wave}: {len(self.injections)} bad messages written so far", flush=True)

    def flood(self, wave: int, timeout: float = 120.0) -> None:
        """As the generator's Redis user (no retries), XADD 2 MB entries to `rollouts` until Redis refuses one for
        memory; then time how long until Redis is below 95 % of maxmemory again (the learner trims within 10 s)."""
        import redis

        from services.streams import MEMORY_TRIM_SHARE

        streams, _ = self.streams()
        client, payload = self.generator_client(retrying=False), b"F" * FLOOD_ENTRY_BYTES
        entries, filled = 0, False
        try:
            while entries < 10_000:
                client.xadd(streams.key("rollouts"), {"data": payload, "sig": b"-"})
                entries += 1
        except redis.exceptions.OutOfMemoryError:
            filled = True
        full_at = time.monotonic()
        self.injections += [Injection("flood", "2 MB entries until Redis was full", "rollouts", "oversize",
                                      digest(payload), at=time.time()) for _ in range(entries)]
        writable_after = None
        while time.monotonic() - full_at < timeout:
            used, maxmemory = streams.memory()
            if used < MEMORY_TRIM_SHARE * maxmemory:
                writable_after = time.monotonic() - full_at
                break
            time.sleep(0.25)
        self.floods.append({"wave": wave, "entries": entries, "filled": filled, "writable_after_s": writable_after})
        print(f"[faults] wave {wave}: {entries} entries of 2 MB filled Redis ({filled}); below 95 % again after "
              f"{writable_after} s", flush=True)

    # -- the end ---------------------------------------------------------------------------------------------
    def dead_letters(self) -> list[dict]:
        """The `dead` stream, from the run's Redis (restarted on its AOF after the run)."""
        from services.redis_local import EmbeddedRedis, client_for

        server = EmbeddedRedis(self.run_dir / "redis").start()
        try:
            client = client_for(server.url)
            rows = client.xrange(f"dapo:{RUN_NAME}:dead")
            out = []
            for eid, fields in rows:
                row = {k.decode(): (v if k == b"data" else v.decode(errors="replace")) for k, v in fields.items()}
                out.append({"id": eid.decode(), **with_spilled_payload(row)})
            client.close()
            return out
        finally:
            server.stop()


def fmt(values: list, spec: str = ".1f") -> str:
    shown = [format(v, spec) if isinstance(v, (int, float)) else "-" for v in values]
    return ", ".join(shown)


def fault_name(result: dict) -> str:
    """SIGKILL, or what a freeze was (`--freeze`): the kills' own word, SIGKILL for results from before."""
    kills = [k if isinstance(k, dict) else asdict(k) for k in result["kills"]]
    return next((k.get("fault", "SIGKILL") for k in kills), "SIGKILL")


def report(result: dict) -> str:
    a = result["analysis"]
    ledger, metrics_ = a["ledger"], a["metrics"]
    lines = [f"`{result['command_short']}` (written by it; `--from-json` writes it again from the raw results)", "",
             f"One run of {result['steps']} steps, 2 generators, 1 reward worker; {len(result['kills'])} "
             + ("SIGKILLs; " if fault_name(result) == "SIGKILL" else f"freezes ({fault_name(result)} each); ") +
             f"{sum(v['injected'] for v in a['injections'].values())} bad messages in {ROUNDS} waves. "
             f"{result['conditions']}", "",
             "| goal | measured | met |", "| --- | --- | --- |"]

    def row(goal, measured, ok):
        lines.append(f"| {goal} | {measured} | {'yes' if ok else '**no**'} |")

    row("the run finishes by itself", f"exit {result['returncode']} after {result['minutes']:.1f} min",
        result["returncode"] == 0)
    row("every step once in the ledger", f"{ledger['steps']} steps, 1..{ledger['steps']} in order"
        if ledger["steps_once_in_order"] else f"{ledger['steps']} rows, repeated {ledger['steps_repeated']}",
        ledger["steps_once_in_order"] and ledger["steps"] == result["steps"])
    row("0 groups trained twice", f"{len(ledger['groups_trained_twice'])} of {ledger['groups_trained']} "
        f"({ledger['groups_unique']} unique)", not ledger["groups_trained_twice"])
    row("0 legitimate tasks dead-lettered", f"{len(a['legit_dead'])} of {a['dead_letters']} dead letters",
        not a["legit_dead"])
    row("0 forged messages trained", f"{a['forged_trained']} of {a['forged_injected']}", a["forged_trained"] == 0)
    if "ground_truth_in_dead" in a:  # counted since 2026-11-28
        row("0 dead letters carrying a ground truth", f"{len(a['ground_truth_in_dead'])} of {a['dead_letters']}",
            not a["ground_truth_in_dead"])
    bad = sum(v["injected"] for v in a["injections"].values())
    ok = sum(v["dead_as_expected"] for v in a["injections"].values())
    row("every bad message dead-lettered with its exact reason", f"{ok} of {bad}", ok == bad)
    row("0 Redis commands outside a role's ACL accepted",
        f"{len(a['acl_accepted'])} of {a['acl_attempts']}"
        + (f" ({', '.join(a['acl_accepted'])})" if a["acl_accepted"] else ""),
        not a["acl_accepted"] and a["acl_attempts"] > 0)
    if "http_attempts" in a:  # counted since 2026-11-28 (a token per audience)
        row("0 HTTP calls outside a generator's audience accepted",
            f"{len(a['http_accepted'])} of {a['http_attempts']}"
            + (f" ({', '.join(a['http_accepted'])})" if a["http_accepted"] else ""),
            not a["http_accepted"] and a["http_attempts"] > 0)
    floods = result.get("floods")
    if floods is not None:  # since 2026-11-29: a generator fills Redis to maxmemory each wave
        back = [f["writable_after_s"] for f in floods]
        row("Redis filled to maxmemory by a generator: it is freed, the run goes on",
            f"{len(floods)} floods of {fmt([f['entries'] for f in floods], 'd')} entries of 2 MB (writes refused: "
            f"{sum(f['filled'] for f in floods)} of {len(floods)}); below 95 % again after {fmt(back)} s; "
            f"{a['flood']['dead_as_expected']} of {a['flood']['entries']} dead-lettered (`oversize`), the rest "
            "trimmed unread", all(f["filled"] for f in floods) and None not in back and result["returncode"] == 0)
    row("no process left behind by a killed one", f"{len(result['orphans'])} left", not result["orphans"])
    lines += ["", f"Work redone after each kill (seconds from the {fault_name(result)}; the median step took "
              f"{metrics_['median_step_s']:.1f} s in this run):", "",
              "| process | kills | back up (s) | next step done (s) | steps redone |",
              "| --- | ---: | --- | --- | --- |"]
    for kind, k in a["per_kind"].items():
        lines.append(f"| {kind} | {k['kills']} | {fmt(k['back_up_s'])} | {fmt(k['next_step_s'])} | "
                     f"{fmt(k['steps_redone'], 'd')} |")
    lines += ["", "Each kill: the last step in the ledger at the kill, and how long after that step was seen the kill "
              "came:", "",
              f"| round | {fault_name(result)} | at step | s after the step | back up (s) | next step done (s) | "
              "steps cut back |",
              "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for k in result["kills"]:
        k = k if isinstance(k, dict) else asdict(k)
        cut = k["step_at_kill"] - k["rolled_back_to"] if k.get("rolled_back_to") is not None else None
        name = k["name"] + (f" (holding {k['held']} tasks)" if k.get("held") is not None else "")
        lines.append(f"| {k['round']} | {name} | {k['step_at_kill']} | {k['phase']:.1f} | {fmt([k['back_up_s']])} "
                     f"| {fmt([k['next_step_s']])} | {fmt([cut], 'd')} |")
    cut = sum(n for k in a["per_kind"].values() for n in k["steps_redone"] if n)
    lines += ["", f"Steps cut back by learner restarts and trained again from the checkpoint: {cut} (ledger rows "
              f"seen and then replaced by a row of other groups: {a['redone']['steps_redone']}, "
              f"{a['redone']['groups_retrained']} groups); duplicates dropped on admission: "
              f"{metrics_['duplicates_dropped']}; tasks the learner stopped waiting for after a Redis restart: "
              f"{metrics_['lost_with_redis']}.", "",
              "| bad message | stream | injected | dead-lettered with the expected reason | trained | reason |",
              "| --- | --- | ---: | ---: | ---: | --- |"]
    for label, v in a["injections"].items():
        reason = " ".join((v["reasons"][0] if v["reasons"] else "-").split()).replace("|", "\\|")
        if len(reason) > 90:
            reason = reason[:87] + "..."
        lines.append(f"| {v['kind']}: {label} | {v['stream']} | {v['injected']} | {v['dead_as_expected']} | "
                     f"{v['trained'] if v['kind'] != 'malformed' else '-'} | `{reason}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)  # 12 kills a step or more apart, after the first wave
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--run-dir", default="/tmp/dapo-bench-faults", help="short: the Redis socket lives in it")
    parser.add_argument("--set", action="append", default=[], help="extra key=value overrides")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--freeze", type=float, default=0.0,
                        help="stop each process (its group) this many seconds, then resume it, instead of SIGKILL")
    parser.add_argument("--name", default="faults",
                        help="results/NAME.json and the README section between the NAME markers")
    parser.add_argument("--from-json", action="store_true",
                        help="no run: write the table again from benchmarks/results/faults.json")
    args = parser.parse_args(argv)
    from benchmarks.runs import replace_section

    out = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    if args.from_json:
        table = report(json.loads(out.read_text()))
        print(table)
        if not args.no_readme:
            replace_section(ROOT / "benchmarks" / "README.md", args.name, table)
        return 0

    faults = Faults(args)
    load_start = os.getloadavg()
    faults.start()
    error = None
    try:
        for round_ in range(ROUNDS):
            faults.wait("the first step" if round_ == 0 else "a step", lambda: faults.poll() >= 1, 1800)
            faults.inject(round_ + 1)
            for kind in KINDS:
                name = {"generator": f"generator-{round_ % 2}", "reward": "reward-0", "learner": "learner",
                        "redis": "redis-server"}[kind]
                faults.kill(round_, kind, name)
        while faults.alive():
            faults.poll()
            time.sleep(1.0)
    except (RuntimeError, TimeoutError) as err:
        error = str(err)
        print(f"[faults] {error}", flush=True)
    finally:
        for group in list(faults.frozen):
            faults.thaw(group)
        if faults.alive():
            if error:
                faults.proc.send_signal(signal.SIGINT)
            try:
                faults.proc.wait(timeout=3600 if not error else 120)
            except subprocess.TimeoutExpired:
                faults.proc.kill()
                faults.proc.wait()
        faults.out.close()
    faults.poll()
    faults.settle_kills()
    orphans = pgid_members(faults.groups)
    final = read_rows(faults.run_dir / "ledger.jsonl")
    dead = faults.dead_letters()
    analysis = analyze(final, list(faults.seen.values()), read_rows(faults.run_dir / "metrics.jsonl"), dead,
                       faults.injections, faults.kills, faults.acl_attempts)
    load_end = os.getloadavg()
    result = {
        "command": faults.command,
        "command_short": "python -m benchmarks.faults " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": args.steps, "overrides": OVERRIDES + args.set, "returncode": faults.proc.returncode,
        "error": error, "minutes": (time.time() - faults.started) / 60.0,
        "load_average": {"start": load_start, "end": load_end},
        "conditions": (f"Machine: 2 cores shared with other jobs (1-minute load average {load_start[0]:.1f} at the "
                       f"start, {load_end[0]:.1f} at the end)."),
        "kills": [asdict(k) for k in faults.kills],
        "injections": [asdict(i) for i in faults.injections],
        "acl_attempts": [asdict(a) for a in faults.acl_attempts],
        "floods": faults.floods,
        "dead_letters": [{k: v for k, v in row.items() if k != "data"} for row in dead],
        "orphans": orphans,
        "analysis": analysis,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    table = report(result)
    print(table)
    if not args.no_readme:
        replace_section(ROOT / "benchmarks" / "README.md", args.name, table)
    return 0 if result["returncode"] == 0 and not error else 1


if __name__ == "__main__":
    sys.exit(main())
