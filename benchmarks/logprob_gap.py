"""How far apart are the behaviour logprobs mu (vLLM) and the learner's pi, token by token?

    python -m benchmarks.logprob_gap --run runs/bench-learning/learning-seed2 --pairs 60:60 59:60 [--prompts 256]

For each pair `s:l`, vLLM samples n = 16 responses to `--prompts` training problems with the weights a run
published as version s (its `weights/v<s>` folder), and the learner recomputes the logprob of every sampled token
with the weights of version l. Same version on both sides: the gap is the two implementations' numerics (the
truncated IS weight should be 1). One version apart: it is what one training step moved, the off-policy gap that
approx_kl averages (k3 of KL(mu || pi)) and that the TIS cap and the clip bound. The learner's approx_kl spikes
are read against this: k3 grows like the ratio pi / mu itself, so a few tokens in the tail decide the mean.
Reported into benchmarks/README.md between the `logprob-gap` markers (with --write) and printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.runs import ROOT, replace_section
from services.config import load_settings
from services.data import load_problems
from services.messages import PromptTask, RolloutGroup, SamplingParams, Score, ScoredGroup
from services.models import model_dir


def gap_summary(log_pi: torch.Tensor, log_mu: torch.Tensor) -> dict[str, float]:
    """Statistics of d = log pi - log mu over tokens: the tails (either direction) and the k3 mean."""
    gap = (log_pi - log_mu).double()
    k3 = torch.exp(gap) - 1.0 - gap
    return {
        "tokens": gap.numel(),
        "max_rise": float(gap.max()),  # pi above mu: what lifts k3 (it grows like e^d)
        "max_fall": float(-gap.min()),
        "q999_abs": float(gap.abs().quantile(0.999)),
        "over_1_nat": float((gap.abs() > 1.0).double().mean()),
        "k3_mean": float(k3.mean()),
        "k3_top10_share": float(k3.topk(min(10, k3.numel())).values.sum() / k3.sum()) if k3.sum() > 0 else 0.0,
        "lowest_mu": float(log_mu.min()),
    }


def measure(run: Path, pairs: list[tuple[int, int]], prompts: int) -> list[dict]:
    from safetensors.torch import load_file

    from generator.engine import VllmEngine
    from learner.service import PromptBuilder, data_spec
    from learner.trainer import Trainer

    settings = load_settings(str(run / "config.yaml"), run_dir=str(ROOT / "runs" / "bench-logprob-gap"))
    folder = model_dir(settings)
    weights = {v: run / "weights" / f"v{v}" for pair in pairs for v in pair}
    engine = VllmEngine(folder, settings)
    prompt_of = PromptBuilder(engine.tokenizer, settings)  # the learner's own prompt text and ids
    prompt_ids = [prompt_of(p)[1] for p in load_problems(data_spec(settings.data.train, "train"), settings)[:prompts]]
    params = SamplingParams(n=16, temperature=settings.sampling.temperature, top_p=settings.sampling.top_p,
                            max_tokens=settings.sampling.max_tokens, seed=11)
    trainer = Trainer(settings, folder)
    results = []
    try:
        for sampled_by, learner_version in pairs:
            engine.reload(weights[sampled_by])
            groups = engine.generate(prompt_ids, params)
            state = {}
            for shard in sorted(weights[learner_version].glob("*.safetensors")):
                state.update(load_file(str(shard)))
            trainer.model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
            scored = [
                ScoredGroup(
                    rollout=RolloutGroup(task=PromptTask(task_id=f"t{i}", prompt_id="p", prompt="",
                                                         prompt_token_ids=ids, ground_truth="0", sampling=params),
                                         policy_version=sampled_by, generator_id="bench", samples=samples),
                    scores=[Score(reward=0.0, correct=False, overlong=False, rule="none") for _ in samples],
                )
                for i, (ids, samples) in enumerate(zip(prompt_ids, groups))
            ]
            learner = trainer.logprobs(scored)
            log_pi = torch.tensor([x for g in learner for s in g for x in s])
            log_mu = torch.tensor([x for samples in groups for s in samples for x in s.logprobs])
            results.append({"sampled_by": sampled_by, "learner": learner_version, **gap_summary(log_pi, log_mu)})
            print(json.dumps(results[-1]), flush=True)
    finally:
        engine.shutdown()
    return results


def report(results: list[dict], command: str) -> str:
    lines = [
        f"`{command}`", "",
        "| sampled by | learner | tokens | largest rise of log pi (nats) | largest fall | 99.9th pct abs gap | "
        "tokens over 1 nat | k3 mean (approx_kl) | k3 share of its 10 largest tokens |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| v{r['sampled_by']} | v{r['learner']} | {r['tokens']:,} | {r['max_rise']:.2g} | {r['max_fall']:.2g} | "
            f"{r['q999_abs']:.2g} | {100 * r['over_1_nat']:.2f} % | {r['k3_mean']:.2g} | "
            f"{100 * r['k3_top10_share']:.0f} % |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished run folder (its weights/ and config.yaml)")
    parser.add_argument("--pairs", nargs="+", default=["60:60", "59:60"], help="sampled_by:learner versions")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--write", action="store_true", help="write the report into benchmarks/README.md")
    args = parser.parse_args()
    pairs = [tuple(int(v) for v in pair.split(":")) for pair in args.pairs]
    results = measure(args.run, pairs, args.prompts)
    run_arg = args.run.relative_to(ROOT) if args.run.is_absolute() and args.run.is_relative_to(ROOT) else args.run
    command = (f"python -m benchmarks.logprob_gap --run {run_arg} --pairs {' '.join(args.pairs)} "
               f"--prompts {args.prompts}")
    body = report(results, command)
    print(body)
    if args.write:
        (ROOT / "benchmarks" / "results" / "logprob_gap.json").write_text(json.dumps(results, indent=1))
        replace_section(ROOT / "benchmarks" / "README.md", "logprob-gap", body)


if __name__ == "__main__":
    main()
