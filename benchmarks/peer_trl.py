"""Time to accuracy against the peer: this project's `dapo run` against TRL's GRPOTrainer (loss_type="dapo").

    pip install -e '.[cpu,bench]'
    python -m benchmarks.peer_trl [--seeds 0 1 2] [--minutes 4] [--systems project trl-small trl-matched]
                                  [--snapshot-seconds 10] [--set key=value ...]  (project overrides)
                                  [--base tiny.seed=1 ...]  (another base model, for both systems)

Everything but the system is the same: the embedded tiny model (the shipped one, or with `--base` the build of
those tiny settings: `dapo bootstrap --set ...` first), the
synthetic training problems in each seed's order, the prompt text, the verifier and reward rule
(`reward.verify` + `reward.shaping.shape`: +1/-1 with the soft overlong punishment), the sampling (T = 1,
top_p = 1, 64 new tokens) and the held-out set (all problems of `data.eval`, `eval_sampling.n` samples each,
avg@n accuracy). Each run trains for `--minutes` of training: evaluation is left out on both sides (the
project's metrics.jsonl records each evaluation's seconds; TRL is snapshotted in memory while its clock is
paused and the snapshots are evaluated after training, with transformers' batched `generate`).

Systems:
- `project`: `dapo run` of the preset (every service on its own CPUs, cli/cores.py), seeded as benchmarks/runs.py.
- `trl-matched`: TRL with the project's batch shape: prompts_per_step x n completions per generation,
  mini_batches optimizer steps per generation, `epochs` passes, the same lr, warm-up, clip range, grad clip.
  The project's batch warm-up (`learner.batch.warmup_steps`) has no TRL counterpart: TRL takes the full shape
  from its first step.
- `trl-small`: TRL as a CPU user would run it: 16 completions per step, 8 per prompt, one pass, its learning
  rate tuned (SMALL_LR: the project's 3e-4 collapses at this batch size).
TRL is one process that generates and trains in turn on all CPUs; it has no dynamic sampling.

Measured: minutes of training to reach each held-out accuracy target (the first evaluation at or above it),
per seed; the median over seeds (a seed that never reaches a target counts as never); and the ratio project /
TRL per target. Goal (issue 15): the project reaches each target in at most half of TRL's time (ratio <= 0.5).
Reported into benchmarks/README.md between the `peer-trl` markers and benchmarks/results/peer_trl.{json,png}
(`--section` names another set, so a run on another base model keeps the first one's report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.runs import ROOT, Curve, read_curve, replace_section, run_seeded

GOAL = 0.5
# from the base model (about 24 %) to what 2.5 minutes reach (about 45 % with 32 x 16 a step, about 55 % with 64 x 8);
# the lowest lie within one evaluation interval of the base (10 s, 3 project steps), where the cadence decides
TARGETS = (0.28, 0.32, 0.36, 0.40, 0.44, 0.48, 0.52)
SYSTEMS = ("project", "trl-small", "trl-matched")
SNAPSHOT_SECONDS = 10.0  # TRL: an evaluation point every this many seconds of training (the project's
# eval_every=3: ~10 s);
# --snapshot-seconds with the project's learner.eval_every=1 measures the low targets at a project step's resolution
# trl-small's learning rate, the best of a sweep on seed 0 (runs/tune, 2.5 minutes each): at the project's 3e-4,
# 16-completion steps collapsed (24 % -> 1 %); 1e-4 reached 35 % in 0.25 minutes and 42 % in 1.75; 3e-5 reached
# 33 % in 0.33 and 41 % in 1.67.
SMALL_LR = 1e-4


# -- the TRL side (runs in its own process: `python -m benchmarks.peer_trl trl ...`) ------------------------------
def trl_shape(setting: str, learner, n: int) -> dict:
    """GRPOConfig batch fields and learning rate for a setting. matched: one generation = prompts_per_step x n
    completions, cut into mini_batches optimizer steps, `epochs` passes over it (TRL's num_iterations)."""
    if setting == "matched":
        per_step = learner.batch.prompts_per_step * n // learner.batch.mini_batches
        return {"num_generations": n, "per_device_train_batch_size": per_step,
                "steps_per_generation": learner.batch.mini_batches, "num_iterations": learner.batch.epochs,
                "learning_rate": learner.optimizer.lr}
    if setting == "small":
        return {"num_generations": 8, "per_device_train_batch_size": 16, "steps_per_generation": 1,
                "num_iterations": 1, "learning_rate": SMALL_LR}
    raise ValueError(f"unknown TRL setting {setting!r} (matched, small)")


def reward_function(settings):
    """The project's reward rule as a TRL reward function (the reward service's verify + shaping)."""
    from reward.scoring import ScoreItem, shaped
    from reward.verify import verify

    max_tokens = settings.sampling.max_tokens

    def project_reward(prompts, completions, completion_ids, ground_truth, **_) -> list[float]:
        return [
            shaped(verify(text, truth), ScoreItem(text, truth, len(ids), max_tokens), settings.reward).reward
            for text, ids, truth in zip(completions, completion_ids, ground_truth, strict=True)
        ]

    return project_reward


def held_out_accuracy(model, tokenizer, prompts: list[str], answers: list[str], n: int, max_tokens: int,
                      temperature: float, seed: int, chunk: int = 128) -> float:
    """avg@n on the held-out problems with transformers' batched sampling (the same verifier as the reward)."""
    import torch

    from reward.verify import verify

    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    correct = samples = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), chunk):
            batch = tokenizer(prompts[start:start + chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**batch, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=max_tokens, num_return_sequences=n,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            for k, text in enumerate(texts):
                correct += verify(text, answers[start + k // n]).correct
                samples += 1
    return correct / samples


def run_trl(setting: str, seed: int, minutes: float, preset: str, out: Path,
            snapshot_seconds: float = SNAPSHOT_SECONDS, base: list[str] = ()) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from cli.bootstrap import ensure_model
    from cli.main import parse_overrides
    from learner.service import TrainProblems, data_spec, held_out_problems
    from services.config import load_settings
    from services.data import load_problems, render_prompt

    overrides = parse_overrides(list(base))
    overrides.setdefault("data", {})["seed"] = seed
    settings = load_settings(preset, **overrides)
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)  # one process generates and trains in turn: it gets every CPU
    model_dir = ensure_model(settings, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template, raw = settings.data.prompt_template, settings.data.raw_template

    def rows(problems):
        return [{"prompt": render_prompt(p, tokenizer, template, raw_template=raw), "ground_truth": p.answer}
                for p in problems]

    train = TrainProblems(load_problems(data_spec(settings.data.train, "train"), settings), settings.data.seed)
    order = [train.next() for _ in range(len(train.problems))]  # the project's order for this seed (epoch 0)
    held_out = held_out_problems(settings)
    cfg, s = settings.learner, settings.sampling
    args = GRPOConfig(
        output_dir=str(out.parent / f"{out.stem}-trainer"), seed=seed, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", logging_steps=10, disable_tqdm=True, max_steps=1_000_000,
        shuffle_dataset=False, max_completion_length=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=0,
        lr_scheduler_type="constant_with_warmup", weight_decay=cfg.optimizer.weight_decay,
        adam_beta1=cfg.optimizer.adam_betas[0], adam_beta2=cfg.optimizer.adam_betas[1],
        max_grad_norm=cfg.optimizer.grad_clip,
        beta=0.0, loss_type="dapo", epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high,
        mask_truncated_completions=cfg.loss.overlong_filter, remove_unused_columns=False, disable_dropout=True,
        **trl_shape(setting, cfg, s.n),
    )
    # the project warms up over rollout steps
    args.warmup_steps = cfg.optimizer.warmup_steps * (args.steps_per_generation or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    class Clock(TrainerCallback):
        """Training seconds (snapshots excluded); an in-memory snapshot every snapshot_seconds; stop at the limit."""

        def __init__(self):
            self.started = self.paused = 0.0
            self.snapshots: list[tuple[float, int, dict]] = []

        def trained(self) -> float:
            return time.perf_counter() - self.started - self.paused

        def snapshot(self, step: int) -> None:
            began = time.perf_counter()
            self.snapshots.append((self.trained(), step,
                                   {k: v.detach().clone() for k, v in model.state_dict().items()}))
            self.paused += time.perf_counter() - began

        def on_train_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()
            self.snapshot(0)

        def on_step_end(self, args, state, control, **kw):
            seconds = self.trained()
            if seconds >= 60.0 * minutes:
                self.snapshot(state.global_step)
                control.should_training_stop = True
            elif seconds >= len(self.snapshots) * snapshot_seconds:
                self.snapshot(state.global_step)

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_function(settings)], args=args,
                          train_dataset=Dataset.from_list(rows(order)), processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    e = settings.eval_sampling
    prompts, answers = [r["prompt"] for r in rows(held_out)], [p.answer for p in held_out]
    curve = {"label": f"trl-{setting}", "seed": seed, "steps": [], "minutes": [], "accuracy": []}
    for seconds, step, state in clock.snapshots:
        model.load_state_dict(state)
        curve["steps"].append(step)
        curve["minutes"].append(seconds / 60.0)
        curve["accuracy"].append(held_out_accuracy(model, tokenizer, prompts, answers, e.n, e.max_tokens,
                                                   e.temperature, seed))
        print(f"[trl-{setting} seed {seed}] step {step} at {seconds / 60:.2f} min: {curve['accuracy'][-1]:.3f}",
              flush=True)
    steps = max(1, clock.snapshots[-1][1])
    curve.update(step_seconds=clock.snapshots[-1][0] / steps, returncode=0)
    out.write_text(json.dumps(curve))


# -- the comparison -------------------------------------------------------------------------------------------------
def median_minutes(curves: list[Curve], target: float) -> float | None:
    """The median seed's minutes to `target` (the slower middle seed for an even count); a seed that never got
    there is slower than any that did, and a median seed that never got there gives None."""
    never, minutes = sorted((t is None, t or 0.0) for t in (c.minutes_to(target) for c in curves))[len(curves) // 2]
    return None if never else minutes


def fmt(value: float | None, digits: int = 2) -> str:
    return "never" if value is None else f"{value:.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None and theirs is None:
        return "neither"
    if ours is None:
        return "not reached"
    if theirs is None:
        return "TRL never"
    return f"{ours / theirs:.2f}" if theirs > 0 else "n/a"


def report(results: dict[str, list[Curve]], command: str) -> str:
    systems = [s for s in SYSTEMS if results.get(s)]
    lines = [f"`{command}`", "",
             "Minutes of training (evaluations excluded) to reach each held-out accuracy, median over seeds:", "",
             "| system | step (s)¹ | start | end | " + " | ".join(f"{100 * t:.0f} %" for t in TARGETS) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in TARGETS) + " |"]
    for system in systems:
        curves = results[system]
        lines.append(
            f"| {system} | {statistics.fmean(c.step_seconds for c in curves):.2f} | "
            f"{100 * statistics.median(c.base for c in curves):.1f} | "
            f"{100 * statistics.median(c.accuracy[-1] for c in curves):.1f} | "
            + " | ".join(fmt(median_minutes(curves, t)) for t in TARGETS) + " |")
    lines += ["", "¹ the project's rollout step (generation of B informative groups overlapped, then the update); "
              "TRL's optimizer step (trl-matched reuses one generation for mini_batches x epochs of them)."]
    if results.get("project"):
        lines += ["", "Ratio project / TRL per target (goal: at most " + f"{GOAL}" + "):", "",
                  "| against | " + " | ".join(f"{100 * t:.0f} %" for t in TARGETS) + " |",
                  "| --- | " + " | ".join("---:" for _ in TARGETS) + " |"]
        ours = [median_minutes(results["project"], t) for t in TARGETS]
        for system in systems[1:]:
            theirs = [median_minutes(results[system], t) for t in TARGETS]
            lines.append(f"| {system} | " + " | ".join(ratio(o, t) for o, t in zip(ours, theirs)) + " |")
    lines += ["", "Per seed (minutes to each target):", "",
              "| system | seed | start | end | evaluations | " + " | ".join(f"{100 * t:.0f} %" for t in TARGETS) + " |",
              "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in TARGETS) + " |"]
    for system in systems:
        for c in results[system]:
            lines.append(f"| {system} | {c.seed} | {100 * c.base:.1f} | {100 * c.accuracy[-1]:.1f} | {len(c.steps)} | "
                         + " | ".join(fmt(c.minutes_to(t)) for t in TARGETS) + " |")
    return "\n".join(lines)


def plot(results: dict[str, list[Curve]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for colour, system in zip(("C0", "C1", "C2"), SYSTEMS):
        for k, c in enumerate(results.get(system, [])):
            ax.step(c.minutes, [100 * a for a in c.accuracy], where="post", color=colour, alpha=0.8,
                    label=system if k == 0 else None)
    ax.set_xlabel("minutes of training (evaluations excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def timed_project_run(label: str, seed: int, run_dir: Path, preset: str, minutes: float, overrides: list[str],
                      reuse: bool) -> Curve:
    """One `dapo run` of `preset` stopped after `minutes` of training, or read back from `run_dir` with `reuse`
    when it finished before."""
    if reuse and (run_dir / "summary.json").exists():
        return read_curve(label, seed, run_dir / "metrics.jsonl")
    limits = [f"learner.time_limit_minutes={minutes}", "learner.total_steps=100000"]
    return run_seeded(label, seed, run_dir, preset, [*limits, *overrides], 60 * (minutes + 20))


def one_run(system: str, seed: int, args: argparse.Namespace) -> Curve:
    """One system on one seed, run now, or read back from --out with --reuse when it finished before."""
    if system == "project":
        return timed_project_run(system, seed, args.out / f"project-seed{seed}", args.preset, args.minutes,
                                 [*args.base, *args.overrides], args.reuse)
    out = args.out / f"{system}-seed{seed}.json"
    if not (args.reuse and out.exists()):
        cmd = [sys.executable, "-m", "benchmarks.peer_trl", "trl", "--setting", system.removeprefix("trl-"),
               "--seed", str(seed), "--minutes", str(args.minutes), "--preset", args.preset, "--out", str(out),
               "--snapshot-seconds", str(args.snapshot_seconds), *(f"--base={b}" for b in args.base)]
        print(f"[{system} seed {seed}] {' '.join(cmd)}", flush=True)
        with open(args.out / f"{system}-seed{seed}.out", "w") as log:
            subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                           timeout=60 * (args.minutes + 30))
    return curve_from_json(json.loads(out.read_text()))


def curve_from_json(data: dict) -> Curve:
    return Curve(**{k: data[k] for k in ("label", "seed", "steps", "minutes", "accuracy", "step_seconds",
                                          "returncode", "wait_seconds", "refills") if k in data})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("trl", help="one TRL run (used by the comparison)")
    one.add_argument("--setting", choices=("matched", "small"), required=True)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--minutes", type=float, default=4.0)
    one.add_argument("--preset", default="tiny-cpu")
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--snapshot-seconds", type=float, default=SNAPSHOT_SECONDS)
    one.add_argument("--base", action="append", default=[], help="a setting of the base model (key=value)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=4.0, help="training minutes of every run")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--snapshot-seconds", type=float, default=SNAPSHOT_SECONDS,
                        help="TRL's evaluation cadence in seconds of training "
                             "(the project's: --set learner.eval_every=K)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="project override key=value")
    parser.add_argument("--base", action="append", default=[],
                        help="a tiny.* setting that selects another base model, for both systems (key=value)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-peer-trl")
    parser.add_argument("--reuse", action="store_true", help="read back the runs that already finished in --out")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from results/<section>.json")
    parser.add_argument("--section", default="peer-trl",
                        help="README markers and results/<section with _>.{json,png} to write "
                             "(another run keeps the first's)")
    args = parser.parse_args()
    if args.snapshot_seconds <= 0:
        parser.error("--snapshot-seconds must be positive")
    if args.command == "trl":
        run_trl(args.setting, args.seed, args.minutes, args.preset, args.out, args.snapshot_seconds, args.base)
        return

    stem = args.section.replace("-", "_")
    results_path = ROOT / "benchmarks" / "results" / f"{stem}.json"
    if args.report_only:
        saved = json.loads(results_path.read_text())
        command, results = saved["command"], {s: [curve_from_json(c) for c in cs] for s, cs in saved["runs"].items()}
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        results = {s: [] for s in args.systems}
        for seed in args.seeds:  # interleaved: a change in the machine's load hits every system alike
            for system in args.systems:
                results[system].append(one_run(system, seed, args))
        command = (f"python -m benchmarks.peer_trl --seeds {' '.join(map(str, args.seeds))} --minutes {args.minutes:g}"
                   f" --systems {' '.join(args.systems)} --preset {args.preset}"
                   + (f" --snapshot-seconds {args.snapshot_seconds:g}"
                      if args.snapshot_seconds != SNAPSHOT_SECONDS else "")
                   + "".join(f" --set {o}" for o in args.overrides) + "".join(f" --base {b}" for b in args.base)
                   + (f" --section {args.section}" if args.section != "peer-trl" else ""))
        results_path.write_text(json.dumps({"command": command, "runs": {s: [c.to_json() for c in cs]
                                                                         for s, cs in results.items()}}, indent=1))
    plot(results, ROOT / "benchmarks" / "results" / f"{stem}.png")
    body = report(results, command) + f"\n\n![{args.section}](results/{stem}.png)"
    replace_section(ROOT / "benchmarks" / "README.md", args.section, body)
    print(body)


if __name__ == "__main__":
    main()
