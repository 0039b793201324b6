"""The learner's update on a GPU: the project's `Trainer.train_step` against a plain padded loop, same tokens.

One process, one device, the variants one after another on the same synthetic scored groups (a randomly
initialised Qwen2.5-shaped model: nothing to download):

- `project`: `Trainer.train_step` as the preset runs it on a GPU (packed rows on the varlen flash kernel, chunked
  head, bf16 autocast, fp32 AdamW, selective checkpointing and compiled layers in the 1.5B preset, its
  micro_batch_tokens and mini-batches);
- `project-compiled`: selective checkpointing with each decoder layer and the head's chunks compiled
  (`learner.compute.compile`), whatever the preset says;
- `project-selective`: selective checkpointing uncompiled (the matrix products and attention kept, only the
  elementwise work recomputed: learner/activation_checkpointing.py);
- `project-full`: full checkpointing uncompiled (each layer's forward again in backward);
- `project-compiled-off`: compiled, no checkpointing (what the activations of the preset's micro-batch cost when
  every one is kept);
- `project-sdpa`: the preset's step on SDPA with a block-diagonal mask (`learner.compute.attention: sdpa`);
- `project-padded`: the preset's step with `learner.compute.packing: off` (right-padded rows, the layout before
  packing);
- `project-no-recompute` (asked for by name): no checkpointing uncompiled, at half the micro-batch;
- `plain`: a plain loop a user would write (rows right-padded to the longest of each micro-batch, sorted by
  length, full logits and log_softmax, the PPO clipped token-mean loss, transformers' whole-layer checkpointing
  wherever the preset checkpoints, the same optimizer, mini-batches and pi_old pass);
- `strong`: what a practitioner writes today (`StrongLoop`: packed rows on a varlen flash kernel, torch's
  checkpoint wrapper with torchtitan's selective policy, compiled layers, fused AdamW, a chunked logprob), the
  same loss and passes as `plain`. The project's goal is at most 1.0x its step.

Each variant: one warm-up step, then `--steps` timed steps (synchronized), seconds a step, response tokens/s,
model TFLOP/s and MFU (learner/throughput.py: 6N per trained token, 2N per no-grad token, padding excluded, the
same count for every variant), peak memory (torch.cuda.max_memory_allocated) and the GPU busy fraction over the
timed steps (NVML's utilisation, sampled from a thread: `BusySampler`). After `project`'s steps, what publishing
its weights costs beside the step (`publish_figures`).

    python -m benchmarks.gpu_trainer --model 1.5b --write          # on a GPU (the issue's shape)
    python -m benchmarks.gpu_trainer --model tiny --groups 2 --steps 1   # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Qwen2.5 shapes (config.json of the released models); `tiny` is for a CPU smoke run.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152_064, tie_word_embeddings=False),
}


def build_model(shape: str, folder: Path, **changes) -> Path:
    """A random-init model of a Qwen2.5 shape (`changes` override its config: fewer layers, another vocabulary)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**SHAPES[shape], **changes}, max_position_embeddings=32768, rope_theta=1_000_000.0,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 7B random init on a host is slow
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def synthetic_groups(groups: int, n: int, vocab: int, prompt_range, response_range, seed: int = 0) -> list:
    """Scored groups of the issue's shape: half of each group right (+1), half wrong (-1), behaviour logprobs
    near the policy's own (a random policy's logprob is about -log V)."""
    from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt_range))]
        task = PromptTask(prompt_id=f"p{g}", prompt="x", prompt_token_ids=prompt, ground_truth="1")
        samples, scores = [], []
        for i in range(n):
            ids = [rng.randrange(2, vocab) for _ in range(rng.randint(*response_range))]
            samples.append(Sample(token_ids=ids, logprobs=[-math.log(vocab)] * len(ids), text="",
                                  finish_reason="stop"))
            reward = 1.0 if i % 2 == 0 else -1.0
            scores.append(Score(reward=reward, correct=reward > 0, overlong=False, rule="answer_line"))
        rollout = RolloutGroup(task=task, policy_version=0, generator_id="bench", samples=samples)
        out.append(ScoredGroup(rollout=rollout, scores=scores))
    return out


def step_flops(parameter_counts, groups, mini_batches: int, epochs: int) -> float:
    """The model FLOPs of one step, counted the same way for every variant (learner/throughput.py): every row
    trained `epochs` times, the rows of every mini-batch but the first also run once without a gradient."""
    from learner.throughput import model_flops

    rows = [(len(g.rollout.task.prompt_token_ids) + len(s.token_ids), len(s.token_ids))
            for g in groups for s in g.rollout.samples]
    tokens, scored = sum(r[0] for r in rows), sum(r[1] for r in rows)
    recomputed = (mini_batches - 1) / mini_batches
    return model_flops(*parameter_counts, trained=epochs * tokens, trained_scored=epochs * scored,
                       forward=int(recomputed * tokens), forward_scored=int(recomputed * scored))


class PlainLoop:
    """What a user would write: padded rows sorted by length, full logits, the clipped token-mean loss."""

    def __init__(self, settings, model_path: Path, device):
        import torch
        from transformers import AutoModelForCausalLM

        cfg = settings.learner
        self.cfg, self.device = cfg, device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
        if cfg.compute.gradient_checkpointing != "off":  # what a user writes: transformers' own, whole layers
            self.model.gradient_checkpointing_enable()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optimizer.lr,
                                           weight_decay=cfg.optimizer.weight_decay)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def _micro_batches(self, rows):
        rows = sorted(rows, key=lambda r: -len(r[0]))
        out, current = [], []
        for row in rows:
            if current and len(current[0][0]) * (len(current) + 1) > self.cfg.compute.micro_batch_tokens:
                out.append(current)
                current = []
            current.append(row)
        return out + ([current] if current else [])

    def _logp(self, micro):
        import torch

        width = max(len(ids) for ids, _, _ in micro)
        ids = torch.zeros((len(micro), width), dtype=torch.long)
        mask = torch.zeros((len(micro), width), dtype=torch.long)
        loss_mask = torch.zeros((len(micro), width - 1))
        for b, (row, start, _) in enumerate(micro):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = 1
            loss_mask[b, start - 1: len(row) - 1] = 1.0
        ids, mask, loss_mask = ids.to(self.device), mask.to(self.device), loss_mask.to(self.device)
        with self.autocast:
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        logp = logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return logp, loss_mask

    def train_step(self, groups) -> None:
        import torch

        from learner import dapo

        rows = []
        for group in groups:
            prompt = group.rollout.task.prompt_token_ids
            advantages = dapo.group_advantages([s.reward for s in group.scores]).tolist()
            for sample, advantage in zip(group.rollout.samples, advantages):
                rows.append((prompt + sample.token_ids, len(prompt), advantage))
        count = max(1, min(self.cfg.batch.mini_batches, len(groups)))
        mini = [rows[k * len(rows) // count:(k + 1) * len(rows) // count] for k in range(count)]
        old = {}
        self.model.train(False)
        with torch.no_grad():
            for m, mb in enumerate(mini[1:], start=1):
                old[m] = [self._logp(micro)[0] for micro in self._micro_batches(mb)]
        self.model.train(True)
        for _ in range(self.cfg.batch.epochs):
            for m, mb in enumerate(mini):
                tokens = sum(len(r[0]) - r[1] for r in mb)
                for k, micro in enumerate(self._micro_batches(mb)):
                    logp, loss_mask = self._logp(micro)
                    logp_old = old[m][k] if m in old else logp.detach()
                    advantage = torch.tensor([r[2] for r in micro], device=self.device)[:, None]
                    ratio = (logp - logp_old).exp()
                    clipped = ratio.clamp(1 - self.cfg.loss.clip_low, 1 + self.cfg.loss.clip_high)
                    loss = -(torch.minimum(ratio * advantage, clipped * advantage) * loss_mask).sum() / tokens
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)


class StrongLoop(PlainLoop):
    """What a practitioner writes today (verl's FSDP actor, torchtitan's recipes): rows packed without padding
    (position ids restart; a varlen flash kernel on the rows' boundaries: flash-attn where installed, else PyTorch's
    own), each decoder layer wrapped in torch's checkpoint wrapper (selective: torchtitan's kind of op-level policy,
    the project's own `SELECTIVE_CONTEXT`, keeping the matrix products and attention, wherever the preset
    checkpoints) and compiled (on a GPU), fused AdamW, and a
    chunked logprob: the head's logits for a chunk of response positions at a time, recomputed in backward, never
    `[tokens x vocab]` at once. Liger's fused kernels are not installed on the lent machine; the chunked head is the
    part they would replace. Same loss, optimizer settings, mini-batches and pi_old pass as `PlainLoop`."""

    CHUNK = 4096  # response positions through the head at once

    def __init__(self, settings, model_path: Path, device):
        import importlib.util

        import torch
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from transformers import AutoModelForCausalLM

        from learner import activation_checkpointing, attention

        cfg = settings.learner
        self.cfg, self.device = cfg, device
        cuda = device.type == "cuda"
        if cuda and importlib.util.find_spec("flash_attn") is not None:
            kernel = "flash_attention_2"
        elif attention.available(cuda, torch.bfloat16):
            attention.register()
            kernel = attention.VARLEN
        else:  # a CPU: SDPA on the block-diagonal mask transformers builds from the position ids
            kernel = "sdpa"
        self.attention, self.varlen = kernel, kernel != "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation=kernel).to(device)
        layers = self.model.model.layers
        for i, layer in enumerate(layers):
            if cfg.compute.gradient_checkpointing == "selective":  # the matrix products and attention kept
                layer = checkpoint_wrapper(layer, context_fn=activation_checkpointing.SELECTIVE_CONTEXT,
                                           preserve_rng_state=False)
            elif cfg.compute.gradient_checkpointing == "full":
                layer = checkpoint_wrapper(layer, preserve_rng_state=False)
            layers[i] = torch.compile(layer, dynamic=True) if cuda else layer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optimizer.lr,
                                           weight_decay=cfg.optimizer.weight_decay, fused=True if cuda else None)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
        self.chunk_logp = torch.compile(_chunk_logp, dynamic=True) if cuda else _chunk_logp

    def _micro_batches(self, rows):
        rows = sorted(rows, key=lambda r: -len(r[0]))
        out, current, tokens = [], [], 0
        for row in rows:  # packed: real tokens up to the budget
            if current and tokens + len(row[0]) > self.cfg.compute.micro_batch_tokens:
                out.append(current)
                current, tokens = [], 0
            current.append(row)
            tokens += len(row[0])
        return out + ([current] if current else [])

    def _logp(self, micro):
        import torch
        from torch.utils.checkpoint import checkpoint

        ids, positions, starts, predictors, targets = [], [], [0], [], []
        for row, start, _ in micro:
            offset = starts[-1]
            ids += row
            positions += range(len(row))
            predictors += range(offset + start - 1, offset + len(row) - 1)
            targets += row[start:]
            starts.append(offset + len(row))
        kwargs = {}
        if self.varlen:
            bounds = torch.tensor(starts, dtype=torch.int32, device=self.device)
            longest = max(len(row) for row, _, _ in micro)
            kwargs = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest,
                      "max_length_k": longest}
        ids = torch.tensor([ids], device=self.device)
        positions = torch.tensor([positions], device=self.device)
        predictors = torch.tensor(predictors, device=self.device)
        targets = torch.tensor(targets, device=self.device)
        with self.autocast:
            hidden = self.model.model(input_ids=ids, position_ids=positions, use_cache=False,
                                      **kwargs).last_hidden_state[0, predictors]
            weight = self.model.lm_head.weight
            logp = torch.cat([checkpoint(self.chunk_logp, h, weight, t, use_reentrant=False)
                              for h, t in zip(hidden.split(self.CHUNK), targets.split(self.CHUNK))])
        lengths = [len(row) - start for row, start, _ in micro]
        mask = torch.zeros((len(micro), max(lengths)), device=self.device)
        padded = torch.zeros_like(mask)
        rows = torch.repeat_interleave(torch.arange(len(micro)), torch.tensor(lengths)).to(self.device)
        slots = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        mask[rows, slots] = 1.0
        return padded.index_put((rows, slots), logp), mask


def _chunk_logp(hidden, weight, targets):
    """log softmax of the head's logits at the chunk's positions, read at the targets (fp32 after the matmul)."""
    logits = (hidden @ weight.to(hidden.dtype).T).float()
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BusySampler:
    """The GPU busy fraction over the timed steps, as NVML reports it (torch.cuda.utilization: the share of each
    sample period, 1/6 to 1 s, in which a kernel ran), sampled from a thread: no profiler, no extra step, no
    overhead on the steps it watches. None on a CPU or where NVML cannot be read."""

    def __init__(self, device, every: float = 0.1):
        self.device, self.every, self.samples = device, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import torch

        while not self._stop.wait(self.every):
            try:
                self.samples.append(torch.cuda.utilization(self.device) / 100)
            except Exception:  # no NVML (pynvml / nvidia-ml-py) here: no figure rather than a wrong one
                return

    def __enter__(self) -> "BusySampler":
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def fraction(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


VARIANT_SETTINGS = {  # learner.compute of each variant
    "project": {"packing": "auto"}, "project-sdpa": {"packing": "auto", "attention": "sdpa"},
    "project-padded": {"packing": "off"},
    "project-compiled": {"packing": "auto", "gradient_checkpointing": "selective", "compile": True},
    "project-selective": {"packing": "auto", "gradient_checkpointing": "selective", "compile": False},
    "project-full": {"packing": "auto", "gradient_checkpointing": "full", "compile": False},
    "project-compiled-off": {"packing": "auto", "gradient_checkpointing": "off", "compile": True},
    # Not in the default list: what the recompute costs uncompiled, at half the micro-batch to fit an 80 GB card
    # (activations a token and layer without checkpointing: benchmarks/recompute.py).
    "project-no-recompute": {"packing": "auto", "gradient_checkpointing": "off", "compile": False,
                             "micro_batch_fraction": 0.5}}


def measure(shape: str, groups_count: int, steps: int, preset: str, variants: list[str], n: int,
            prompt_range, response_range, micro_batch_tokens: int | None, progress=None) -> dict:
    """Every variant's row; `progress(result)` after each (a partial result survives a run cut short)."""
    import accelerate
    import torch
    import transformers

    from services.config import load_settings

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_model(shape, Path(tmp) / "model")
        learner = {"batch": {"prompts_per_step": groups_count}, "checkpoints": {"every": 0}, "compute": {}}
        if micro_batch_tokens:
            learner["compute"]["micro_batch_tokens"] = micro_batch_tokens
        base = load_settings(preset, run_dir=str(Path(tmp) / "run"), model={"name_or_path": str(model_path)},
                             sampling={"n": n}, learner=learner)
        groups = synthetic_groups(groups_count, n, SHAPES[shape]["vocab_size"], prompt_range, response_range)
        response_tokens = sum(len(s.token_ids) for g in groups for s in g.rollout.samples)
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
        result = {"device": card, "device_gib": memory, "shape": shape, "groups": groups_count, "n": n,
                  "response_tokens": response_tokens, "preset": preset,
                  "micro_batch_tokens": base.learner.compute.micro_batch_tokens,
                  "mini_batches": base.learner.batch.mini_batches,
                  "steps": steps, "torch": torch.__version__, "transformers": transformers.__version__,
                  "accelerate": accelerate.__version__, "rows": []}
        for variant in variants:
            try:
                result["rows"].append(measure_variant(variant, base, preset, model_path, n, learner, groups, steps,
                                                      response_tokens, device))
            except Exception as error:  # a variant that cannot run here is reported, the others still measured
                result["rows"].append({"variant": variant, "error": f"{type(error).__name__}: {error}"})
            print(result["rows"][-1], flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if progress:
                progress(result)
    return result


BASELINES = {"plain": PlainLoop, "strong": StrongLoop}


def measure_variant(variant, base, preset, model_path, n, learner, groups, steps, response_tokens, device) -> dict:
    import torch

    from learner import throughput
    from learner.trainer import Trainer
    from services.config import load_settings

    started = time.perf_counter()
    if variant in BASELINES:
        runner = BASELINES[variant](base, model_path, device)
        counts = throughput.parameter_counts(runner.model)
        attention = getattr(runner, "attention", "sdpa")
    else:
        compute = dict(VARIANT_SETTINGS[variant])
        fraction = compute.pop("micro_batch_fraction", 1)
        compute["micro_batch_tokens"] = int(fraction * base.learner.compute.micro_batch_tokens)
        settings = load_settings(preset, run_dir=base.run_dir, model={"name_or_path": str(model_path)},
                                 sampling={"n": n}, learner={**learner, "compute": compute})
        runner = Trainer(settings, model_path)
        counts, attention = runner.parameter_counts, runner.attention
    flops = step_flops(counts, groups, base.learner.batch.mini_batches, base.learner.batch.epochs)
    runner.train_step(groups)  # warm-up
    _sync(device)
    setup = time.perf_counter() - started  # load and warm-up: what a run cut short spent before its first figure
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    with BusySampler(device) as busy:
        for _ in range(steps):
            started = time.perf_counter()
            runner.train_step(groups)
            _sync(device)
            seconds.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    step = statistics.median(seconds)
    use = throughput.utilisation(flops, step, 1, throughput.peak_tflops(device))
    published = publish_figures(runner, settings, step) if variant == "project" else {}
    return {"variant": variant, "attention": attention, "seconds": step, "all_seconds": seconds,
            "response_tokens_per_second": response_tokens / step, **use, "peak_gib": peak,
            "gpu_busy": busy.fraction, "setup_seconds": setup, **published}


def publish_figures(trainer, settings, step_seconds: float) -> dict:
    """What publishing the trained weights costs beside the step, as the learner publishes them on one rank
    (learner/service.py `publish`): the gather to the host in the served dtype, then the version's files written
    (safetensors shards, sha256, fsync, the signed announcement; not Redis's SET and PUBLISH). With overlap
    (max_staleness >= 1 and weights.overlap_delivery) only the gather, and what the writing takes beyond the next
    step, are on the step's path."""
    from services.keys import create_keys, keys_dir, load_signer
    from services.streams import run_prefix
    from services.weights import channel, shareable_state_dict
    from services.weights_layout import write_version

    create_keys(keys_dir(settings))
    started = time.perf_counter()
    weights = shareable_state_dict(trainer.state_dict_for_publish())
    gathered = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        write_version(Path(folder), 1, weights, int(settings.weights.shard_mb * 2**20), "http://bench/v1/weights/1",
                      load_signer(settings, "learner"), channel(run_prefix(settings)))
        written = time.perf_counter() - started
    overlap = settings.weights.overlap_delivery and settings.learner.batch.max_staleness >= 1
    overlapped = gathered + max(0.0, written - step_seconds)  # the writing beyond the next step waits
    return {"publish_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
            "publish_gather_seconds": gathered, "publish_write_seconds": written, "publish_overlapped": overlap,
            "publish_share": (overlapped if overlap else gathered + written) / step_seconds,
            "publish_share_overlapped": overlapped / step_seconds}


def report(result: dict, command: str) -> str:
    plain, strong = (next((r for r in result["rows"] if r["variant"] == name and "error" not in r), None)
                     for name in ("plain", "strong"))
    lines = [
        f"`{command}`", "",
        f"{result['device']} (torch {result['torch']}, transformers {result.get('transformers', 'n/a')}); "
        f"a random-init Qwen2.5-{result['shape']} shape, "
        f"{result['groups']} groups x {result['n']} responses ({result['response_tokens']:,} response tokens), "
        f"preset `{result['preset']}` (micro_batch_tokens {result['micro_batch_tokens']:,}, "
        f"{result['mini_batches']} mini-batches); median of {result['steps']} steps after a warm-up.", "",
        "| variant | s / step | vs plain | vs strong | response tokens/s | model TFLOP/s | MFU | peak GiB | GPU busy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | {row['error']} ||||||||")
            continue
        ratios = [row["seconds"] / base["seconds"] if base else None for base in (plain, strong)]
        lines.append(f"| {row['variant']} ({row['attention']}) | {row['seconds']:.2f} | {fmt(ratios[0], '.2f')} | "
                     f"{fmt(ratios[1], '.2f')} | "
                     f"{row['response_tokens_per_second']:,.0f} | {row['model_tflops']:.1f} | "
                     f"{fmt(row.get('mfu') and 100 * row['mfu'], '.1f')} % | {fmt(row['peak_gib'], '.1f')} | "
                     f"{fmt(row['gpu_busy'] and 100 * row['gpu_busy'], '.0f')} % |")
    for row in result["rows"]:
        if "publish_share" in row:
            lines += ["", f"Publishing after the `{row['variant']}` step ({row['publish_bytes'] / 2**30:.2f} GiB "
                      f"served): the gather to the host {row['publish_gather_seconds']:.2f} s, the version's files "
                      f"{row['publish_write_seconds']:.2f} s; on the step's path "
                      f"{100 * row['publish_share']:.1f} % of the step "
                      + ("(overlapped, as the preset delivers)." if row["publish_overlapped"] else
                         f"(the preset delivers on the path; {100 * row['publish_share_overlapped']:.1f} % with "
                         "weights.overlap_delivery). Goal: at most 5 %.")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--preset", default="dapo-qwen2.5-math-1.5b")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="default: the preset's")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[64, 320])
    parser.add_argument("--response-tokens", type=int, nargs=2, default=[256, 2048])
    # In the order a lease that runs out first should cut them.
    parser.add_argument("--variants", nargs="+", default=["plain", "strong", "project", "project-selective",
                                                          "project-full", "project-compiled-off", "project-padded",
                                                          "project-sdpa"],
                        choices=[*BASELINES, *VARIANT_SETTINGS])
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/gpu_trainer-<model>.json (after every variant)")
    args = parser.parse_args()
    command = "python -m benchmarks.gpu_trainer " + " ".join(sys.argv[1:])

    def write(result: dict) -> None:
        if args.write:
            text = report(result, command)
            (RESULTS / f"gpu_trainer-{args.model}.json").write_text(json.dumps({**result, "report": text},
                                                                                indent=2) + "\n")

    result = measure(args.model, args.groups, args.steps, args.preset, args.variants, args.n,
                     tuple(args.prompt_tokens), tuple(args.response_tokens), args.micro_batch_tokens, write)
    print(report(result, command))


if __name__ == "__main__":
    main()
