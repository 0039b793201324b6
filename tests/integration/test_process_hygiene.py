"""Process hygiene without vLLM: a restarted or stopped child leaves no process of its group behind, and a
generator's engine processes (an engine core and its worker, which imports generator.vllm_worker) die with it.
(The same with the real engine: tests/integration/test_generator.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli.launcher import RESTART_LIMIT, Child, GaveUp, steps_recorded, supervise

REPO = str(Path(__file__).resolve().parents[2])

# A parent that starts a grandchild in its own process group, prints its pid, then waits.
SPAWNER = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(grandchild.pid, flush=True)
time.sleep(600)
"""

# A generator-like parent, its engine core (a multiprocessing child titled `VLLM::EngineCore`) and the core's
# worker process, which imports generator.vllm_worker (as vLLM's worker does); the parent prints both pids.
ENGINE_LIKE = """
import multiprocessing, os, sys, time
sys.path.insert(0, {repo!r})

def worker():
    import generator.vllm_worker  # noqa: F401
    time.sleep(600)

def engine_core(pids):
    with open("/proc/self/comm", "w") as comm:
        comm.write("VLLM::EngineCore")
    child = multiprocessing.get_context("spawn").Process(target=worker)
    child.start()
    pids.put((os.getpid(), child.pid))
    time.sleep(600)

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    context.Process(target=engine_core, args=(pids,)).start()
    print(*pids.get(), flush=True)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def read_pid(log_path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text() if log_path.exists() else ""
        if text.strip():
            return int(text.split()[0])
        time.sleep(0.05)
    raise AssertionError("no pid printed")


def test_restart_and_stop_kill_the_whole_process_group(tmp_path):
    child = Child("spawner", [sys.executable, "-c", SPAWNER], dict(os.environ), tmp_path / "spawner.log")
    child.start()
    try:
        grandchild = read_pid(child.log_path)
        assert os.getpgid(grandchild) == child.process.pid
        os.kill(child.process.pid, signal.SIGKILL)  # the grandchild survives its parent...
        child.process.wait()
        time.sleep(0.2)
        assert alive(grandchild)
        child.log_path.write_text("")
        child.restart()  # ...until the restart kills the old group
        assert wait_gone(grandchild, 5) and child.restarts == 1
        second = read_pid(child.log_path)
        child.stop_seconds = 1
        child.stop()  # SIGTERM ends the parent; the group kill ends its grandchild
        assert wait_gone(second, 5) and not child.alive()
    finally:
        child.kill_group()


def test_a_worker_that_keeps_crashing_is_given_up_and_the_run_stops(tmp_path):
    """After RESTART_LIMIT quick crashes a worker is not started again (nor its reaped pid's group killed again);
    with no worker of its kind left the learner would wait for ever, so the run stops with the reason."""
    learner = Child("learner", [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ),
                    tmp_path / "learner.log", stop_seconds=1)
    crashing = Child("reward-0", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path / "r.log")
    learner.start()
    crashing.start()
    try:
        with pytest.raises(GaveUp, match=f"every reward process crashed {RESTART_LIMIT} times"):
            supervise([learner, crashing], tmp_path / "metrics.jsonl", total_steps=10, display=False)
        assert crashing.gave_up and crashing.restarts == RESTART_LIMIT
        last = crashing.process
        assert not crashing.restart() and crashing.process is last
        killed = []
        with pytest.MonkeyPatch.context() as patch:  # the end of the run: its pid, reaped long ago, is left alone
            patch.setattr(os, "killpg", lambda pid, sig: killed.append(pid))
            crashing.stop()
        assert killed == []
        assert learner.alive()  # the caller stops it (the learner checkpoints on SIGTERM)
    finally:
        learner.stop()


def test_a_process_is_given_up_after_crashes_without_a_step_however_long_each_lasted(tmp_path):
    """The back-off counts the run's steps, not uptime: a learner that loads for minutes and crashes before a new
    step, or a generator whose engine fails minutes into each start (each crash after 5 minutes of uptime started
    a new count: restarted for ever, the run never ending), is given up after RESTART_LIMIT tries; one that gets
    further each time never is."""
    metrics = tmp_path / "metrics.jsonl"
    learner = Child("learner", [sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ),
                    tmp_path / "learner.log", progress=lambda: steps_recorded(metrics))
    metrics.write_text('{"step": 3}\n')
    learner.start()
    for _ in range(RESTART_LIMIT):
        learner.process.wait()  # (however long it ran)
        metrics.write_text('{"step": 2}\n{"step": 3}\n')  # resumed from step 2, crashed again on step 4
        assert learner.restart()
    learner.process.wait()
    assert not learner.restart() and learner.gave_up and learner.restarts == RESTART_LIMIT

    progressing = Child("learner", [sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ),
                        tmp_path / "learner.log", progress=lambda: steps_recorded(metrics))
    progressing.start()
    for step in range(4, 4 + 2 * RESTART_LIMIT):
        progressing.process.wait()
        metrics.write_text(f'{{"step": {step}}}\n')  # a step beyond the furthest before each crash
        assert progressing.restart() and progressing.restarts == 1
    progressing.process.wait()


@pytest.mark.parametrize("code", ["FENCED", "USAGE"])
def test_a_fenced_or_misconfigured_learner_is_not_restarted(tmp_path, code):
    """Exit 75: another learner took the run's lease (learner/lease.py), a restart would only wait and fail; exit 2:
    its configuration (a recipe other than its checkpoint's), a restart would load the model to fail again."""
    from services.errors import ExitCode

    exit_code = ExitCode[code]
    learner = Child("learner", [sys.executable, "-c", f"raise SystemExit({exit_code})"], dict(os.environ),
                    tmp_path / "learner.log")
    learner.start()
    assert supervise([learner], tmp_path / "metrics.jsonl", total_steps=10, display=False) == exit_code
    assert learner.restarts == 0


def test_a_restarted_child_gets_its_restart_environment(tmp_path):
    """`resume: false` starts a run over once: the learner restarted after a crash resumes its checkpoint."""
    command = [sys.executable, "-c", "import os; print(os.environ.get('DAPO_LEARNER__CHECKPOINTS__RESUME'))"]
    steps = [0]
    learner = Child("learner", command, dict(os.environ), tmp_path / "learner.log", progress=lambda: steps[0],
                    restart_env={"DAPO_LEARNER__CHECKPOINTS__RESUME": "true"})
    learner.start()
    learner.process.wait()
    assert learner.restart()  # crashed before a step of this run: nothing of it to resume, it starts over again
    learner.process.wait()
    steps[0] = 1
    assert learner.restart()  # after one: it resumes
    learner.process.wait()
    assert (tmp_path / "learner.log").read_text().split() == ["None", "None", "true"]


# Two ranks under torchrun: rank 0 is fenced (learner/lease.py's own exit), rank 1 waits in a collective as a
# follower would.
FENCED_RANKS = """
import sys
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from learner.lease import exit_fenced
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    exit_fenced("another learner")
dist.barrier()
"""


def test_a_fenced_learner_under_torchrun_is_not_restarted(tmp_path):
    """torchrun reports rank 0's exit 75 as its own 1; the code the learner recorded tells the launcher."""
    from cli.launcher import learner_finished
    from services.errors import ExitCode
    from services.http import free_port

    script = tmp_path / "fenced.py"
    script.write_text(FENCED_RANKS.format(repo=REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), str(script)]
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2", "OMP_NUM_THREADS": "1"}
    learner = Child("learner", command, env, tmp_path / "learner.log", exit_file=tmp_path / "learner.exit")
    learner.start()
    learner.process.wait(timeout=120)
    assert learner.process.returncode == 1  # torchrun's own code, which would restart it
    assert learner.exit_code == ExitCode.FENCED and learner_finished(learner) and learner.restarts == 0


def test_a_learner_stopped_by_a_signal_the_launcher_did_not_send_is_restarted(tmp_path):
    """`kill <learner>` (earlyoom's first signal, a supervisor's): the learner checkpoints and exits 143, the run not
    over. It exited 0, which `dapo run` took for the end of the run: everything stopped, exit 0, at step 3 of 20."""
    from cli.launcher import learner_finished

    learner = Child("learner", [sys.executable, "-c", "raise SystemExit(143)"], dict(os.environ),
                    tmp_path / "learner.log")
    learner.start()
    learner.process.wait(timeout=30)
    try:
        assert not learner_finished(learner) and learner.restarts == 1
    finally:
        learner.stop()


def test_dapo_ranks_exits_with_the_code_rank_0_chose_under_torchrun(tmp_path):
    """The container entry of a multi-rank learner (cli/ranks.py): rank 0's 75, not torchrun's 1."""
    from services.errors import ExitCode
    from services.http import free_port

    script = tmp_path / "fenced.py"
    script.write_text(FENCED_RANKS.format(repo=REPO))
    command = [sys.executable, "-m", "cli", "ranks", "--", sys.executable, "-m", "torch.distributed.run",
               "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)]
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2", "OMP_NUM_THREADS": "1"}
    assert subprocess.run(command, cwd=REPO, env=env, timeout=120).returncode == ExitCode.FENCED


# Rank 1 fails while rank 0 is still loading (its signals raise Stopped then, as `dapo learner`'s do): torchrun
# SIGTERMs rank 0, which records 143.
FOLLOWER_FAILS = """
import os, sys, time
sys.path.insert(0, {repo!r})
from services.startup import Stopped, raise_on_signals, record_exit

if int(os.environ["RANK"]) == 1:
    time.sleep(2)
    sys.exit(1)  # a CUDA error while loading its shard
raise_on_signals()
try:
    time.sleep(60)
    code = 0
except Stopped as stop:
    code = 128 + stop.signum
record_exit(code)
sys.exit(code)
"""


def test_dapo_ranks_reports_a_follower_failure_not_the_stop_torchrun_made_of_it(tmp_path):
    """rank 0's 143, recorded when torchrun stopped it after another rank failed, read as "stopped, with a
    checkpoint": the failure was lost, and `kubectl describe` showed a normal-looking stop."""
    from services.http import free_port

    script = tmp_path / "follower_fails.py"
    script.write_text(FOLLOWER_FAILS.format(repo=REPO))
    command = [sys.executable, "-m", "cli", "ranks", "--", sys.executable, "-m", "torch.distributed.run",
               "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)]
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "another rank failed or was stopped" in done.stderr


# Stops on SIGTERM as the learner does: it records the code it chose (143: checkpointed before the run's end), exits
# as torchrun would (1).
GRACEFUL = """
import os, signal, sys, time
def stop(signum, frame):
    open(os.environ["DAPO_EXIT_FILE"], "w").write("143")
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""


def test_dapo_ranks_passes_sigterm_on_and_reports_the_graceful_stop(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "cli", "ranks", "--", sys.executable, "-c", GRACEFUL],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM


# Counts the stop signals it gets in its first second: a second one would make a learner's rank 0 skip its checkpoint.
COUNTING = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
print("ready", flush=True)
while not got:
    time.sleep(0.01)
time.sleep(1.0)
open(os.environ["DAPO_EXIT_FILE"], "w").write(str(len(got)))
sys.exit(1)
"""


def test_a_terminal_ctrl_c_reaches_the_command_under_dapo_ranks_once(tmp_path):
    """A terminal sends SIGINT to its whole foreground process group: the wrapper's, here its own session's."""
    process = subprocess.Popen([sys.executable, "-m", "cli", "ranks", "--", sys.executable, "-c", COUNTING],
                               cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout.readline().strip() == "ready"
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=30) == 1  # the one signal passed on, recorded as the code


def test_a_recorded_exit_code_belongs_to_one_start(tmp_path):
    """Each start records into a path of its own: a code left by the start before (or by an orphaned rank of it)
    does not stand for a later crash."""
    crashing = Child("learner", [sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ),
                     tmp_path / "learner.log", exit_file=tmp_path / "learner.exit")
    crashing.start()
    crashing.process.wait()
    first = crashing.exit_path
    first.write_text("75\n")  # as if the process had recorded it
    assert crashing.exit_code == 75
    crashing.start()
    crashing.process.wait()
    assert crashing.exit_path != first and not first.exists() and crashing.exit_code == 1


def test_only_rank_0_records_its_exit_code(tmp_path, monkeypatch):
    from services.startup import EXIT_FILE_ENV, record_exit

    path = tmp_path / "exit"
    monkeypatch.setenv(EXIT_FILE_ENV, str(path))
    monkeypatch.setenv("RANK", "1")
    record_exit(143)  # a follower stopped by torchrun
    assert not path.exists()
    monkeypatch.setenv("RANK", "0")
    record_exit(0)  # rank 0 finished the run, though torchrun says 1
    assert path.read_text() == "0\n"
    monkeypatch.delenv("RANK")
    record_exit(3)  # a single process
    assert path.read_text() == "3\n"


def test_engine_processes_die_with_their_generator(tmp_path):
    script = tmp_path / "engine_like.py"
    script.write_text(ENGINE_LIKE.format(repo=REPO))
    child = Child("engine-like", [sys.executable, str(script)], dict(os.environ), tmp_path / "engine.log")
    child.start()
    try:
        read_pid(child.log_path)
        core, worker = map(int, child.log_path.read_text().split()[:2])
        time.sleep(3)  # let the worker import the module (a spawned interpreter)
        assert alive(core) and alive(worker)
        os.kill(child.process.pid, signal.SIGKILL)  # no launcher cleans up: the engine notices on its own
        child.process.wait()
        assert wait_gone(core, 10) and wait_gone(worker, 10), "engine processes outlived their generator"
    finally:
        child.kill_group()


@pytest.mark.parametrize("own_session", [False, True])
def test_a_child_runs_on_its_cpus_and_its_cpu_time_is_counted(tmp_path, own_session):
    """The launcher's placement (affinity, priority) reaches the child, and its CPU seconds, a grandchild's
    included, are read from one pass over /proc: in the child's process group, or in a session of its own (as
    torchrun starts each learner rank)."""
    from cli.cores import Placement, cpu_seconds_by_root

    burn = "import os, subprocess, sys, time\n" \
           "subprocess.Popen([sys.executable, '-c', 'import time\\nt = time.process_time()\\n" \
           f"while time.process_time() - t < 0.6: pass\\ntime.sleep(60)'], start_new_session={own_session})\n" \
           "print(sorted(os.sched_getaffinity(0)), os.nice(0), flush=True)\ntime.sleep(60)\n"
    cpu = min(os.sched_getaffinity(0))
    child = Child("burner", [sys.executable, "-c", burn], dict(os.environ), tmp_path / "burner.log",
                  placement=Placement((cpu,), 1, nice=5))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            child.sample_cpu(cpu_seconds_by_root([child.process.pid]))
            if child.cpu_total >= 0.5:
                break
            time.sleep(0.2)
        assert child.cpu_total >= 0.5  # the grandchild's busy loop, counted
        assert child.log_path.read_text().split() == [f"[{cpu}]", "5"]
    finally:
        for pid in {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()} - {os.getpid()}:
            try:  # a grandchild in a session of its own is not in the group kill_group ends
                if int((Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())[1]) == child.process.pid:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass
        child.kill_group()


# A launcher in miniature: the embedded redis-server and one child started as `dapo run` starts them; prints both
# pids, then waits to be killed.
LAUNCHER_LIKE = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from cli.launcher import Child
from services.redis_local import EmbeddedRedis

server = EmbeddedRedis({data!r})
server.die_with_parent = True
server.start()
child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ), Path({log!r}))
child.start()
print(child.process.pid, server.process.pid, flush=True)
time.sleep(600)
"""


def test_children_and_the_embedded_redis_die_with_a_sigkilled_launcher(tmp_path):
    from services.errors import Unavailable
    from services.redis_local import EmbeddedRedis

    data = tmp_path / "redis"
    script = LAUNCHER_LIKE.format(repo=REPO, data=str(data), log=str(tmp_path / "sleeper.log"))
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child, server = map(int, launcher.stdout.readline().split())
    try:
        assert alive(child) and alive(server)
        # While the server lives, a second one on its data folder is refused, the holder named.
        with pytest.raises(Unavailable, match=rf"in use by another server \(redis-server pid {server} started by "
                                              rf"pid {launcher.pid} "):
            EmbeddedRedis(data).start()
        launcher.kill()  # SIGKILL: no handler runs, no one stops the children
        launcher.wait()
        assert wait_gone(child, 10), "the child outlived its launcher"
        assert wait_gone(server, 10), "redis-server outlived its launcher"
        with EmbeddedRedis(data) as again:  # its lock went with it: the next run's server starts
            assert again.process.pid != server
    finally:
        for pid in (child, server):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_dead_servers_lock_held_by_its_forked_child_is_waited_for(tmp_path):
    """A killed redis-server's AOF-rewrite child keeps the data folder's lock (an inherited descriptor) for a
    moment: the restart waits for it rather than refusing; a live holder is refused at once (test above)."""
    from services.redis_local import DATA_LOCK, EmbeddedRedis

    gone = subprocess.Popen(["true"])
    gone.wait()
    data = tmp_path / "redis"
    data.mkdir()
    holder = (f"import fcntl, time\nlock = open({str(data / DATA_LOCK)!r}, 'a+')\nfcntl.flock(lock, fcntl.LOCK_EX)\n"
              f"lock.write('redis-server pid {gone.pid} started by pid 1 on host at now\\n'); lock.flush()\n"
              "print('held', flush=True)\ntime.sleep(1.5)\n")
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\n"
    started = time.monotonic()
    with EmbeddedRedis(data) as server:
        assert server.alive() and time.monotonic() - started >= 0.5
    child.wait()


def test_a_second_ctrl_c_while_stopping_kills_what_is_left_and_still_returns_the_signals_code(tmp_path, monkeypatch):
    """The launcher waits up to LEARNER_STOP_SECONDS for the learner's checkpoint; a user presses Ctrl-C again: the
    services must not be left running (nor a traceback instead of an exit code)."""
    import threading

    import cli.bootstrap
    import cli.launcher
    from cli.main import run_main

    made = []

    def children(*args, **kwargs):  # a learner deep in a step (it ignores SIGTERM) and a generator
        env = {**os.environ, "DAPO_GENERATOR__PORT": "1"}  # (for services.json)
        made.extend([Child("learner", ["bash", "-c", "trap '' TERM; sleep 60"], env, tmp_path / "learner.log",
                           stop_seconds=60),
                     Child("generator-0", ["sleep", "60"], env, tmp_path / "generator.log")])
        return made

    monkeypatch.setattr(cli.launcher, "service_children", children)
    monkeypatch.setattr(cli.bootstrap, "ensure_model", lambda settings: None)

    def ctrl_c_twice():
        deadline = time.monotonic() + 60
        while not (made and all(child.alive() for child in made)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_twice, daemon=True).start()
    began = time.monotonic()
    code = run_main(["run", "--no-display", "--set", f"run_dir={tmp_path / 'run'}",
                     "--set", "redis.url=redis://127.0.0.1:1/0"])
    assert code == 130 and time.monotonic() - began < 30
    assert not any(child.alive() for child in made)


def test_a_run_started_over_forgets_the_checkpoint_before_any_learner_starts(tmp_path, monkeypatch):
    """`resume: false`, then the learner crashes before its own start forgot `latest`: its restart (which resumes)
    must not go on from the run before's checkpoint."""
    import cli.bootstrap
    import cli.launcher
    from cli.main import run_main
    from learner.checkpoint import Checkpoints

    run_dir = tmp_path / "run"
    checkpoints = Checkpoints(run_dir)
    checkpoints.path(500).mkdir(parents=True)
    checkpoints.commit(500)
    (run_dir / "metrics.jsonl").write_text('{"step": 500, "groups_trained": 4}\n')
    seen = []

    def children(*args, **kwargs):
        # what a learner starting now would resume, and the progress its restarts are measured against
        seen.append((checkpoints.latest_step(), steps_recorded(run_dir / "metrics.jsonl")))
        env = {**os.environ, "DAPO_GENERATOR__PORT": "1"}
        return [Child("learner", ["true"], env, tmp_path / "learner.log"),
                Child("generator-0", ["sleep", "60"], env, tmp_path / "generator.log")]

    monkeypatch.setattr(cli.launcher, "service_children", children)
    monkeypatch.setattr(cli.bootstrap, "ensure_model", lambda settings: None)
    assert run_main(["run", "--no-display", "--set", f"run_dir={run_dir}", "--set", "redis.url=redis://127.0.0.1:1/0",
                     "--set", "learner.checkpoints.resume=false"]) == 0
    assert seen == [(None, 0)] and checkpoints.steps() == [500]  # (the folder stays: this run's first prunes it)


def test_a_run_whose_learner_is_given_up_exits_1_with_the_reason(tmp_path, monkeypatch, capsys):
    """A learner OOM-killed at every start, before a new step: `dapo run` exits 1 saying why, not 247 (the
    SIGKILL's -9) with "learner exited with code -9"."""
    import cli.bootstrap
    import cli.launcher
    from cli.main import run_main

    def children(*args, **kwargs):
        env = {**os.environ, "DAPO_GENERATOR__PORT": "1"}
        return [Child("learner", ["bash", "-c", "kill -9 $$"], env, tmp_path / "learner.log",
                      progress=lambda: 0),
                Child("generator-0", ["sleep", "60"], env, tmp_path / "generator.log")]

    monkeypatch.setattr(cli.launcher, "service_children", children)
    monkeypatch.setattr(cli.bootstrap, "ensure_model", lambda settings: None)
    assert run_main(["run", "--no-display", "--set", f"run_dir={tmp_path / 'run'}",
                     "--set", "redis.url=redis://127.0.0.1:1/0"]) == 1
    assert "the learner crashed 5 times in a row without a new step (last exit -9)" in " ".join(
        capsys.readouterr().out.split())


HUNG_UP = """
import os, sys
from pathlib import Path
sys.path.insert(0, os.getcwd())
import cli.bootstrap, cli.launcher
from cli.launcher import Child
from cli.main import run_main
tmp, run_dir = Path(sys.argv[1]), Path(sys.argv[1]) / "run"
run_dir.mkdir(parents=True)
(run_dir / "metrics.jsonl").write_text('{"step": 1, "groups_trained": 4}\\n')
env = {**os.environ, "DAPO_GENERATOR__PORT": "1"}  # (the service map names each one's port)
cli.launcher.service_children = lambda *args, **kwargs: [
    Child("learner", ["sleep", "60"], env, tmp / "learner.log", stop_seconds=2),
    Child("generator-0", ["sleep", "60"], env, tmp / "generator.log", stop_seconds=2)]
cli.bootstrap.ensure_model = lambda settings: None
code = run_main(["run", "--set", f"run_dir={run_dir}", "--set", "redis.url=redis://127.0.0.1:1/0"])
(tmp / "code").write_text(str(code))
"""


def test_a_run_whose_terminal_hangs_up_stops_in_order_and_writes_its_report(tmp_path):
    """ssh drops: SIGHUP stops the run as Ctrl-C does; the live display's write to the terminal that is gone raised
    EIO over the stop, which ended in a traceback with no report (exit 1, not 129)."""
    import pty

    script = tmp_path / "hung_up.py"
    script.write_text(HUNG_UP)
    pid, terminal = pty.fork()
    if pid == 0:  # the launcher, in a terminal of its own
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, str(script), str(tmp_path)])
    import select

    seen, deadline = b"", time.monotonic() + 60
    try:
        while b"logs in" not in seen:
            assert time.monotonic() < deadline and select.select([terminal], [], [], 5)[0], seen[-2000:]
            seen += os.read(terminal, 4096)
        time.sleep(1.0)
        os.close(terminal)  # the terminal goes away: SIGHUP to its session
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            assert time.monotonic() < deadline + 60, "the launcher did not stop"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert (tmp_path / "code").read_text() == str(128 + signal.SIGHUP)
    assert (tmp_path / "run" / "summary.json").is_file()


def test_a_second_ctrl_c_leaves_no_rank_of_the_learner_running(tmp_path):
    """`dapo run --learner-procs 2`: the first Ctrl-C SIGTERMs torchrun, which passes it on to ranks busy finishing
    their step; the second kills what is left. torchrun starts each rank in a session of its own, so killing
    torchrun's group left both ranks running, holding their GPUs, after `dapo run` had returned."""
    rank = tmp_path / "rank.sh"
    rank.write_text(f"trap '' TERM\necho $$ >> {tmp_path}/ranks\nsleep 120\n")  # busy: SIGTERM waits
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--no-python", "bash",
               str(rank)]
    learner = Child("learner", command, {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"},
                    tmp_path / "learner.log")
    learner.start()
    deadline = time.monotonic() + 60
    while len((tmp_path / "ranks").read_text().split() if (tmp_path / "ranks").exists() else []) < 2:
        assert time.monotonic() < deadline, (tmp_path / "learner.log").read_text()
        time.sleep(0.2)
    ranks = [int(pid) for pid in (tmp_path / "ranks").read_text().split()]
    try:
        learner.process.send_signal(signal.SIGTERM)  # the first Ctrl-C
        time.sleep(1.0)
        learner.kill_now()  # the second
        learner.process.wait(timeout=30)
        assert all(wait_gone(pid, 10) for pid in ranks)
    finally:  # (a failure leaves no rank ignoring SIGTERM behind)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        learner.kill_group()


RANK_FOLLOWING_TORCHRUN = """
import os, signal, sys, time
from pathlib import Path
from services.startup import die_with_launcher
signal.signal(signal.SIGTERM, lambda *_: (Path(sys.argv[1], f"stopped-{os.getpid()}").touch(), sys.exit(0)))
armed = die_with_launcher()  # what every learner rank does first
with open(Path(sys.argv[1], "ranks"), "a") as ranks:
    ranks.write(f"{os.getpid()} {armed}\\n")
time.sleep(120)
"""


def test_a_torchrun_killed_outright_takes_its_ranks_with_it(tmp_path):
    """torchrun SIGKILLed (kill -9, the OOM killer): its ranks, each in a session of its own, were left running,
    holding the run, its port and the GPUs, where neither `dapo run` nor `dapo ranks` looks. Each learner rank now
    gets SIGTERM (a stop in order: rank 0 finishes its step and checkpoints) when torchrun dies."""
    rank = tmp_path / "rank.py"
    rank.write_text(RANK_FOLLOWING_TORCHRUN)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--no-python",
                                 sys.executable, str(rank), str(tmp_path)], cwd=Path(__file__).parents[2],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(lines := (tmp_path / "ranks").read_text().splitlines() if (tmp_path / "ranks").exists() else []) < 2:
            assert time.monotonic() < deadline and torchrun.poll() is None
            time.sleep(0.2)
        ranks = [int(line.split()[0]) for line in lines]
        assert all(line.endswith("True") for line in lines)
        torchrun.kill()
        torchrun.wait(timeout=30)
        assert all(wait_gone(pid, 10) for pid in ranks)
        assert all((tmp_path / f"stopped-{pid}").exists() for pid in ranks)  # by the stop in order, not a kill
    finally:
        torchrun.kill()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_that_exits_while_redis_is_stalled_waits_for_it_and_is_not_given_up(tmp_path):
    """A redis-server stopped or stalled (SIGSTOP, a swap storm, a disk stall under its AOF) is alive, so it was not
    restarted, and every child it made exit was restarted at once, failed to reach it in seconds, and counted: the
    run was given up after about a minute and a half. A child that exits while Redis does not answer now waits for
    it, and starts again uncounted once it answers."""
    from services.redis_local import EmbeddedRedis

    done = tmp_path / "done"
    learner = Child("learner", [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(done)!r}): "
                                                      "time.sleep(0.1)"], dict(os.environ), tmp_path / "learner.log")
    back = tmp_path / "redis-back"
    worker = Child("generator-0", [sys.executable, "-c", f"import os, sys, time\nif not os.path.exists({str(back)!r}): "
                                                          "sys.exit(69)\ntime.sleep(600)"], dict(os.environ),
                   tmp_path / "generator.log")  # what a worker does that finds no Redis
    outcome: list = []
    with EmbeddedRedis(tmp_path / "redis") as server:
        learner.start()
        worker.start()
        server.process.send_signal(signal.SIGSTOP)
        try:
            supervisor = threading.Thread(target=lambda: outcome.append(
                supervise([learner, worker], tmp_path / "metrics.jsonl", total_steps=1, display=False,
                          redis_server=server)), daemon=True)
            supervisor.start()
            time.sleep(RESTART_LIMIT + 4.0)  # (each of its starts lasts a moment: given up by then, before)
            assert worker.waiting and not worker.gave_up and worker.restarts == 0 and not worker.alive()
        finally:
            back.touch()
            server.process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while worker.waiting:  # Redis answers: started again, uncounted
            assert time.monotonic() < deadline and supervisor.is_alive()
            time.sleep(0.1)
        done.touch()
        supervisor.join(timeout=30)
        assert worker.alive() and worker.restarts == 0 and not worker.gave_up
        worker.stop()
    assert outcome == [0]


@pytest.mark.parametrize("fault", ["keeps_dying", "cannot_start"])
def test_a_redis_server_that_cannot_come_back_ends_the_run_with_the_reason(tmp_path, fault):
    """Every other process is given up after RESTART_LIMIT crashes without a step; the embedded Redis was restarted
    every second for ever (OOM-killed at each AOF replay), and one whose restart raised (its AOF past repair, its
    disk full) ended `dapo run` in a traceback with no report."""
    learner = Child("learner", [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ),
                    tmp_path / "learner.log", stop_seconds=1)

    class Dying:
        data_dir = tmp_path / "redis"
        process = subprocess.CompletedProcess([], -9)
        starts = 0

        def alive(self):
            return False

        def answers(self):
            return False

        def start(self):
            self.starts += 1
            if fault == "cannot_start":
                raise RuntimeError("embedded redis-server did not start")

    learner.start()
    try:
        with pytest.raises(GaveUp, match="redis-server"):
            supervise([learner], tmp_path / "metrics.jsonl", total_steps=10, display=False, redis_server=Dying())
    finally:
        learner.stop()


def test_dapo_ranks_says_when_torchrun_would_not_give_the_ranks_their_stop_time(monkeypatch):
    """The 32B overlay gives a stop 10,000 s through $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which torchrun reads from torch
    2.12 on: an image with an older torch SIGKILLed the ranks 30 s after SIGTERM, with nothing said."""
    import dataclasses

    import torch.distributed.launcher.api as launcher_api

    from cli.ranks import shutdown_timeout_ignored

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "10000")
    assert shutdown_timeout_ignored() is None  # this torch reads it
    assert launcher_api.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 10000

    @dataclasses.dataclass
    class Older:  # a LaunchConfig from before torch 2.12
        min_nodes: int = 1

    monkeypatch.setattr(launcher_api, "LaunchConfig", Older)
    assert "ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in shutdown_timeout_ignored()
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert shutdown_timeout_ignored() is None
