"""`dapo run`: the whole system on one machine, as separate processes with the deployment entry points.

It builds the embedded model if missing, starts an embedded redis-server (AOF, a password made for this run),
then one learner, N generators and M reward workers (`python -m cli <service>`), shows a live view of the
learner's metrics.jsonl, stops everything cleanly on Ctrl-C, and at the end writes plots and a summary table
into the run folder.

Nothing but the user (or the learner finishing) ends a run: a dead redis-server is restarted on its AOF (same
socket, folder and password; the services' clients retry meanwhile), a learner that did not exit by itself
(killed, crashed) is restarted and resumes from its checkpoint, a crashed worker is restarted. A process that
keeps crashing without progress is given up after RESTART_LIMIT tries (a bug, not bad luck): progress is a
training step beyond the furthest one recorded before the process started (a slow-loading learner that crashes on
the same step, or a generator whose engine fails minutes into every start, is not restarted for ever, however long
each try lasts; a worker that crashes while the run goes on is).

Each child is the leader of its own process group (its own session), and stopping or restarting a child kills
that whole group: a SIGKILLed generator would otherwise leave its vLLM engine core running, orphaned.
One launcher per run folder: `dapo run` holds an exclusive lock (flock) on `{run_dir}/.dapo-run.lock` for its
whole life, which names its holder; a second one on the same folder exits 69 naming it, before it starts anything
(a second redis-server on the same data, a second learner). SIGHUP stops a run as SIGTERM and SIGINT do.
Children die with the launcher: each gets SIGTERM when it dies, even by SIGKILL (PR_SET_PDEATHSIG, Linux), and
the embedded redis-server holds a lock on its data folder that a second server is refused (naming the holder).
Secrets: without a configured token the run makes a random one, and a weights token (`weights_token`) too. Each
child gets in its environment what its role needs, and `launch-config.yaml` (the settings they read) is written
without secrets, mode 0600: every child the operator token's sha256 (to admit the operator; none holds the token),
the learner and generators the weights token (it opens only the learner's weights); so no worker holds a token to
another service (`/v1/score` included). The
embedded server has a Redis user per role with a password made for this run: each child's URL is its role's user
(services/redis_users.py). The run's role keys (services/keys.py) are made once under run_dir/keys.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Mapping

from rich.console import Console
from rich.live import Live
from rich.table import Table

from cli import cores
from cli.cores import CpuPlan, Placement, cpu_seconds_by_root
from learner.checkpoint import Checkpoints
from learner.lease import INSTANCE_ENV
from learner.records import METRICS_FILE, Progress, Records, read_rows
from services.config import (
    DEFAULT_TOKEN,
    ConfigError,
    Settings,
    digest_of_token,
    dump_settings,
    names_a_field,
    without_password,
)
from services.errors import ExitCode, Unavailable
from services.files import write_atomic
from services.http import free_port
from services.keys import ROLES, Role, create_keys, keys_dir
from services.models import SHIPPED_TINY_REFERENCE, shipped_tiny_applies
from services.redis_local import EmbeddedRedis, embedded_server
from services.redis_users import REDIS_USERS
from services.startup import EXIT_FILE_ENV, LockHeld, die_with_parent, recorded_exit, take_lock

log = logging.getLogger(__name__)
console = Console()

RESTART_LIMIT = 5  # crashes in a row of one process without progress before giving up
CPU_SAMPLE_SECONDS = 10.0  # how often the children's CPU seconds are read
RANKS_STOP_SECONDS = 120.0  # SIGTERM to SIGKILL for the learner's ranks: rank 0 finishes the step and checkpoints
# The launcher's own SIGKILL reaches torchrun's process group only (each rank leads a session of its own), so it
# comes after torchrun's (TORCH_ELASTIC_SHUTDOWN_TIMEOUT): no rank outlives the run.
LEARNER_STOP_SECONDS = RANKS_STOP_SECONDS + 20.0
# The learner's own exits, not restarted: finished (a signal before then exits 128 + it, and is restarted unless the
# launcher sent it while stopping everything), refill limit with on_refill_limit=stop, fenced
# (another learner took the run's lease, learner/lease.py: a restart would only wait for it and fail), a usage error
# (its configuration: a recipe that differs from its checkpoint's, say), a data error.
LEARNER_DONE = (0, ExitCode.REFILL_LIMIT, ExitCode.FENCED, ExitCode.USAGE, ExitCode.DATA_ERROR)
RUN_LOCK = ".dapo-run.lock"  # in the run folder: held (flock) by the one launcher of that folder


class RunFolderBusy(Unavailable):
    """Another `dapo run` holds the run folder's lock (exit 69, one line naming it)."""


def lock_run_folder(run_dir: Path) -> IO[str]:
    """Take the run folder's exclusive lock and write the holder into it; held as long as the returned file stays
    open (the kernel drops it when the launcher dies, however). RunFolderBusy, naming the holder, when taken."""
    try:
        handle = take_lock(run_dir / RUN_LOCK)
    except LockHeld as held:
        raise RunFolderBusy(f"{run_dir} is in use by another `dapo run` ({held.holder}); stop it, or choose another "
                            "run_dir") from None
    handle.write(f"dapo run pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


@dataclass
class Child:
    """One service process and how to start it again."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None
    stop_seconds: float = 30.0  # SIGTERM to SIGKILL
    placement: Placement | None = None  # its CPUs and priority (cli/cores.py)
    exit_file: Path | None = None  # where it records the exit code it chose ($DAPO_EXIT_FILE, services/startup.py)
    exit_path: Path | None = None  # exit_file of the current start: an orphaned rank of a start before writes elsewhere
    # How far the run got (the furthest step recorded); None: no progress ever starts a new count of crashes
    progress: Callable[[], int] | None = None
    progress_mark: int = -1  # the furthest progress seen when it last started
    # added to its environment when it starts again after progress of its own (the learner: a step of this run)
    restart_env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    gave_up: bool = False  # crashed RESTART_LIMIT times in a row: not started again
    waiting: bool = False  # exited while Redis did not answer: started again, uncounted, once it does
    cpu_before: float = 0.0  # CPU seconds of its previous processes (restarts)
    cpu_now: float = 0.0  # of the current process group, last sampled
    keep_fds: tuple[int, ...] = ()  # open files it inherits (the learner: the run folder's lock)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.exit_file is not None:
            if self.exit_path is not None:
                self.exit_path.unlink(missing_ok=True)
            self.exit_path = self.exit_file.with_name(f"{self.exit_file.name}.{secrets.token_hex(4)}")
            self.env = {**self.env, EXIT_FILE_ENV: str(self.exit_path)}
        log_file = open(self.log_path, "ab")
        placement = self.placement
        orphaned = die_with_parent()

        def prepare() -> None:  # in the child, before exec: every thread it starts inherits the CPU set
            orphaned()  # SIGTERM when the launcher dies (SIGKILL included): no service outlives its run
            if placement is not None:
                os.sched_setaffinity(0, placement.cpus)
                os.nice(placement.nice)

        # A new session: Ctrl-C reaches only the launcher, which then stops children in order.
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=prepare, pass_fds=self.keep_fds,
        )
        log_file.close()
        if self.progress is not None:
            self.progress_mark = max(self.progress_mark, self.progress())

    def sample_cpu(self, by_root: dict[int, float]) -> None:
        """Record the CPU seconds of its processes (`cores.cpu_seconds_by_root`, by its pid)."""
        if self.alive():
            self.cpu_now = max(self.cpu_now, by_root.get(self.process.pid, 0.0))

    @property
    def cpu_total(self) -> float:
        return self.cpu_before + self.cpu_now

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        """How its process ended: the code its service (rank 0) recorded, when it got that far (a torchrun over the
        learner's ranks turns any code into 1), else the process's own; None while it runs."""
        if self.process is None or self.process.poll() is None:
            return None
        if self.exit_path is not None:
            return recorded_exit(self.exit_path, self.process.returncode)
        return self.process.returncode

    @property
    def kind(self) -> str:
        """learner, reward or generator (the name without its index)."""
        return self.name.rsplit("-", 1)[0]

    def progressed(self) -> bool:
        """The run got further than before its last start: a step beyond the furthest one."""
        return self.progress is not None and self.progress() > self.progress_mark

    def restart(self, redis_answers: Callable[[], bool] | None = None) -> bool:
        """Start again after a crash, once the crashed child's whole process group is gone; False once it crashed
        RESTART_LIMIT times in a row without progress, and from then on (its group is not killed again: the pid
        may belong to another process by then). An exit while Redis does not answer (`redis_answers`: a server
        stopped or stalled, not dead) is no crash of the child's: it waits, and starts again uncounted once Redis
        answers (restarted at once, each start failed to reach Redis in seconds: a stall of a minute and a half
        ended the run)."""
        if self.gave_up:
            return False
        if not self.waiting:
            self.kill_group()
        if redis_answers is not None and not redis_answers():
            if not self.waiting:
                log.warning("%s exited with %s while Redis does not answer: it starts again once Redis does",
                            self.name, self.exit_code)
            self.waiting = True
            return True
        uncounted, self.waiting = self.waiting, False
        if self.progressed():
            self.restarts = 0
        if self.restarts >= RESTART_LIMIT and not uncounted:
            self.gave_up = True
            log.error("%s crashed %d times in a row without progress; not restarting it (see %s)",
                      self.name, RESTART_LIMIT, self.log_path)
            return False
        self.restarts += not uncounted
        log.warning("%s exited with %s; restart %d%s", self.name, self.exit_code, self.restarts,
                    " (Redis answers again: not counted)" if uncounted else "")
        self.cpu_before, self.cpu_now = self.cpu_total, 0.0
        if self.progress is None or self.progress() > 0:
            self.env = {**self.env, **self.restart_env}
        self.start()
        return True

    def stop(self) -> None:
        """SIGTERM (the service finishes or hands back its work), then SIGKILL whatever is left of its group (not
        one given up or waiting for Redis: its group was killed then, and its pid, reaped, may lead another
        process's group by now)."""
        if self.process is None or self.gave_up or self.waiting:
            return
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_seconds)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()

    def kill_now(self) -> None:
        """SIGKILL the child's process groups and return (from a signal handler: no wait, which takes a lock the
        interrupted `stop` may hold)."""
        if self.process is not None and self.process.returncode is None:
            self._kill_groups()

    def kill_group(self) -> None:
        """SIGKILL the child's process group (its pid: it leads its own session), and those of its descendants: the
        child and anything it started, such as a vLLM engine core left behind by a SIGKILLed generator, or the
        learner's ranks, each in a session of its own under torchrun."""
        self._kill_groups()
        self.process.wait()

    def _kill_groups(self) -> None:
        for group in [*cores.descendant_groups(self.process.pid), self.process.pid]:  # before they are orphaned
            with contextlib.suppress(ProcessLookupError, PermissionError):  # (gone: nothing left behind)
                os.killpg(group, signal.SIGKILL)



def steps_recorded(metrics_path: Path) -> int:
    """The furthest step in the learner's metrics.jsonl (0 before the first)."""
    return max((int(row.get("step", 0)) for row in read_rows(metrics_path)), default=0)


def learner_command(procs: int) -> list[str]:
    """`python -m cli learner`, or with procs > 1 the same under `accelerate launch` (torchrun): one rank per GPU
    when there are GPUs, else procs CPU processes over gloo (the learner then runs with ACCELERATE_USE_CPU)."""
    python = [sys.executable, "-m", "cli", "learner"]
    if procs <= 1:
        return python
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "cli", "learner"]


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


TOKEN_VARIABLES = frozenset({"DAPO_TOKEN", "DAPO_TOKEN_SHA256", "DAPO_WEIGHTS_TOKEN"})  # set per role


def service_children(settings: Settings, config_path: Path, redis_urls: Mapping[Role, str], generators: int,
                     reward_workers: int, learner_port: int, learner_procs: int = 1,
                     cpus: CpuPlan | None = None) -> list[Child]:
    """The service processes of a run, each on its CPUs with matching threads when `cpus` is given, each with its
    role's Redis URL (`redis_urls`: the role's own user in an embedded run) and no other role's."""
    run_dir = Path(settings.run_dir)
    # A token per audience: every service knows the operator's token by its sha256 alone (it admits the operator,
    # it sends that token nowhere); the learner admits the weights token to the weights only, and generators hold
    # it to pull. So no child holds a token that opens another service, and none holds the operator's.
    operator = (settings.token_sha256.get_secret_value() if settings.token_sha256
                else digest_of_token(settings.token.get_secret_value()))
    tokens = {role: {"DAPO_TOKEN_SHA256": operator} for role in ROLES}
    if settings.weights_token is not None:
        for role in ("learner", "generator"):
            tokens[role]["DAPO_WEIGHTS_TOKEN"] = settings.weights_token.get_secret_value()
    # Children read the run's settings from the launch config, resolved here from the shell's DAPO_ variables, the
    # file and --set: a field's variable passed on would beat the file, and so undo --set in the children alone
    # (`DAPO_RUN_DIR=/a dapo run --set run_dir=/b`: the launcher in /b, its services in /a).
    base_env = {
        **{k: v for k, v in os.environ.items() if k != EXIT_FILE_ENV and not names_a_field(k)},
        # The secrets: not in the config file (dump_settings without_secrets).
        **({"DAPO_REDIS__PASSWORD": settings.redis.password.get_secret_value()} if settings.redis.password else {}),
        # Every service needs it: the learner serves there, generators send their token nowhere else.
        "DAPO_LEARNER__PUBLIC_URL": f"http://127.0.0.1:{learner_port}",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(settings.generator.kv_cache_gib)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    python = [sys.executable, "-m", "cli"]

    def steps() -> int:
        return steps_recorded(run_dir / METRICS_FILE)

    def child(name: str, service: Role, **env: str) -> Child:  # a worker, named on its command line
        return Child(name, python + [service, "--config", str(config_path), "--worker-id", name],
                     {**base_env, **tokens[service], "DAPO_REDIS__URL": redis_urls[service], **env},
                     run_dir / "logs" / f"{name}.log", progress=steps)

    learner_env = {**base_env, **tokens["learner"], "DAPO_REDIS__URL": redis_urls["learner"],
                   "DAPO_LEARNER__PORT": str(learner_port),
                   "DAPO_LEARNER__HOST": "127.0.0.1", "DAPO_WEIGHTS__BROADCAST_PORT": str(free_port()),
                   # one lease identity for every restart of this run's learner: a restart after a crash takes the
                   # run back at once, a learner of another launcher still waits (learner/lease.py)
                   INSTANCE_ENV: f"{socket.gethostname()}-launcher{os.getpid()}-{secrets.token_hex(4)}",
                   # torchrun's grace between forwarding SIGTERM and SIGKILL: rank 0 finishes its step, checkpoints
                   "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(RANKS_STOP_SECONDS))}
    if learner_procs > 1 and not _has_gpu():
        learner_env["ACCELERATE_USE_CPU"] = "true"  # accelerate's multi-process launch is torchrun either way
    if cpus is not None:
        learner_env.update(cores.learner_env(cpus.learner))
    children = [Child("learner", learner_command(learner_procs) + ["--config", str(config_path)], learner_env,
                      run_dir / "logs" / "learner.log", stop_seconds=LEARNER_STOP_SECONDS,
                      placement=cpus.learner if cpus else None, exit_file=run_dir / "logs" / "learner.exit",
                      progress=steps,
                      # `resume: false` starts the run over once: a restart after a crash that follows a step of
                      # this run resumes it (before one, there is nothing of it to resume: it starts over again)
                      restart_env={"DAPO_LEARNER__CHECKPOINTS__RESUME": "true"})]
    for i in range(reward_workers):
        placed = cpus.reward[i] if cpus else None
        children.append(child(f"reward-{i}", "reward", DAPO_REWARD__PORT=str(free_port()),
                              DAPO_REWARD__HOST="127.0.0.1",
                              **(cores.reward_env(placed) if placed else {})))
        children[-1].placement = placed
    for i in range(generators):
        placed = cpus.generators[i] if cpus else None
        children.append(child(f"generator-{i}", "generator", DAPO_GENERATOR__PORT=str(free_port()),
                              DAPO_GENERATOR__HOST="127.0.0.1",
                              **(cores.generator_env(placed) if placed else {})))
        children[-1].placement = placed
    return children


def write_launch_config(settings: Settings, run_dir: Path) -> Path:
    """The settings the children read, without the secrets (they get them in their environment), mode 0600."""
    path = run_dir / "launch-config.yaml"
    write_atomic(path, dump_settings(settings, without_secrets=True), mode=0o600)
    return path


def write_service_map(children: list[Child], redis_url: str, path: Path) -> None:
    """Where each service listens (for scraping /metrics of a local run, and for tests); no password in it."""
    ports = {
        child.name: int(next(v for k, v in child.env.items() if k.startswith("DAPO_") and k.endswith("__PORT")))
        for child in children
    }
    path.write_text(json.dumps({"redis": without_password(redis_url),
                                "http": {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}},
                               indent=2))


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def status_table(progress: Progress, children: list[Child], total_steps: int) -> Table:
    last, first_eval, last_eval = progress.last, progress.first_eval, progress.last_eval
    table = Table(title="dapo run", show_header=True, expand=False)
    for column in ("step", "held-out acc", "reward (all/trained)", "refills", "staleness", "tokens/s",
                   "last step (s)", "CPU s (learner / generators / reward)", "services"):
        table.add_column(column)
    alive = sum(c.alive() for c in children)
    table.add_row(
        f"{last.get('step', 0)}/{total_steps}",
        f"{_fmt(first_eval['eval_accuracy'])} -> {_fmt(last_eval['eval_accuracy'])}" if last_eval else "-",
        f"{_fmt(last.get('reward_all'))} / {_fmt(last.get('reward_trained'))}",
        _fmt(last.get("refills"), "d") if isinstance(last.get("refills"), int) else _fmt(last.get("refills"), ".0f"),
        _fmt(last.get("staleness"), ".2f"),
        _fmt(last.get("tokens_per_second"), ".0f"),
        step_breakdown(last),
        cpu_use(children),
        f"{alive}/{len(children)} up",
    )
    return table


def cpu_use(children: list[Child]) -> str:
    """CPU seconds used by each kind of service so far (all its processes, restarts included)."""
    kinds = {"learner": 0.0, "generator": 0.0, "reward": 0.0}
    for child in children:
        kinds[child.name.split("-", 1)[0]] += child.cpu_total
    return " / ".join(f"{seconds:.0f}" for seconds in kinds.values())


def step_breakdown(row: dict) -> str:
    """Where the last step went: the learner's wait (generation / verification), update, publish, eval, and the
    generators' busy / idle seconds (learner/records.py PHASES)."""
    if row.get("step_seconds") is None:
        return "-"
    parts = [f"total {_fmt(row['step_seconds'], '.1f')}",
             f"wait {_fmt(row.get('wait_seconds'), '.1f')} (gen {_fmt(row.get('wait_generation_seconds'), '.1f')}"
             f" / verify {_fmt(row.get('wait_verification_seconds'), '.1f')})",
             f"train {_fmt(row.get('train_seconds'), '.1f')}", f"publish {_fmt(row.get('publish_seconds'), '.1f')}"]
    if row.get("eval_seconds") is not None:
        drain = _fmt(row.get("eval_drain_seconds"), ".1f")
        parts.append(f"eval {_fmt(row['eval_seconds'], '.1f')} (after a drain of {drain})")
    parts.append(f"generators busy {_fmt(row.get('generator_busy_seconds'), '.1f')}"
                 f" / idle {_fmt(row.get('generator_idle_seconds'), '.1f')}")
    return "\n".join(parts)


def learner_finished(learner: Child, redis_answers: Callable[[], bool] | None = None) -> bool:
    """The learner exited by itself (done, or stopped at the refill limit), or crashed too often to go on."""
    if learner.alive() or learner.process is None:
        return False
    return learner.exit_code in LEARNER_DONE or not learner.restart(redis_answers)


def answered_once(redis_server: EmbeddedRedis | None) -> Callable[[], bool] | None:
    """Whether the embedded Redis answers, asked once whoever asks: one supervising pass's view."""
    return functools.cache(redis_server.answers) if redis_server is not None else None


class GaveUp(RuntimeError):
    """No process of one kind is left (each crashed too often): the learner would wait for ever."""


def supervise(children: list[Child], metrics_path: Path, total_steps: int, display: bool,
              redis_server: EmbeddedRedis | None = None) -> int:
    """Run until the learner exits by itself; restart a dead Redis, learner or worker. Returns the learner's exit
    code; GaveUp when every worker of a kind crashed too often, or Redis cannot come back."""
    learner = children[0]
    last_printed, sampled_at = -1, float("-inf")
    redis_crashes, redis_mark = 0, steps_recorded(metrics_path)  # in a row, and the run's step at the last one
    progress = Progress(metrics_path)
    live = Live(status_table(progress, children, total_steps), console=console, refresh_per_second=2) \
        if display else None
    if live:
        live.start()
    try:
        # One PING a pass at most, whoever asks (each takes up to 2 s while Redis does not answer)
        while not learner_finished(learner, redis_answers := answered_once(redis_server)):
            time.sleep(1.0)
            if redis_server is not None and not redis_server.alive():
                steps = steps_recorded(metrics_path)
                redis_crashes, redis_mark = (1 if steps > redis_mark else redis_crashes + 1), steps
                if redis_crashes > RESTART_LIMIT:
                    raise GaveUp(f"redis-server exited {RESTART_LIMIT} times in a row with no training step "
                                 f"between (last exit {redis_server.process.returncode}): see "
                                 f"{redis_server.data_dir / 'redis.log'}")
                log.warning("redis-server exited with %s; restarting it on its AOF", redis_server.process.returncode)
                try:
                    redis_server.start()
                except (RuntimeError, OSError) as err:  # its AOF past repair, its disk full, its lock held
                    raise GaveUp(f"redis-server could not start again: {err}") from err
            for child in children[1:]:
                if not child.alive() and child.process is not None and not child.restart(redis_answers):
                    if all(other.gave_up for other in children[1:] if other.kind == child.kind):
                        raise GaveUp(f"every {child.kind} process crashed {RESTART_LIMIT} times in a row with no "
                                     f"training step between: the run cannot go on; see {child.log_path}")
            if time.monotonic() - sampled_at >= CPU_SAMPLE_SECONDS:  # a pass over /proc: not every second
                sampled_at = time.monotonic()
                by_root = cpu_seconds_by_root(child.process.pid for child in children if child.alive())
                for child in children:
                    child.sample_cpu(by_root)
            progress.read()
            if live:
                live.update(status_table(progress, children, total_steps))
            elif progress.last and progress.last.get("step", -1) != last_printed:
                last_printed = progress.last.get("step", -1)
                console.print(status_table(progress, children, total_steps))
    finally:
        if live:
            live.stop()
    return learner.exit_code if learner.process else 1


def reported_exit(code: int, run_dir: Path) -> int:
    """The learner's exit as `dapo run` reports it: a 0 from a learner that found its run stopped by the refill
    limit where it would resume, and stayed stopped (learner/checkpoint.py), is that stop."""
    stop = Checkpoints(run_dir).recorded_stop() if code == 0 else None
    if stop is None:
        return code
    console.print(f"[red]the refill limit stopped this run at step {stop['step']}: {stop['reason']}[/]")
    return ExitCode.REFILL_LIMIT


def main(settings: Settings, generators: int = 1, reward_workers: int = 1, learner_procs: int = 1,
         display: bool = True) -> int:
    from cli.bootstrap import ensure_model  # builds the tiny model when it is missing
    from cli.report import against_reference, write_report

    if refusal := settings.learner.compute.ranks_refusal(learner_procs):  # before anything starts
        raise ConfigError(f"{refusal}: --learner-procs")
    cpus = cores.plan(settings.cpus, generators, reward_workers)  # before anything starts: a ConfigError
    run_dir = Path(settings.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    run_lock = lock_run_folder(run_dir)  # held while this function runs, and by the learner (below)
    if not settings.learner.checkpoints.resume:  # starting over: a learner restarted (resuming) after a crash
        Checkpoints(run_dir).forget_latest()  # before its own start must not find the run before's checkpoint,
        Records(settings).cut_after(-1)  # and its progress is this run's steps (until one, it starts over again)
    settings.run_dir = str(run_dir)
    console.print(f"[bold]dapo run[/] -> {run_dir}")
    ensure_model(settings)

    redis_server = None
    redis_url = settings.redis.url and settings.redis.url.get_secret_value()
    if not redis_url:
        redis_server = embedded_server(settings)
        redis_server.password = secrets.token_hex(24)  # a new one per run, handed to the services in their environment
        # a user per role (services/redis_users.py), each child gets its own; the default user keeps no dangerous
        # command
        redis_server.users = {user: secrets.token_hex(24) for user in REDIS_USERS}
        redis_server.run = settings.redis.run  # their keys: this run's only
        redis_server.die_with_parent = True  # a killed launcher leaves no server on the run's data
        redis_url = redis_server.start().url
    if settings.token.get_secret_value() == DEFAULT_TOKEN and settings.token_sha256 is None:
        settings.token = secrets.token_urlsafe(32)  # this run's own: no process or file carries the placeholder
    if settings.weights_token is None:
        settings.weights_token = secrets.token_urlsafe(32)  # what generators pull with: it opens nothing else
    config_path = write_launch_config(settings, run_dir)
    create_keys(keys_dir(settings))  # the role keys of the run (services/keys.py), made once, kept for a resume
    redis_urls = {role: redis_server.role_url(role) if redis_server else redis_url for role in ROLES}

    console.print("CPUs: " + ", ".join(f"{name} {cpu_list}" for name, cpu_list in cpus.describe().items()))
    if cpus.oversubscribed():
        console.print(f"[yellow]CPUs {cpus.oversubscribed()} each run more than one compute thread: fewer "
                      f"generators, or more CPUs, would run faster[/]")
    children = service_children(settings, config_path, redis_urls, generators, reward_workers, free_port(),
                                learner_procs, cpus)
    # The learner holds the run folder's lock too: a launcher SIGKILLed leaves it checkpointing (SIGTERM), and a
    # `dapo run` started meanwhile would start the run over, or append, under it.
    children[0].keep_fds = (run_lock.fileno(),)
    write_service_map(children, redis_url, run_dir / "services.json")
    interrupted, gave_up, received = False, None, []

    def on_signal(signum, frame):
        received.append(signum)
        if signum == signal.SIGHUP:  # the terminal is gone: a write to it (EIO) would replace the stop in order
            console.file = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
        raise KeyboardInterrupt

    def hurry(signum, frame):  # another signal while stopping in order: what is left is killed, the rest goes on
        received.append(signum)
        console.print("[yellow]stopping now: killing what is left[/]")
        for child in children:
            child.kill_now()

    # SIGINT explicitly too: a shell that starts us in the background leaves SIGINT ignored. SIGHUP (the terminal
    # closed): stopped in order too, not killed with the services orphaned.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    code = 1
    try:
        for child in children:
            child.start()
        console.print(f"started {len(children)} services; logs in {run_dir / 'logs'}")
        code = supervise(children, run_dir / "metrics.jsonl", settings.learner.total_steps, display, redis_server)
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]stopping...[/]")
    except GaveUp as err:
        gave_up = str(err)
    finally:
        for sig in previous:  # a second Ctrl-C must not leave the services and Redis running, the report unwritten
            signal.signal(sig, hurry)
        for child in children:  # the learner first: it checkpoints on SIGTERM
            child.stop()
        if redis_server:
            redis_server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    rows = read_rows(run_dir / "metrics.jsonl")
    if rows:
        extra = {"cpus": cpus.describe(), "cpu_seconds": {c.name: round(c.cpu_total, 1) for c in children}}
        if shipped_tiny_applies(settings) and SHIPPED_TINY_REFERENCE.is_file():
            extra["reference"] = against_reference(rows, json.loads(SHIPPED_TINY_REFERENCE.read_text()))
            if extra["reference"]["verdict"].startswith("below"):
                console.print(f"[yellow]this run learned less than the shipped reference: "
                              f"{extra['reference']['verdict']}[/]")
        console.print(write_report(rows, run_dir, extra))
    if interrupted:
        return 128 + received[0]  # 130 for Ctrl-C, 143 for SIGTERM
    if children[0].gave_up:  # (its own code is the crash's: -9 for an OOM kill)
        gave_up = (f"the learner crashed {RESTART_LIMIT} times in a row without a new step (last exit {code}): the "
                   f"run cannot go on; see {children[0].log_path}")
    if gave_up:
        console.print(f"[red]stopped: {gave_up}[/]")
        return 1
    code = reported_exit(code, run_dir)
    if code != 0:
        console.print(f"[red]learner exited with code {code}; see {run_dir / 'logs' / 'learner.log'}[/]")
    return code
