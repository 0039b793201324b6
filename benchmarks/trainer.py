"""One learner update of the tiny default: how its seconds depend on how the batch is cut into forward passes.

    python -m benchmarks.trainer [--micro-batch-tokens 32768 4096 2048] [--rounds 3] [--write]

The batch is real: the tiny base model samples n = 16 responses (vLLM, the generator's engine) to training
problems, `reward.verify` scores them with the overlong shaping, and the first `prompts_per_step` informative
groups (dynamic sampling) make the batch, as a step of `dapo run` receives it. Each `micro_batch_tokens` value, with
whole rows (prompt + response) and with the shared prompt pass (`share_prompt_pass`: a group's prompt once, its
responses on the prompt's KV cache), gets its own Trainer of the tiny-cpu preset (4 mini-batches x 2 passes: 8
updates), on one CPU with one torch thread, as `dapo run` gives the learner on 2 cores. Rounds rotate which
setting goes first; the table holds the median over rounds. `computed / real` is the tokens the forward
passes compute (padded blocks) over the tokens of the prompt + response rows. Reported between the `trainer`
markers (with --write).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.runs import ROOT, replace_section

PRESET = "tiny-cpu"


def informative_batch(settings, count: int) -> list:
    """`count` informative scored groups sampled by the base model from the training problems, in data order."""
    from generator.engine import VllmEngine
    from learner.dapo import filter_values, is_informative
    from learner.service import PromptBuilder, TrainProblems, data_spec
    from reward.scoring import ScoreItem, shaped
    from reward.verify import verify
    from services.data import load_problems
    from services.messages import PromptTask, RolloutGroup, SamplingParams, ScoredGroup
    from services.models import model_dir

    s = settings.sampling
    params = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)
    problems = TrainProblems(load_problems(data_spec(settings.data.train, "train"), settings), settings.data.seed)
    engine = VllmEngine(model_dir(settings), settings)
    prompt_of = PromptBuilder(engine.tokenizer, settings)
    groups: list = []
    try:
        while len(groups) < count:
            wave = [problems.next() for _ in range(2 * count)]
            prompts = [prompt_of(p) for p in wave]
            for problem, (text, ids), samples in zip(wave, prompts, engine.generate([i for _, i in prompts], params)):
                task = PromptTask(prompt_id=problem.id, prompt=text, prompt_token_ids=ids, ground_truth=problem.answer,
                                  sampling=params)
                scores = [shaped(verify(x.text, problem.answer),
                                 ScoreItem(x.text, problem.answer, len(x.token_ids), s.max_tokens, x.finish_reason),
                                 settings.reward) for x in samples]
                values = filter_values([x.correct for x in scores], [x.reward for x in scores],
                                       settings.learner.batch.filter_metric)
                if is_informative(values) and len(groups) < count:
                    groups.append(ScoredGroup(rollout=RolloutGroup(task=task, policy_version=0, generator_id="bench",
                                                                   samples=samples), scores=scores))
    finally:
        engine.shutdown()
    return groups


def sampled_batch(settings, count: int) -> list:
    """`informative_batch` run in a child process: vLLM's CPU worker binds this process's OpenMP threads to the CPUs it
    saw and turns `torch.set_num_threads` into a no-op, so a trainer in the same process would update on 2 threads
    (the previous "one CPU" figures were measured that way: 1.47 s a step where one thread takes 2.1)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(informative_batch, settings, count).result()


def computed_tokens(trainer, groups) -> tuple[int, int]:
    """(tokens the forward passes of one pass over the batch compute, tokens of the prompt + response rows)."""
    batch = trainer.prepare(groups)
    computed = 0
    for mini_batch in trainer._mini_batches(batch):
        for micro in trainer.packer.plan(mini_batch, batch.responses):
            inputs = trainer.packer.collate(batch.responses, micro)
            computed += inputs.input_ids.numel() + (inputs.prompt.input_ids.numel() if inputs.prompt else 0)
    return computed, sum(r.length for r in batch.responses)


def measure(budgets: list[int], rounds: int) -> dict:
    import torch

    from learner.trainer import Trainer
    from services.config import load_settings
    from services.models import model_dir

    base = load_settings(PRESET, run_dir=str(ROOT / "runs" / "bench-trainer"))
    groups = sampled_batch(base, base.learner.batch.prompts_per_step)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the learner's one CPU under `dapo run` on 2 cores
    variants = [(budget, shared) for shared in (False, True) for budget in budgets]
    trainers = {}
    for budget, shared in variants:
        compute = base.learner.compute.model_copy(update={"micro_batch_tokens": budget, "share_prompt_pass": shared})
        learner = base.learner.model_copy(update={"compute": compute})
        trainers[budget, shared] = Trainer(base.model_copy(update={"learner": learner}), model_dir(base))
    torch.set_num_threads(1)  # after the Trainers: each sets threads from the CPUs it sees (or OMP_NUM_THREADS)
    for trainer in trainers.values():
        trainer.train_step(groups)  # warm-up: allocator, first-call overheads
    timings: dict[tuple, list[dict]] = {variant: [] for variant in variants}
    for r in range(rounds):
        for variant in variants[r % len(variants):] + variants[: r % len(variants)]:
            started = time.perf_counter()
            out = trainers[variant].train_step(groups)
            timings[variant].append({"seconds": time.perf_counter() - started, "forward": out["forward_seconds"],
                                     "backward": out["backward_seconds"], "optimizer": out["optimizer_seconds"]})
            print(f"round {r} {variant}: {timings[variant][-1]}", flush=True)
    rows = []
    for budget, shared in variants:
        computed, real = computed_tokens(trainers[budget, shared], groups)
        median = {key: statistics.median(t[key] for t in timings[budget, shared]) for key in timings[budget, shared][0]}
        rows.append({"micro_batch_tokens": budget, "share_prompt_pass": shared, **median, "computed": computed,
                     "real": real})
    samples = sum(len(g.rollout.samples) for g in groups)
    tokens = sum(len(x.token_ids) for g in groups for x in g.rollout.samples)
    return {"rows": rows, "groups": len(groups), "samples": samples, "response_tokens": tokens,
            "prompt_tokens": statistics.mean(len(g.rollout.task.prompt_token_ids) for g in groups),
            "default": [base.learner.compute.micro_batch_tokens, base.learner.compute.share_prompt_pass],
            "load": os.getloadavg()[0]}


def report(result: dict, command: str) -> str:
    rows = result["rows"]
    slowest = max(r["seconds"] for r in rows)
    budget, shared = result["default"]
    lines = [
        f"`{command}`", "",
        f"One step of the tiny-cpu preset on {result['groups']} informative groups ({result['samples']} responses, "
        f"{result['response_tokens'] / result['samples']:.1f} response tokens on average after a "
        f"{result['prompt_tokens']:.0f}-token prompt), sampled by the base model; one CPU, one torch thread; median of "
        f"the rounds (load average {result['load']:.1f} at the end). In bold, the preset's setting.", "",
        "| micro_batch_tokens | prompt | step s | forward s | backward s | optimizer s | computed / real tokens | "
        "speed vs slowest |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mark = "**" if [r["micro_batch_tokens"], r["share_prompt_pass"]] == [budget, shared] else ""
        lines.append(
            f"| {mark}{r['micro_batch_tokens']:,}{mark} "
            f"| {'shared pass' if r['share_prompt_pass'] else 'in every row'} "
            f"| {r['seconds']:.2f} | {r['forward']:.2f} | {r['backward']:.2f} | {r['optimizer']:.3f} "
            f"| {r['computed'] / r['real']:.2f} | {slowest / r['seconds']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[32768, 4096, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the report into benchmarks/README.md")
    args = parser.parse_args()
    result = measure(args.micro_batch_tokens, args.rounds)
    command = ("python -m benchmarks.trainer --micro-batch-tokens "
               f"{' '.join(map(str, args.micro_batch_tokens))} --rounds {args.rounds}")
    body = report(result, command)
    print(body)
    if args.write:
        (ROOT / "benchmarks" / "results" / "trainer.json").write_text(json.dumps(result, indent=1))
        replace_section(ROOT / "benchmarks" / "README.md", "trainer", body)


if __name__ == "__main__":
    main()
