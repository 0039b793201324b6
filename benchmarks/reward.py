"""Verifications per second: the reward worker (2 verifier processes) vs direct math-verify calls, same inputs.

Inputs: responses built from the shared data sets with a known right verdict each (`label`):
  - DAPO-Math-17k problems (integer answers) ending in the answer written the ways models write it (plain,
    bold label, boxed, two boxes, zero-padded, thousands separators, trailing period, Unicode minus, units),
    and the failure modes (a wrong answer, a hedge, a response truncated mid-derivation);
  - MATH-500 reference solutions against their own LaTeX answers (right) and against another problem's (wrong).

Paths, side by side in one run on the same inputs:
  math-verify x1   `math_verify.verify(parse("$truth$"), parse(response))` in this process (its signal timeouts on)
  math-verify x2   the same in a 2-process multiprocessing.Pool (the fair 2-core baseline)
  ours x1          `reward.verify` in this process (pure, no sandbox)
  pool x2          `VerifierPool(workers=2).verify_many` (sandboxed: time and memory limits, IPC per item)
  worker x2        the whole reward worker: groups of 16 read from the rollouts stream of an embedded Redis,
                   verified in the pool, shaped, written to the scored stream and acked
Pool overhead: the same trivial items (`Answer: 1`) in-process vs through the pool, per item.
Accuracy: agreement with the label per input category, for ours and for math-verify.

Usage: python benchmarks/reward.py [--items 2048] [--json out.json]   (items are rounded to groups of 16)
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This script is named like the `reward` package it measures: keep its own folder off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

DATA = Path(os.environ.get("DAPO_SHARED_DATA", "/work/shared/data"))
GROUP = 16


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def build_groups(n_groups: int, seed: int = 0) -> list[tuple[str, list[tuple[str, bool, str]]]]:
    """Rollout-like groups: (ground truth, 16 x (response, right verdict, category)), one problem per group."""
    rng = random.Random(seed)
    dapo = [r for r in _rows("dapo_math_17k.jsonl") if "duplicate_of" not in r]
    math500 = _rows("math500.jsonl")
    groups = []
    for _ in range(n_groups):
        if rng.random() < 0.2:  # MATH-500: LaTeX answers, decided by math-verify
            row = rng.choice(math500)
            samples = []
            for _ in range(GROUP):
                other = rng.choice(math500)
                if rng.random() < 0.5 or other["answer"].replace(" ", "") == row["answer"].replace(" ", ""):
                    samples.append((row["solution"], True, "math500-own-solution"))
                else:
                    samples.append((other["solution"], False, "math500-other-solution"))
            groups.append((row["answer"], samples))
            continue
        row = rng.choice(dapo)
        a = int(row["answer"])
        text = f"We need to solve the problem.\n\n{row['problem']}\n\nLet me work through it step by step."
        samples = []
        for _ in range(GROUP):
            w = a + rng.choice([-2, -1, 1, 3, 10])
            options = [
                ("plain", f"{text}\n\nAnswer: {a}", True),
                ("plain-wrong", f"{text}\n\nAnswer: {w}", False),
                ("bold-label", f"{text}\n\n**Answer:** {a}", True),
                ("boxed", f"{text}\n\nTherefore the answer is $\\boxed{{{a}}}$.", True),
                ("two-boxes", f"{text}\n\nFirst guess $\\boxed{{{w}}}$. Checking again: $\\boxed{{{a}}}$.", True),
                ("period", f"{text}\n\nAnswer: {a}.", True),
                ("units", f"{text}\n\nAnswer: {a} units", True),
                ("hedged", f"{text}\n\nAnswer: {a} or {w}", False),
                ("truncated", f"{text}\n\nSo far the total is {a} and then we", False),
            ]
            if 0 <= a < 100:
                options.append(("zero-padded", f"{text}\n\nAnswer: {a:03d}", True))
            if abs(a) >= 1000:
                options.append(("thousands", f"{text}\n\nAnswer: {a:,}", True))
            if a < 0:
                options.append(("unicode-minus", f"{text}\n\nAnswer: \u2212{-a}", True))
            category, response, label = rng.choice(options)
            samples.append((response, label, category))
        groups.append((row["answer"], samples))
    # Distinct texts, as sampled responses are (so no path gains from caching a repeated string).
    return [(truth, [(f"Response {k}.\n{text}", label, category) for k, (text, label, category) in enumerate(samples)])
            for truth, samples in groups]


# ---- math-verify, called directly -------------------------------------------------------------------------


def math_verify_direct(pair: tuple[str, str]) -> bool:
    from math_verify import parse, verify

    response, truth = pair
    return bool(verify(parse(f"${truth}$"), parse(response)))


def _quiet() -> None:
    logging.disable(logging.WARNING)


# ---- ours -------------------------------------------------------------------------------------------------


def run_worker(pool, groups, workers: int) -> float:
    """The groups through the real stream worker; returns the seconds to drain them (produce not timed)."""

    from reward.scoring import Scorer
    from reward.worker import RewardWorker
    from services.config import load_settings
    from services.keys import ROLES, create_keys, keys_dir
    from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, to_wire
    from services.redis_local import EmbeddedRedis, client_for
    from services.streams import ISSUED, Streams

    with tempfile.TemporaryDirectory(prefix="dapo-bench-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        settings = load_settings(
            "tiny-cpu",
            run_dir=str(Path(tmp) / "run"),
            redis={"url": server.url, "run": "bench"},
            reward={"workers": workers},
            streams={"high_water": 100_000},
        )
        create_keys(keys_dir(settings))  # this process writes as every role
        streams = Streams(client_for(server.url), settings, signs_as=ROLES)
        rollouts = streams.stream("rollouts", RolloutGroup)
        for index, (truth, samples) in enumerate(groups):
            task = PromptTask(task_id=f"g{index}", prompt_id="p", prompt="q", ground_truth=truth,
                              sampling=SamplingParams(n=GROUP, max_tokens=4096))
            streams.redis.hset(streams.key(ISSUED), task.task_id, to_wire(task))  # as the learner issues it
            rollouts.produce(RolloutGroup(
                task=task.for_generators(), policy_version=0, generator_id="bench",
                samples=[Sample(token_ids=list(range(512)), logprobs=[-0.5] * 512, text=response,
                                finish_reason="stop") for response, _, _ in samples],
            ))
        worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="bench")
        worker.run_once(block_ms=10)  # the first call only recovers this consumer's old entries (none)
        start = time.perf_counter()
        done = 0
        while done < len(groups):
            done += worker.run_once(block_ms=100)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path (the median is reported)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    _quiet()

    from reward.sandbox import VerifierPool

    groups = build_groups(max(1, args.items // GROUP))
    cases = [(response, truth, label, category) for truth, samples in groups for response, label, category in samples]
    pairs = [(r, t) for r, t, _, _ in cases]
    labels = [label for _, _, label, _ in cases]
    categories = [c for _, _, _, c in cases]
    load = os.getloadavg()[0]
    results: dict = {"items": len(cases), "cpus": os.cpu_count(), "loadavg_1m_at_start": round(load, 2)}

    warm_groups = build_groups(4, seed=1)
    warm = [(r, t) for t, samples in warm_groups for r, _, _ in samples]
    trivial = [("Answer: 1", "1")] * 2000
    repeats = args.repeats
    from reward import verify

    with multiprocessing.get_context("spawn").Pool(args.workers, initializer=_quiet) as mp_pool, \
            VerifierPool(workers=args.workers, timeout_s=5.0, memory_mb=1024) as pool:
        [math_verify_direct(p) for p in warm]
        mp_pool.map(math_verify_direct, warm)
        [verify(r, t) for r, t in warm]
        pool.verify_many(warm)
        outputs: dict = {}

        def clock(name: str, fn) -> float:
            start = time.perf_counter()
            outputs[name] = fn()
            return time.perf_counter() - start

        # Round robin over the paths, so that each sees the same share of whatever else loads the machine.
        times: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(repeats):
            times["mv1"].append(clock("mv1", lambda: [math_verify_direct(p) for p in pairs]))
            times["mv2"].append(clock("mv2", lambda: mp_pool.map(math_verify_direct, pairs, chunksize=16)))
            times["ours1"].append(clock("ours1", lambda: [verify(r, t) for r, t in pairs]))
            times["pool"].append(clock("pool", lambda: pool.verify_many(pairs)))
            times["worker"].append(run_worker(pool, groups, args.workers))
            times["trivial_inline"].append(clock("ti", lambda: [verify(r, t) for r, t in trivial]))
            times["trivial_pool"].append(clock("tp", lambda: pool.verify_many(trivial)))
    med = {name: statistics.median(values) for name, values in times.items()}
    mv1_s, mv2_s, ours1_s, pool_s, worker_s = med["mv1"], med["mv2"], med["ours1"], med["pool"], med["worker"]
    trivial_inline_s, trivial_pool_s = med["trivial_inline"], med["trivial_pool"]
    mv_verdicts, our_verdicts, pool_verdicts = outputs["mv1"], outputs["ours1"], outputs["pool"]
    worker_n = len(groups) * GROUP
    timeouts = sum(v.rule == "timeout" for v in pool_verdicts)
    assert [v.correct for v in pool_verdicts] == [v.correct for v in our_verdicts] or timeouts, "pool != inline"

    n = len(cases)
    rates = {
        "math-verify x1 (direct)": n / mv1_s,
        f"math-verify x{args.workers} (multiprocessing.Pool)": n / mv2_s,
        "ours x1 (reward.verify, no sandbox)": n / ours1_s,
        f"ours x{args.workers} (VerifierPool, sandboxed)": n / pool_s,
        f"ours x{args.workers} (reward worker: Redis in, Redis out)": worker_n / worker_s,
    }
    results["verifications_per_second"] = {k: round(v, 1) for k, v in rates.items()}
    worker_rate = worker_n / worker_s
    results["worker_vs_math_verify_x1"] = round(worker_rate / rates["math-verify x1 (direct)"], 2)
    results["worker_vs_math_verify_x2"] = round(worker_rate / (n / mv2_s), 2)
    per_item_inline = trivial_inline_s / len(trivial) * 1e6
    per_item_pool = trivial_pool_s / len(trivial) * 1e6
    results["pool_overhead_us_per_item"] = {
        "trivial item in-process": round(per_item_inline, 1),
        f"trivial item through the pool (x{args.workers})": round(per_item_pool, 1),
    }
    results["pool_timeouts"] = timeouts

    # Accuracy against the labels, per category.
    by_cat: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for category, label, ours, mv in zip(categories, labels, our_verdicts, mv_verdicts):
        row = by_cat[category]
        row[0] += 1
        row[1] += ours.correct == label
        row[2] += mv == label
    results["accuracy"] = {c: {"n": r[0], "ours": round(r[1] / r[0], 3), "math_verify": round(r[2] / r[0], 3)}
                           for c, r in sorted(by_cat.items())}
    results["accuracy_overall"] = {
        "ours": round(sum(o.correct == label for o, label in zip(our_verdicts, labels)) / n, 4),
        "math_verify": round(sum(m == label for m, label in zip(mv_verdicts, labels)) / n, 4),
    }
    results["rules"] = dict(collections.Counter(v.rule for v in our_verdicts))
    results["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)

    print(f"{n} inputs, median of {repeats} runs, {os.cpu_count()} CPUs, load average {load:.1f} at start, "
          f"{results['loadavg_1m_at_end']:.1f} at end\n")
    print("| path | verifications/s |\n| --- | ---: |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} |")
    print(f"\nworker / math-verify x1: {results['worker_vs_math_verify_x1']}x; "
          f"worker / math-verify x{args.workers}: {results['worker_vs_math_verify_x2']}x")
    print(f"pool overhead: {per_item_pool:.0f} us per trivial item through the pool vs "
          f"{per_item_inline:.0f} us in-process")
    print("\n| inputs | n | ours right | math-verify right |\n| --- | ---: | ---: | ---: |")
    for category, row in results["accuracy"].items():
        print(f"| {category} | {row['n']} | {row['ours']:.1%} | {row['math_verify']:.1%} |")
    overall = results["accuracy_overall"]
    print(f"| all | {n} | {overall['ours']:.1%} | {overall['math_verify']:.1%} |")
    print(f"\nrules that decided (ours): {results['rules']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
