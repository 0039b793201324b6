"""The DAPO trainer: turns scored groups into optimizer steps (torch + accelerate).

One `train_step(groups)` is one rollout step of the paper (Algorithm 1, the inner loop):
  1. sequences = prompt tokens + response tokens; advantages per group from the rewards, Eq. (9); with
     `overlong_filter`, truncated responses leave the loss (their rewards still set the group baseline);
  2. pi_old = the learner's logprobs of the response tokens under the step's starting parameters: recomputed
     (no grad) for every mini-batch but the first, which trains before any update, so that its own forward
     pass gives pi_old (same value, one forward of 1/M of the batch less);
     TIS weight = min(pi_old / mu, tis_cap) against the behaviour logprobs mu the generator recorded (none when
     tis_cap is null);
  3. the groups are shuffled and split into `mini_batches` mini-batches of whole groups (the paper's 512 prompts
     make 16 mini-batches of 32 prompts x 16 responses); one AdamW update per mini-batch, `epochs` passes;
  4. each mini-batch is cut into micro-batches of at most `micro_batch_tokens` padded tokens; every micro-batch
     loss is divided by the *mini-batch's* token count (Eq. 12) or response count (sample level), so the
     accumulated gradient equals the gradient of the whole mini-batch at once. With `share_prompt_pass` a forward
     pass runs the micro-batch's distinct prompts once (left-padded) and the responses on their prompt's KV cache:
     the same logprobs and gradients as prompt + response rows, without computing each prompt n times (the
     tiny default's 36-token prompt is 60 % of its rows);
  5. gradient-norm clip, AdamW step per mini-batch (not for a mini-batch with no token in the loss, every response
     overlong-filtered: AdamW's momentum and weight decay would move the weights with no gradient); the
     learning-rate schedule (linear warm-up over `warmup_steps`, then constant) advances once per train_step:
     the paper counts warm-up in rollout steps, so every update of one step uses the same rate;
  6. the service advances the policy version (learner/policy.py: the trainer does not count versions).

With one mini-batch and one epoch (a single update) no no-grad pass runs at all.

Precision: master weights and AdamW state are fp32 everywhere (with the paper's lr = 1e-6 a bf16 weight cannot
represent one update: its relative resolution is ~4e-3). `model.dtype` is the compute and serving dtype: on a
GPU "auto" means bf16 autocast (accelerate mixed precision) and bf16 published weights; on CPU, fp32 throughout.

Distributed (`accelerate launch`, DDP or FSDP): every rank must call `train_step` with the same groups (the
service's main process reads the streams and broadcasts them). Each mini-batch is dealt across ranks by length;
ranks run the same number of forward passes (a rank with less work repeats one micro-batch with weight 0) so
FSDP's collectives stay in lockstep; the loss is scaled by the world size because DDP/FSDP average gradients.
DeepSpeed is refused: its engine owns gradient accumulation and clipping, which this trainer does itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.utils.rnn import pad_sequence

from learner import dapo
from services.weights_layout import fsync_dir, fsync_tree

if TYPE_CHECKING:  # pragma: no cover
    from services.config import Settings
    from services.messages import ScoredGroup

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 3  # 1 was accelerate's save_state (pickles); 2 kept a policy version of its own
STATE_DIR = "state"  # the exact training state, no pickle anywhere (a resume never unpickles):
MODEL_STATE = "model.safetensors"  # fp32 master weights, full (gathered under FSDP)
OPTIMIZER_STATE = "optimizer.safetensors"  # AdamW moments by parameter name; param groups as JSON metadata
SCHEDULER_STATE = "scheduler.json"
RNG_STATE = "rng-{rank}.safetensors"  # per rank: torch CPU/CUDA, numpy, python generators
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on the main process
_SCATTER = StateDictOptions(full_state_dict=True)  # every rank reads the full state and keeps its part
MODEL_DIR = "model"  # save_pretrained in the served dtype + tokenizer: loadable by vLLM / transformers
TRAINER_STATE = "trainer_state.json"  # format, extra_state (the caller's: step, policy version, ...)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MIXED_PRECISION = {torch.float32: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class _Response:
    """One response to train on, with everything its loss needs except the model's own logprobs."""

    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: Tensor  # [R] float32, mu
    advantage: float
    filtered: bool  # overlong-filtered: no token of it enters the loss (dapo.overlong_filter_mask)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_tokens(self) -> int:
        return 0 if self.filtered else len(self.response_ids)


@dataclass
class _Batch:
    responses: list[_Response]
    groups: int
    response_length_mean: float
    old_logprobs: dict[int, Tensor] = field(default_factory=dict)  # response index -> [R] pi_old
    ref_logprobs: dict[int, Tensor] = field(default_factory=dict)  # response index -> [R] pi_ref (kl_coef > 0)


@dataclass
class _MicroBatch:
    """Right-padded model inputs plus where each response token sits, flat and padded.

    Two layouts. Whole rows: input_ids are prompt + response, and `token_source` indexes the row's logits.
    Shared prompts (`prompt` set): input_ids are the responses alone, run on the KV cache of their prompt's pass;
    the logits of a row are [its prompt's last logits, the response's logits], which `token_source` indexes."""

    indices: list[int]
    input_ids: Tensor  # [B, L]: whole rows, or the responses (L = R) after a shared prompt pass
    attention_mask: Tensor  # [B, L], or [B, P + R] over the prompt block and the response
    position_ids: Tensor  # [B, L]
    token_row: Tensor  # [n] row of each response token
    token_source: Tensor  # [n] position in the row's logits that predicts it (t predicts t + 1)
    token_slot: Tensor  # [n] its index within the response (column of the padded [B, R] tensors)
    targets: Tensor  # [n] the response token ids
    response_mask: Tensor  # [B, R] 1.0 on response tokens
    prompt: "_PromptBlock | None" = None


@dataclass
class _PromptBlock:
    """The distinct prompts of a micro-batch, left-padded so every prompt's last token is the last column."""

    input_ids: Tensor  # [G, P]
    attention_mask: Tensor  # [G, P]
    position_ids: Tensor  # [G, P]
    of_row: Tensor  # [B] the prompt of each response row

    def to(self, device) -> "_PromptBlock":
        return _PromptBlock(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                     self.of_row)))


class Trainer:
    """The learner's model, optimizer and DAPO update. See the module docstring for the algorithm."""

    def __init__(self, settings: "Settings", model_path: Path):
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, set_seed
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.config = cfg = settings.learner
        self.model_path = Path(model_path)
        cuda = torch.cuda.is_available()
        self.compute_dtype = _DTYPES[settings.model.resolved_dtype(on_gpu=cuda)]
        self.served_dtype = self.compute_dtype
        from learner.tracking import accelerator_kwargs

        self.accelerator = Accelerator(
            mixed_precision=_MIXED_PRECISION[self.compute_dtype], step_scheduler_with_optimizer=False,
            **accelerator_kwargs(settings),  # experiment trackers (learner.report_to)
        )
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(
                "DeepSpeed is not supported by the DAPO trainer (its engine owns gradient accumulation and "
                "clipping); use an FSDP accelerate config instead"
            )
        self._set_cpu_threads()
        set_seed(cfg.seed)  # python, numpy, torch (the brief's torch.manual_seed, and the others)
        # Sampling temperature: the behaviour policy samples from softmax(z / T), so that is the policy whose
        # logprobs the learner must compute (T = 0, greedy, has no density: fall back to T = 1).
        self.temperature = settings.sampling.temperature if settings.sampling.temperature > 0 else 1.0
        if settings.sampling.top_p < 1.0:
            log.warning(
                "sampling.top_p=%g: the generators sample from the nucleus, which the learner's logprobs do not "
                "model, so the importance weights are biased (the paper trains at top_p 1)", settings.sampling.top_p
            )

        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=torch.float32, trust_remote_code=settings.model.trust_remote_code
        )
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        # Weight decay on every parameter, as verl (the paper's code) does.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, dapo.LinearWarmup(cfg.warmup_steps))
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # Two forward passes feed one backward: fine for DDP (each parameter's gradient hook fires once, on the
        # summed gradient); FSDP and gradient checkpointing (no KV cache in training) take whole rows.
        self.share_prompts = (cfg.share_prompt_pass and not cfg.gradient_checkpointing
                              and self.accelerator.distributed_type != DistributedType.FSDP)
        self.reference = None
        if cfg.kl_coef:
            # A frozen copy of the starting policy, only when the KL penalty is on (paper: off). A full replica
            # per rank (not sharded): fine for the model sizes where one would turn it on.
            self.reference = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.compute_dtype, trust_remote_code=settings.model.trust_remote_code
            ).to(self.accelerator.device)
            self.reference.requires_grad_(False).eval()

    @property
    def steps_done(self) -> int:
        """train_step calls so far (restored by load_checkpoint): the schedule's position."""
        return self.scheduler.last_epoch

    # -- public API --------------------------------------------------------------------------------------------
    def train_step(self, groups: Sequence["ScoredGroup"]) -> dict[str, float]:
        """One rollout step of DAPO on these groups (already filtered by dynamic sampling); returns metrics."""
        started = time.perf_counter()
        cfg = self.config
        batch = self._prepare(groups)
        mini_batches = self._mini_batches(batch)
        stats = _Stats()
        recompute_started = time.perf_counter()
        self._recompute(batch, mini_batches)
        stats.seconds["forward"] += time.perf_counter() - recompute_started
        lr = self.scheduler.get_last_lr()[0]

        for epoch in range(cfg.epochs):
            for mb in mini_batches:
                if not any(batch.responses[i].loss_tokens for i in mb):  # the same indices on every rank
                    stats.updates += 1
                    stats.skipped += 1
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                stats.loss += self._backward_mini_batch(batch, mb, stats, first_epoch=epoch == 0)
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
                grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
                stats.updates += 1
                if math.isfinite(grad_norm):
                    stepped_at = time.perf_counter()
                    self.optimizer.step()
                    stats.seconds["optimizer"] += time.perf_counter() - stepped_at
                    stats.grad_norm += grad_norm
                else:  # one bad mini-batch must not poison the weights
                    stats.skipped += 1
                    log.warning("train step %d: non-finite gradient norm, update skipped", self.steps_done + 1)
                self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

        totals = stats.reduced(self.accelerator)
        seconds = time.perf_counter() - started
        tokens = sum(r.loss_tokens for r in batch.responses)
        stepped = max(stats.updates - stats.skipped, 1)
        return {
            "loss": totals["loss"] / max(stats.updates, 1),
            "clip_frac_low": totals["clip_low"] / max(totals["tokens"], 1.0),
            "clip_frac_high": totals["clip_high"] / max(totals["tokens"], 1.0),
            "clip_frac_dual": totals["clip_dual"] / max(totals["tokens"], 1.0),
            "entropy": totals["entropy"] / max(totals["tokens"], 1.0),
            "approx_kl": totals["approx_kl"] / max(totals["tokens"], 1.0),
            "log_ratio_max": stats.log_ratio_max(self.accelerator),
            "tis_mean": totals["tis"] / max(totals["tis_tokens"], 1.0),
            "tis_capped_frac": totals["tis_capped"] / max(totals["tis_tokens"], 1.0),
            "grad_norm": stats.grad_norm / stepped,
            "lr": lr,
            "tokens": float(tokens),
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "response_length_mean": batch.response_length_mean,
            "step_seconds": seconds,
            "groups": float(batch.groups),
            "samples": float(len(batch.responses)),
            "updates": float(stats.updates),
            "skipped_updates": float(stats.skipped),
            **{f"{phase}_seconds": value for phase, value in stats.seconds.items()},  # this rank's
        }

    def loss_gradients(self, groups: Sequence["ScoredGroup"]) -> tuple[float, dict[str, Tensor]]:
        """Loss and gradient of the DAPO objective over `groups` as one mini-batch, without an update.

        pi_old is the current policy (ratio 1). A diagnostic: gradient checks and tests of accumulation.
        """
        batch = self._prepare(groups)
        indices = list(range(len(batch.responses)))
        self._recompute(batch, [indices])
        self.optimizer.zero_grad(set_to_none=True)
        stats = _Stats()
        stats.loss = self._backward_mini_batch(batch, indices, stats, first_epoch=True)
        loss = stats.reduced(self.accelerator)["loss"]  # each rank returned its share
        model = self.accelerator.unwrap_model(self.model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grads

    @torch.no_grad()
    def logprobs(self, groups: Sequence["ScoredGroup"]) -> list[list[list[float]]]:
        """The current policy's logprob of every response token: [group][sample][token]."""
        responses = []
        for g, group in enumerate(groups):
            prompt = _prompt_ids(group)
            for sample in group.rollout.samples:
                responses.append(_Response(g, prompt, list(sample.token_ids), torch.zeros(0), 0.0, False))
        values: dict[int, Tensor] = {}
        todo = [i for i, r in enumerate(responses) if r.response_ids]
        if not todo:
            return [[[] for _ in group.rollout.samples] for group in groups]
        for indices, real in self._lockstep([todo] * self.accelerator.num_processes, responses):
            logp, _ = self._forward(self.model, self._collate(responses, indices), entropy=False)
            if real:
                for row, i in enumerate(indices):
                    values[i] = logp[row, : len(responses[i].response_ids)].float().cpu()
        out: list[list[list[float]]] = [[] for _ in groups]
        for i, response in enumerate(responses):
            out[response.group].append(values[i].tolist() if response.response_ids else [])
        return out

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """HF parameter names -> CPU, contiguous tensors in the served dtype, copies (safe to serialize later).

        A tied alias (lm_head.weight of tied-embedding models) is dropped, as save_pretrained does. Under FSDP
        every rank must call this; the full dictionary is on the main process.
        """
        state = self.accelerator.get_state_dict(self.model)
        out: dict[str, Tensor] = {}
        seen: set[tuple] = set()
        for name, tensor in (state or {}).items():
            identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                        tuple(tensor.stride()))
            if identity in seen:
                continue
            seen.add(identity)
            out[name] = tensor.detach().to("cpu", self.served_dtype, copy=True).contiguous()
        return out

    def save_checkpoint(self, path: str | os.PathLike, extra_state: dict) -> None:
        """Write `path/` atomically: `state/` (exact fp32 training state: weights, AdamW, scheduler, RNG; safetensors
        and JSON, never a pickle, so that resuming cannot run code planted in a checkpoint),
        `model/` (save_pretrained in the served dtype + the tokenizer) and `trainer_state.json`.

        Written into `path.tmp/` then renamed, so a crash never leaves a half checkpoint under `path`.
        """
        path = Path(path)
        meta = json.dumps({"format": CHECKPOINT_FORMAT, "extra_state": extra_state})
        tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
        accelerator = self.accelerator
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / STATE_DIR).mkdir(parents=True)
        accelerator.wait_for_everyone()
        save_training_state(tmp / STATE_DIR, self.model, self.optimizer.optimizer, self.scheduler,
                            accelerator.is_main_process, accelerator.process_index)
        weights = self.state_dict_for_publish()
        # Every rank's files (its RNG state) are in `tmp` before rank 0 renames it: a slower rank would write
        # into a folder that is gone (seen in CI: rank 1 died, rank 0 hung in the barrier below).
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            model_dir = tmp / MODEL_DIR
            accelerator.unwrap_model(self.model).save_pretrained(model_dir, state_dict=weights)
            _set_config_dtype(model_dir, self.served_dtype)
            for name in TOKENIZER_FILES:
                if (self.model_path / name).is_file():
                    shutil.copy2(self.model_path / name, model_dir / name)
            (tmp / TRAINER_STATE).write_text(meta)
            # On disk before the renames make it the checkpoint (and before `latest` names it): after a power loss,
            # a renamed folder of empty files would be a checkpoint that cannot be loaded.
            fsync_tree(tmp)
            shutil.rmtree(old, ignore_errors=True)
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore weights, optimizer, scheduler and RNG from `save_checkpoint`; return extra_state."""
        path = _complete_checkpoint(Path(path))
        meta = json.loads((path / TRAINER_STATE).read_text())
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        load_training_state(path / STATE_DIR, self.model, self.optimizer.optimizer, self.scheduler,
                            self.accelerator.process_index)
        return meta["extra_state"]

    # -- batch preparation -------------------------------------------------------------------------------------
    def _prepare(self, groups: Sequence["ScoredGroup"]) -> _Batch:
        if not groups:
            raise ValueError("train_step needs at least one group")
        responses: list[_Response] = []
        lengths: list[int] = []
        for g, group in enumerate(groups):
            samples, scores = group.rollout.samples, group.scores
            if len(samples) != len(scores):
                raise ValueError(f"group {group.rollout.task.task_id}: {len(samples)} samples, {len(scores)} scores")
            prompt = _prompt_ids(group)
            advantages = dapo.group_advantages([s.reward for s in scores], eps=self.config.adv_eps)
            for sample, score, advantage in zip(samples, scores, advantages.tolist()):
                if len(sample.logprobs) != len(sample.token_ids):
                    raise ValueError(
                        f"group {group.rollout.task.task_id}: {len(sample.token_ids)} tokens but "
                        f"{len(sample.logprobs)} behaviour logprobs"
                    )
                lengths.append(len(sample.token_ids))
                if not sample.token_ids:
                    continue  # nothing to learn from an empty response (it still shaped the baseline)
                responses.append(_Response(
                    group=g,
                    prompt_ids=prompt,
                    response_ids=list(sample.token_ids),
                    behaviour_logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
                    advantage=advantage,
                    filtered=self.config.overlong_filter and score.overlong,
                ))
        return _Batch(responses, len(groups), sum(lengths) / max(len(lengths), 1))

    def _mini_batches(self, batch: _Batch) -> list[list[int]]:
        """Shuffle the groups (a generator seeded by seed and step: identical on every rank, reproducible)
        and split them into at most `mini_batches` near-equal runs of whole groups; response indices."""
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.steps_done)
        order = torch.randperm(batch.groups, generator=generator).tolist()
        count = max(1, min(self.config.mini_batches, batch.groups))
        by_group: dict[int, list[int]] = {}
        for i, response in enumerate(batch.responses):
            by_group.setdefault(response.group, []).append(i)
        chunks = [order[k * batch.groups // count:(k + 1) * batch.groups // count] for k in range(count)]
        mini = [[i for g in chunk for i in by_group.get(g, [])] for chunk in chunks]
        return [mb for mb in mini if mb]

    @torch.no_grad()
    def _recompute(self, batch: _Batch, mini_batches: list[list[int]]) -> None:
        """pi_old of the responses this rank will train on in every mini-batch but the first (its training forward
        gives it: `_backward_mini_batch`), and pi_ref of all of them when kl_coef > 0; no grad."""
        recomputed = mini_batches if self.reference is not None else mini_batches[1:]
        if not recomputed:
            return
        per_rank: list[list[int]] = [[] for _ in range(self.accelerator.num_processes)]
        for mb in recomputed:  # sharded exactly as training will shard them
            for rank, shard in enumerate(self._shard(mb, batch.responses)):
                per_rank[rank].extend(shard)
        for micro, real in self._lockstep(per_rank, batch.responses):
            inputs = self._collate(batch.responses, micro)
            logp, _ = self._forward(self.model, inputs, entropy=False)
            if self.reference is not None:
                with self.accelerator.autocast():
                    ref, _ = self._forward(self.reference, inputs, entropy=False)
            if real:
                for row, i in enumerate(micro):
                    n = len(batch.responses[i].response_ids)
                    batch.old_logprobs[i] = logp[row, :n].float()
                    if self.reference is not None:
                        batch.ref_logprobs[i] = ref[row, :n].float()

    # -- the update --------------------------------------------------------------------------------------------
    def _backward_mini_batch(self, batch: _Batch, indices: list[int], stats: "_Stats", first_epoch: bool) -> float:
        """Accumulate the gradient of one mini-batch's loss; returns the loss (this rank's share)."""
        cfg = self.config
        responses = batch.responses
        # Eq. (12): the normaliser is the whole mini-batch's (token | response) count, whatever the micro-batching.
        denominator = dapo.loss_denominator([responses[i].loss_tokens for i in indices], cfg.loss_agg)
        world = self.accelerator.num_processes
        plan = self._lockstep(self._shard(indices, responses), responses)
        total = 0.0
        for k, (micro, real) in enumerate(plan):
            sync = k == len(plan) - 1
            with contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model):
                forward_started = time.perf_counter()
                inputs = self._collate(responses, micro)
                logp, entropy = self._forward(self.model, inputs, entropy=True, entropy_grad=bool(cfg.entropy_coef))
                filtered = torch.tensor([responses[i].filtered for i in micro], device=logp.device)
                mask = dapo.overlong_filter_mask(inputs.response_mask, filtered)
                behaviour = self._padded([responses[i].behaviour_logprobs for i in micro], logp)
                for row, i in enumerate(micro):
                    current = logp[row, :len(responses[i].response_ids)].detach().float()
                    if i not in batch.old_logprobs:  # the step's first mini-batch, before any update: pi_old is now
                        batch.old_logprobs[i] = current
                    if not real and self.reference is not None:  # another rank's rows (weight 0): no pi_ref here
                        batch.ref_logprobs.setdefault(i, current)
                logp_old = self._padded([batch.old_logprobs[i] for i in micro], logp)
                logp_ref = self._padded([batch.ref_logprobs[i] for i in micro], logp) if self.reference else None
                advantages = torch.tensor([responses[i].advantage for i in micro], device=logp.device).unsqueeze(-1)
                tis = None if cfg.tis_cap is None else dapo.truncated_importance_weight(logp_old, behaviour, cfg.tis_cap)
                per_token, surrogate = dapo.token_loss(
                    logp, logp_old, advantages, tis,
                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                    kl_coef=cfg.kl_coef, logp_ref=logp_ref, entropy_coef=cfg.entropy_coef, entropy=entropy,
                )
                loss = dapo.aggregate_loss(per_token, mask, cfg.loss_agg, denominator)
                backward_started = time.perf_counter()
                stats.seconds["forward"] += backward_started - forward_started
                # DDP/FSDP average gradients over ranks: scale so that the average is the global sum / count.
                self.accelerator.backward(loss * (world if real else 0.0))
                stats.seconds["backward"] += time.perf_counter() - backward_started
            if real:
                total += float(loss.detach())
                stats.add_tokens(mask, surrogate, entropy, logp.detach(), behaviour, tis, cfg.tis_cap, first_epoch)
        return total

    # -- model plumbing ----------------------------------------------------------------------------------------
    def _forward(self, model, inputs: _MicroBatch, entropy: bool, entropy_grad: bool = False):
        """Logprobs (and optionally entropies) of the response tokens, padded to [B, R]."""
        # Train mode only where a gradient is taken (it is what turns gradient checkpointing on); RL fine-tuning
        # assumes a dropout-free model (Qwen2/2.5: 0), so both modes compute the same policy.
        model.train(torch.is_grad_enabled())
        prompt = inputs.prompt
        if prompt is None:
            out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                        position_ids=inputs.position_ids, use_cache=False)
            row_logits = out.logits
        else:
            # Each prompt once; its KV cache (and its last logits, which predict the first response token) copied
            # to its responses by index, so gradients from every response flow back into the one prompt pass.
            head = model(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask,
                         position_ids=prompt.position_ids, use_cache=True, logits_to_keep=1)
            cache = head.past_key_values
            cache.reorder_cache(prompt.of_row)
            out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                        position_ids=inputs.position_ids, past_key_values=cache, use_cache=True)
            row_logits = torch.cat([head.logits[prompt.of_row], out.logits], dim=1)
        # Only the positions that predict response tokens: [n, V] in fp32, at the sampling temperature.
        logits = row_logits[inputs.token_row, inputs.token_source].float() / self.temperature
        token_logp = logits.gather(-1, inputs.targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        shape = inputs.response_mask.shape
        logp = torch.zeros(shape, device=logits.device).index_put((inputs.token_row, inputs.token_slot), token_logp)
        token_h = None
        if entropy:
            with contextlib.nullcontext() if entropy_grad else torch.no_grad():
                h = dapo.token_entropy(logits)
                token_h = torch.zeros(shape, device=logits.device).index_put((inputs.token_row, inputs.token_slot), h)
        return logp, token_h

    def _collate(self, responses: list[_Response], indices: list[int]) -> _MicroBatch:
        device = self.accelerator.device
        rows = [responses[i] for i in indices]
        shared = self.share_prompts
        # Whole rows carry their prompt; shared rows hold the response alone (its prompt is in the prompt block).
        prefixes = [[] if shared else r.prompt_ids for r in rows]
        width = max(len(p) + len(r.response_ids) for p, r in zip(prefixes, rows))
        longest = max(len(r.response_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        response_mask = torch.zeros((len(rows), longest))
        token_row, token_source, token_slot, targets = [], [], [], []
        for b, (prefix, r) in enumerate(zip(prefixes, rows)):
            ids = prefix + r.response_ids
            input_ids[b, : len(ids)] = torch.tensor(ids)
            attention[b, : len(ids)] = 1
            n, start = len(r.response_ids), len(prefix)
            response_mask[b, :n] = 1.0
            token_row.append(torch.full((n,), b))
            # Logits at t predict token t + 1; shared rows' logits begin with the prompt's last position.
            token_source.append(torch.arange(n) if shared else torch.arange(start - 1, start - 1 + n))
            token_slot.append(torch.arange(n))
            targets.append(torch.tensor(r.response_ids))
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # right padding: 0..len-1, pads don't matter
        prompt = None
        if shared:
            prompt = self._prompt_block(rows)
            attention = torch.cat([prompt.attention_mask[prompt.of_row], attention], dim=1)
            lengths = prompt.attention_mask.sum(-1)[prompt.of_row]
            position_ids = position_ids + lengths.unsqueeze(-1)  # each response continues its own prompt
            prompt = prompt.to(device)
        return _MicroBatch(
            indices=list(indices),
            input_ids=input_ids.to(device), attention_mask=attention.to(device), position_ids=position_ids.to(device),
            token_row=torch.cat(token_row).to(device), token_source=torch.cat(token_source).to(device),
            token_slot=torch.cat(token_slot).to(device), targets=torch.cat(targets).to(device),
            response_mask=response_mask.to(device), prompt=prompt,
        )

    def _prompt_block(self, rows: list[_Response]) -> _PromptBlock:
        """The distinct prompts of `rows` (a group's responses share one), left-padded, and each row's prompt."""
        slot: dict[tuple[int, ...], int] = {}
        of_row = [slot.setdefault(tuple(r.prompt_ids), len(slot)) for r in rows]
        prompts = list(slot)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for g, ids in enumerate(prompts):
            input_ids[g, width - len(ids):] = torch.tensor(ids)
            attention[g, width - len(ids):] = 1
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: the prompt's tokens are 0..len-1
        return _PromptBlock(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                            of_row=torch.tensor(of_row))

    def _padded(self, values: list[Tensor], like: Tensor) -> Tensor:
        """Ragged [R_i] tensors -> [B, R] aligned with `like` (zeros beyond each length)."""
        out = torch.zeros_like(like, dtype=torch.float32)
        padded = pad_sequence([v.to(like.device, torch.float32) for v in values], batch_first=True)
        out[:, : padded.shape[1]] = padded
        return out

    def _shard(self, indices: list[int], responses: list[_Response]) -> list[list[int]]:
        """Deal responses to ranks longest first (balanced tokens); identical on every rank."""
        world = self.accelerator.num_processes
        ordered = sorted(indices, key=lambda i: -responses[i].length)
        return [ordered[rank::world] for rank in range(world)]

    def _pack(self, indices: list[int], responses: list[_Response]) -> list[list[int]]:
        """Micro-batches of at most micro_batch_tokens padded tokens (rows x longest row), longest first;
        a single sequence longer than the budget still gets its own micro-batch."""
        budget = self.config.micro_batch_tokens
        packs: list[list[int]] = []
        current: list[int] = []
        width = 0
        for i in sorted(indices, key=lambda i: -responses[i].length):
            length = responses[i].length
            if current and max(width, length) * (len(current) + 1) > budget:
                packs.append(current)
                current, width = [], 0
            current.append(i)
            width = max(width, length)
        if current:
            packs.append(current)
        return packs

    def _lockstep(self, per_rank: list[list[int]], responses: list[_Response]) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches, padded with weight-0 repeats to the busiest rank's count."""
        plans = [self._pack(ix, responses) for ix in per_rank]
        steps = max(len(p) for p in plans)
        if steps == 0:
            return []
        mine = plans[self.accelerator.process_index]
        filler = mine[0] if mine else next(p[0] for p in plans if p)
        return [(mine[k], True) if k < len(mine) else (filler, False) for k in range(steps)]

    def _set_cpu_threads(self) -> None:
        """On CPU, the learner's CPUs (OMP_NUM_THREADS when set: the launcher's or the container's CPU limit, else
        the CPUs this process may run on) shared among this node's ranks: one intra-op thread per CPU."""
        if self.accelerator.device.type != "cpu":
            return
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        budget = os.environ.get("OMP_NUM_THREADS")
        cores = int(budget) if budget and budget.isdigit() else cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes))
        torch.set_num_threads(max(1, cores // max(local, 1)))


class _Stats:
    """Running sums for the step's metrics (per-token sums over loss tokens; reduced over ranks at the end)."""

    KEYS = ("loss", "tokens", "clip_low", "clip_high", "clip_dual", "entropy", "approx_kl",
            "tis", "tis_capped", "tis_tokens")

    def __init__(self):
        self.sums = dict.fromkeys(self.KEYS, 0.0)
        self.loss = 0.0
        self.updates = 0
        self.skipped = 0
        self.grad_norm = 0.0
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # forward includes pi_old's pass
        self.largest_log_ratio = 0.0  # max |log pi - log mu| over the loss tokens: few tokens or the whole policy?

    def add_tokens(self, mask, surrogate, entropy, logp, behaviour, tis, cap, first_epoch) -> None:
        s = self.sums
        s["tokens"] += float(mask.sum())
        for key, count in dapo.clip_counts(surrogate, mask).items():
            s[key] += count
        s["entropy"] += float((entropy.detach() * mask).sum())
        s["approx_kl"] += float((dapo.kl_k3(behaviour, logp) * mask).sum())  # KL(behaviour || current)
        self.largest_log_ratio = max(self.largest_log_ratio, float(((logp - behaviour).abs() * mask).max()))
        if first_epoch:  # the weights are constant over the step: count each token once
            s["tis"] += float(((1.0 if tis is None else tis) * mask).sum())  # no weight (tis_cap null): 1
            if tis is not None:
                s["tis_capped"] += float(((tis >= cap * (1 - 1e-6)) * mask).sum())
            s["tis_tokens"] += float(mask.sum())

    def log_ratio_max(self, accelerator) -> float:
        """The largest |log pi - log mu| of the step over all ranks. approx_kl is a mean, and k3 grows like the
        ratio itself: one token the behaviour policy sampled at e^-10 of the learner's probability lifts it to
        ~1 over 10^4 tokens. A spike with this near 10 is a few tokens; with this near 1, the policy drifted."""
        if accelerator.num_processes == 1:
            return self.largest_log_ratio
        value = torch.tensor([self.largest_log_ratio], device=accelerator.device, dtype=torch.float64)
        return float(accelerator.gather(value).max())

    def reduced(self, accelerator) -> dict[str, float]:
        values = dict(self.sums, loss=self.loss)
        if accelerator.num_processes == 1:
            return values
        keys = list(values)
        tensor = torch.tensor([values[k] for k in keys], device=accelerator.device, dtype=torch.float64)
        tensor = accelerator.reduce(tensor, reduction="sum")
        return dict(zip(keys, tensor.tolist()))


def save_training_state(folder: Path, model, optimizer, scheduler, is_main: bool, rank: int) -> None:
    """The exact training state as safetensors and JSON. Every rank takes part (under FSDP the full weights and
    AdamW moments are gathered on the main process, which writes them); each rank writes its RNG state."""
    model_state = get_model_state_dict(model, options=_GATHER)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if is_main:
        save_file(_unaliased(model_state), folder / MODEL_STATE)
        tensors, meta = _flatten_optimizer_state(optimizer_state)
        save_file(tensors, folder / OPTIMIZER_STATE, metadata={"json": json.dumps(meta)})
        (folder / SCHEDULER_STATE).write_text(json.dumps(scheduler.state_dict()))
    tensors, meta = _rng_state()
    save_file(tensors, folder / RNG_STATE.format(rank=rank), metadata={"json": json.dumps(meta)})


def load_training_state(folder: Path, model, optimizer, scheduler, rank: int) -> None:
    """Every rank reads the full state and keeps its part (its shard under FSDP), and its own RNG state."""
    set_model_state_dict(model, load_file(folder / MODEL_STATE), options=_SCATTER)
    state = _unflatten_optimizer_state(*_read_tensors(folder / OPTIMIZER_STATE))
    set_optimizer_state_dict(model, optimizer, state, options=_SCATTER)
    scheduler.load_state_dict(json.loads((folder / SCHEDULER_STATE).read_text()))
    rng = folder / RNG_STATE.format(rank=rank)
    written_by = len(list(folder.glob(RNG_STATE.format(rank="*"))))
    if rng.is_file() or rank < written_by:  # a rank that wrote the checkpoint must find its file (else: damaged)
        _set_rng_state(*_read_tensors(rng))
    else:  # resumed on more ranks than wrote the checkpoint: weights and optimizer are whole, this RNG is new
        log.warning("%s: no RNG state for rank %d (written by %d ranks); it keeps its seeded one", folder, rank,
                    written_by)


def _prompt_ids(group: "ScoredGroup") -> list[int]:
    ids = group.rollout.task.prompt_token_ids
    if not ids:
        raise ValueError(f"task {group.rollout.task.task_id}: prompt_token_ids are required by the learner")
    return list(ids)


def _complete_checkpoint(path: Path) -> Path:
    """`path`, or after a crash between save_checkpoint's two renames, the complete copy that survived:
    `path.tmp` once its trainer_state.json (written last) exists, else the previous `path.old`."""
    if path.exists():
        return path
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if (tmp / TRAINER_STATE).is_file():
        return tmp
    if (old / TRAINER_STATE).is_file():
        return old
    raise FileNotFoundError(f"no checkpoint at {path}")


def _unaliased(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every name kept (a strict load needs them all); a tensor sharing storage with an earlier one (tied
    weights) is cloned, as safetensors refuses shared storage."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return out


def _flatten_optimizer_state(state: dict) -> tuple[dict[str, Tensor], dict]:
    """A name-keyed optimizer state dict as tensors (`{parameter}/{slot}`) and JSON (param groups, any
    non-tensor slot)."""
    tensors, other = {}, {}
    for parameter, slots in state["state"].items():
        for slot, value in slots.items():
            if isinstance(value, Tensor):
                tensors[f"{parameter}/{slot}"] = value.detach().cpu().contiguous()
            else:
                other.setdefault(parameter, {})[slot] = value
    return tensors, {"param_groups": state["param_groups"], "other": other}


def _unflatten_optimizer_state(tensors: dict[str, Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for key, tensor in tensors.items():
        parameter, slot = key.rsplit("/", 1)
        state.setdefault(parameter, {})[slot] = tensor
    for parameter, slots in meta["other"].items():
        state.setdefault(parameter, {}).update(slots)
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state() -> tuple[dict[str, Tensor], dict]:
    """This process's random generators: torch (CPU, each CUDA device) and numpy as tensors, python's as JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, python_gauss = random.getstate()
    return tensors, {"python": [version, list(internal), python_gauss],
                     "numpy": [kind, int(position), int(has_gauss), float(gauss)]}


def _set_rng_state(tensors: dict[str, Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(torch.cuda.device_count()) if f"cuda.{i}" in tensors]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    kind, position, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), position, has_gauss, gauss))
    version, internal, python_gauss = meta["python"]
    random.setstate((version, tuple(internal), python_gauss))


def _read_tensors(path: Path) -> tuple[dict[str, Tensor], dict]:
    """A safetensors file written with `metadata={"json": ...}`: its tensors and that JSON."""
    with safe_open(path, framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, json.loads(handle.metadata()["json"])


def _set_config_dtype(model_dir: Path, dtype: torch.dtype) -> None:
    """save_pretrained records the in-memory (fp32 master) dtype; the files hold the served dtype."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
