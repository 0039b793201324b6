"""The `dapo` command line: one entry point per service, the bootstrap and the local one-command run.

The command line is the composition root: it is the one place that names every service package, and it
imports each lazily so that `dapo reward` never loads torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import socket
import sys
from importlib.metadata import version

from services.config import ConfigError, load_settings
from services.data import DataError
from services.errors import ExitCode, Unavailable
from services.startup import Stopped, hide_from_same_user, raise_on_signals, record_exit

TRACKERS = ("wandb", "tensorboard", "mlflow")  # learner.report_to (accelerate's tracker names)
# command -> (module, function, help). Each function takes the loaded Settings.
COMMANDS = {
    "run": ("cli.launcher", "main", "run the whole system locally (embedded Redis, all services)"),
    "bootstrap": ("cli.bootstrap", "main", "find the embedded tiny model (shipped, or built and cached)"),
    "learner": ("learner.service", "main", "run the learner service"),
    "generator": ("generator.service", "main", "run a generator service (vLLM)"),
    "reward": ("reward.service", "main", "run a reward worker service"),
    "keys": ("cli.keys", "main", "make or rotate the role keys and Redis users of a deployment (cli/keys.py)"),
    "report": ("cli.report", "main", "write a run folder's plots and summary.json from its metrics.jsonl (what `dapo "
                                     "run` writes at its end), for a run launched otherwise or still going"),
    "plan": ("learner.plan", "main", "whether a preset's learner step fits N GPUs, by running it on fake tensors "
                                     "(no GPU, no weights); its time and cost (learner/plan.py)"),
}
# The commands whose processes hold secrets for as long as a run lasts (`ranks` runs the learner's launcher).
SERVICES = ("run", "learner", "generator", "reward", "ranks")


def positive(text: str) -> int:
    """A count of processes: 1 or more (with none of a kind a run can never train, and nothing would say so)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapo", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('dapo-services')}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, _, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument(
            "--config", "-c", default=None,
            help="preset name (services/configs/) or a YAML path (default: $DAPO_CONFIG or tiny-cpu)",
        )
        cmd.add_argument(
            "--set", "-s", action="append", default=[], metavar="KEY=VALUE",
            help="override a field, e.g. learner.total_steps=20 (repeatable; YAML value syntax)",
        )
        if name in ("generator", "reward"):
            cmd.add_argument("--worker-id", default=None,
                             help="this worker's name in the streams, metrics and logs (default: $DAPO_WORKER_ID, "
                                  "else kind-host-pid); on the command line, what `ps` shows")
        if name == "bootstrap":
            cmd.add_argument("--force", action="store_true", help="rebuild even if a cached model exists")
            cmd.add_argument("--measure", action="store_true", help="then measure tokens/s and accuracy through vLLM")
        if name == "keys":
            cmd.add_argument("action", choices=["init", "rotate", "retire", "redis-users", "compose", "compose-env"])
            cmd.add_argument("name", nargs="?", help="rotate: the role; retire: the key id")
            cmd.add_argument("--dir", default=None, help="the key folder (default keys.dir, run_dir/keys)")
            cmd.add_argument("--run", default=None,
                             help="redis-users, compose: the run whose keys the Redis users reach (default $DAPO_RUN, "
                                  "else $DAPO_REDIS__RUN, else `default`: the run of docker-compose.yml and of the "
                                  "Kubernetes overlays)")
        if name == "plan":  # (learner.plan imports torch: its names are not imported here)
            cmd.add_argument("preset", nargs="?", help="the preset to plan (as --config)")
            cmd.add_argument("--gpus", type=int, required=True, help="GPUs of the whole run (learner and generators)")
            cmd.add_argument("--gpu", default="h100",
                             help="the card: h100 (default), h200, a100, a100-40gb, l40s, b200")
            cmd.add_argument("--learner-gpus", type=int, default=None,
                             help="of them, the learner's ranks (default: half, as the shipped overlays split them)")
            cmd.add_argument("--mfu", type=float, default=0.41,
                             help="the learner's model FLOPs utilisation for the time estimate (0.41: measured, 1.5B "
                                  "on one H200)")
            cmd.add_argument("--tokens-per-gpu-s", type=float, default=None,
                             help="generated tokens per second per generator GPU (default: 40,000 / billions of "
                                  "parameters)")
        if name in ("run", "learner"):
            cmd.add_argument("--report-to", nargs="+", choices=TRACKERS, metavar="TRACKER",
                             help=f"also log to experiment trackers: {', '.join(TRACKERS)} (learner.report_to)")
        if name == "run":
            cmd.add_argument("--generators", type=positive, default=1, help="generator processes")
            cmd.add_argument("--reward-workers", type=positive, default=1, help="reward worker processes")
            cmd.add_argument("--learner-procs", type=positive, default=1,
                             help="learner ranks under accelerate launch (gloo on CPU, one per GPU on GPUs)")
            cmd.add_argument("--no-display", action="store_true", help="plain log lines instead of the live view")
    ranks = sub.add_parser("ranks", help="run a multi-rank learner command (accelerate launch) and exit with the code "
                                         "its rank 0 chose, not torchrun's 1 (for containers; cli/ranks.py)")
    ranks.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                       help="e.g. -- accelerate launch --num_processes=2 -m cli learner")
    return parser


def parse_overrides(pairs: list[str]) -> dict:
    import yaml

    overrides: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        node = overrides
        *parents, leaf = key.strip().split(".")
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parents[:depth + 1])} is already set to a value")
        if isinstance(node.get(leaf), dict):
            raise ConfigError(f"--set {key}: keys under {key} are already set")
        try:
            node[leaf] = yaml.safe_load(value)
        except yaml.YAMLError as err:  # e.g. `*+` (a YAML alias) or `{problem} ...` (a mapping): quote the value
            raise ConfigError(f"--set {key}: the value {value!r} is not valid YAML (quote it: {key}='\"...\"'): "
                              f"{str(err).splitlines()[0]}") from None
    return overrides


def log_to_folder(command: str) -> None:
    """With DAPO_LOG_DIR set, the process's log lines also go to DAPO_LOG_DIR/{command}-{host}.log, appended: a
    container's own log goes with the container (`docker compose down`), a file on its volume stays."""
    folder = os.environ.get("DAPO_LOG_DIR")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    handler = logging.FileHandler(os.path.join(folder, f"{command}-{socket.gethostname()}.log"))
    handler.setFormatter(logging.getLogger().handlers[0].formatter)
    logging.getLogger().addHandler(handler)


def settings_from_args(args: argparse.Namespace):
    """--config, then --set, then flags that name a field; a tracker that is not installed, or a service bound to
    a reachable address with the default token, fails here, before any service starts, with one line."""
    from learner.tracking import check_installed
    from services.http import check_tokens

    overrides = parse_overrides(args.set)
    if getattr(args, "report_to", None):
        overrides.setdefault("learner", {})["report_to"] = args.report_to
    settings = load_settings(getattr(args, "preset", None) or args.config, origin="--set", **overrides)
    if args.command in ("run", "learner"):
        check_installed(settings.learner.report_to)
    if args.command in ("learner", "generator", "reward"):
        check_tokens(settings, getattr(settings, args.command).host)
    return settings


def main(argv: list[str] | None = None) -> int:
    """`dapo`: the exit code, also recorded for a supervisor that cannot see it (services/startup.py)."""
    code = run_main(argv)
    record_exit(code)
    return code


def run_main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plan":  # fake tensors on the host: a visible GPU would take the inputs (learner/plan.py)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.command in SERVICES:
        hide_from_same_user()  # its environment and memory hold secrets: no process of its user may read them
    if getattr(args, "worker_id", None):
        os.environ["DAPO_WORKER_ID"] = args.worker_id  # read by services.streams.worker_id
    if args.command == "ranks":  # no settings of its own: the learner it runs reads them
        from cli.ranks import run_ranks

        return run_ranks(args.argv)
    given = os.environ.get("DAPO_LOG_LEVEL", "INFO")
    level = given.upper()
    if not isinstance(logging.getLevelName(level), int):
        print(f"dapo: DAPO_LOG_LEVEL={given!r} is not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL)",
              file=sys.stderr)
        return ExitCode.USAGE
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s",
    )
    log_to_folder(args.command)
    try:
        settings = settings_from_args(args)
    except ConfigError as err:  # learner.tracking.TrackerNotInstalled and services.http.check_token too
        print(f"dapo: {err}", file=sys.stderr)
        return 2
    raise_on_signals()
    try:
        return run_command(args, settings)
    except Unavailable as err:
        print(f"dapo {args.command}: {' '.join(str(err).split())}", file=sys.stderr)  # one line
        return ExitCode.UNAVAILABLE
    except ConfigError as err:  # settings that this command cannot use (learner.plan.PlanError)
        print(f"dapo {args.command}: {err}", file=sys.stderr)
        return ExitCode.USAGE
    except DataError as err:  # a data file that cannot be used: its name and line, not a traceback
        print(f"dapo {args.command}: {err}", file=sys.stderr)
        return ExitCode.DATA_ERROR
    except Stopped as stop:
        print(f"dapo {args.command}: stopped by {stop}", file=sys.stderr)
        return 128 + stop.signum


def run_command(args: argparse.Namespace, settings) -> int:
    module, function, _ = COMMANDS[args.command]
    entry = getattr(importlib.import_module(module), function)
    if args.command == "run":
        return entry(settings, generators=args.generators, reward_workers=args.reward_workers,
                     learner_procs=args.learner_procs, display=not args.no_display) or 0
    if args.command == "bootstrap":
        return entry(settings, force=args.force, measure=args.measure) or 0
    if args.command == "keys":
        return entry(settings, args.action, args.name, args.dir, args.run)
    if args.command == "plan":
        return entry(settings, args.gpus, args.gpu, args.learner_gpus, args.mfu, args.tokens_per_gpu_s,
                     name=args.preset or args.config or "")
    return entry(settings) or 0
