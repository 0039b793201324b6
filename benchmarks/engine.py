"""vLLM engine settings on one rollout step of the tiny default: KV block size x where the engine runs, side by side.

    python -m benchmarks.engine [--prompts 48] [--rounds 5] [--cpu 1] [--write]

A setting is `generator.block_size` (vLLM's CPU default 128, or 32) x `generator.in_process_engine` (vLLM's engine
core and model in processes of their own, or in the generator's). Each setting runs in a process of its own (vLLM
reads the in-process switch from the environment at start), all pinned to the same CPU (`--cpu`: the generator's
share of 2 cores), all started first; then every round times each of them in turn on the same fresh prompts, in
an order that rotates, so the machine's drift hits every setting alike. The work is one rollout step's worth:
`--prompts` synthetic prompts x the preset's n samples of at most max_tokens, through the project's
VllmEngine.generate (submit, step, decode: the generator's path without Redis), after a reset of the prefix cache
(as after every weight reload). Reported: seconds and tokens/s per setting (median of rounds) and the speed-up over
vLLM's defaults, into benchmarks/README.md between the `engine` markers (`--write`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = [(128, False), (32, False), (128, True), (32, True)]  # (block_size, in_process_engine); first: vLLM's
MARK = "@engine@ "  # a worker's answers, among vLLM's own lines on its stdout


def answer(proc: subprocess.Popen) -> str | None:
    """The worker's next answer (None: it exited)."""
    while line := proc.stdout.readline():
        if line.startswith(MARK):
            return line[len(MARK):].strip()
    return None


def label(block_size: int, in_process: bool) -> str:
    return f"block {block_size}, engine {'in process' if in_process else 'own processes'}"


def worker(block_size: int, in_process: bool, prompts: int, rounds: int) -> None:
    """Start one engine, say `ready`, then answer each round number read on stdin with that round's timing."""
    from benchmarks.generator import prompt_ids
    from cli.bootstrap import ensure_model
    from generator.engine import VllmEngine
    from services.config import load_settings
    from services.messages import SamplingParams

    settings = load_settings("tiny-cpu", run_dir=tempfile.mkdtemp(prefix="dapo-engine-"),
                             generator={"block_size": block_size, "in_process_engine": in_process})
    engine = VllmEngine(ensure_model(settings), settings)
    sampling = SamplingParams(n=settings.sampling.n, temperature=1.0, top_p=1.0,
                              max_tokens=settings.sampling.max_tokens)
    work = prompt_ids(settings, engine.tokenizer, prompts * (rounds + 1))
    engine.generate(work[-prompts:], sampling)  # warm-up, on prompts no round uses
    print(f"{MARK}ready", flush=True)
    for line in sys.stdin:
        r = int(line)
        engine.llm.reset_prefix_cache()
        started = time.perf_counter()
        groups = engine.generate(work[r * prompts:(r + 1) * prompts], sampling)
        seconds = time.perf_counter() - started
        tokens = sum(len(s.token_ids) for samples in groups for s in samples)
        print(MARK + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


def report(results: dict[str, list[dict]], command: str, prompts: int, n: int) -> str:
    base = statistics.median(r["seconds"] for r in results[label(*SETTINGS[0])])
    lines = [f"`{command}`", "",
             f"One rollout step's worth of generation ({prompts} prompts x n = {n}), every setting on one CPU, "
             "medians of the rounds:", "",
             "| setting | seconds | tokens/s | speed-up over vLLM's defaults | seconds per round |",
             "| --- | ---: | ---: | ---: | --- |"]
    for setting in SETTINGS:
        rows = results[label(*setting)]
        seconds = statistics.median(r["seconds"] for r in rows)
        rate = statistics.median(r["tokens"] / r["seconds"] for r in rows)
        lines.append(f"| {label(*setting)} | {seconds:.2f} | {rate:,.0f} | {base / seconds:.2f}x | "
                     + ", ".join(f"{r['seconds']:.2f}" for r in rows) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("worker", help="one engine (used by the comparison)")
    one.add_argument("--block-size", type=int, required=True)
    one.add_argument("--in-process", action="store_true")
    for p in (parser, one):
        p.add_argument("--prompts", type=int, default=48, help="prompts per round (a step's push is about 47)")
        p.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu", type=int, default=1, help="the CPU every engine is pinned to")
    parser.add_argument("--write", action="store_true", help="put the report into benchmarks/README.md")
    args = parser.parse_args()
    if args.command == "worker":
        worker(args.block_size, args.in_process, args.prompts, args.rounds)
        return

    from benchmarks.runs import ROOT, replace_section
    from services.config import load_settings

    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": str(args.cpu)}
    workers = {}
    for block_size, in_process in SETTINGS:
        cmd = ["taskset", "-c", str(args.cpu), sys.executable, "-m", "benchmarks.engine", "worker",
               "--block-size", str(block_size), "--prompts", str(args.prompts), "--rounds", str(args.rounds)]
        proc = subprocess.Popen(cmd + (["--in-process"] if in_process else []), cwd=ROOT, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if answer(proc) != "ready":
            raise SystemExit(f"{label(block_size, in_process)}: the engine did not start (exit {proc.returncode})")
        workers[label(block_size, in_process)] = proc
        print(f"{label(block_size, in_process)}: ready", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in workers}
    names = list(workers)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            workers[name].stdin.write(f"{r}\n")
            workers[name].stdin.flush()
            results[name].append(json.loads(answer(workers[name]) or "null"))
            print(f"round {r} {name}: {results[name][-1]['seconds']:.2f} s", flush=True)
    for proc in workers.values():
        proc.stdin.close()
        proc.wait(timeout=120)
    command = f"python -m benchmarks.engine --prompts {args.prompts} --rounds {args.rounds} --cpu {args.cpu}"
    body = report(results, command, args.prompts, load_settings("tiny-cpu").sampling.n)
    if args.write:
        replace_section(ROOT / "benchmarks" / "README.md", "engine", body)
    print(body)


if __name__ == "__main__":
    main()
