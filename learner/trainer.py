"""The DAPO trainer: turns scored groups into optimizer steps (torch + accelerate).

One `train_step(groups)` is one rollout step of the paper (Algorithm 1, the inner loop):
  1. sequences = prompt tokens + response tokens; advantages per group from the rewards, Eq. (9); with
     `overlong_filter`, truncated responses leave the loss and are never run (their rewards still set the group
     baseline);
  2. pi_old = the learner's logprobs of the response tokens under the step's starting parameters: recomputed
     (no grad) for every mini-batch but the first, which trains before any update, so that its own forward
     pass gives pi_old (same value, one forward of 1/M of the batch less);
     TIS weight = min(pi_old / mu, tis_cap) against the behaviour logprobs mu the generator recorded (none when
     tis_cap is null);
  3. the groups are shuffled and split into `mini_batches` mini-batches of whole groups (the paper's 512 prompts
     make 16 mini-batches of 32 prompts x 16 responses); one AdamW update per mini-batch, `epochs` passes;
  4. each mini-batch is cut into micro-batches of at most `micro_batch_tokens` tokens (learner/packing.py): on a
     GPU rows are packed without padding (attention confined to each row), on a CPU right-padded, where the
     shared prompt pass runs each distinct prompt once and its responses on the prompt's KV cache (the tiny
     default's 36-token prompt is 60 % of its rows). Every layout gives the same logprobs and gradients. Only the
     positions that predict response tokens go through the LM head, in chunks (learner/logprobs.py). Every
     micro-batch loss is divided by the *mini-batch's* token count (Eq. 12) or response count (sample level), so
     the accumulated gradient equals the gradient of the whole mini-batch at once; the step's statistics stay on
     the device until its end; each micro-batch's tensors are built on the host when it is collated and copied
     from pinned memory without waiting; a non-finite gradient norm skips its update (step 5) in a GPU's fused
     AdamW kernel, so no update waits for the device before the step's metrics (on a CPU each reads its norm);
  5. gradient-norm clip, AdamW step per mini-batch (not for a mini-batch with no token in the loss, every response
     overlong-filtered: AdamW's momentum and weight decay would move the weights with no gradient); the
     learning-rate schedule (linear warm-up over `warmup_steps`, then constant) advances once per train_step:
     the paper counts warm-up in rollout steps, so every update of one step uses the same rate;
  6. the service advances the policy version (learner/policy.py: the trainer does not count versions).

With one mini-batch and one epoch (a single update) no no-grad pass runs at all.

Precision: master weights and AdamW state are fp32 (at lr 1e-6 a bf16 weight cannot hold one update). On a GPU
"auto" computes and serves in bf16 (autocast, or FSDP2's parameter dtype: learner/sharding.py); the head's logprobs
and entropies are fp32 in every mode; on a CPU, fp32 throughout.

Distributed (`accelerate launch`: DDP, or the trainer's own FSDP2 with `learner.compute.fsdp`): every rank calls
`train_step` with the same groups (the service's main process broadcasts them); each mini-batch is dealt across
ranks by cost (tokens, and attention's square), every rank runs the same number of forward passes (weight-0
repeats), and the loss is scaled by the world size because DDP and FSDP average gradients. Under FSDP each
micro-batch's gradient is reduce-scattered at once (`learner.compute.gradient_sync: mini_batch` keeps it whole until
the last). With `learner.compute.sequence_parallel` groups of ranks split each pack's tokens
(learner/sequence_parallel.py). DeepSpeed is refused: its engine owns accumulation and clipping. Checkpoints:
learner/checkpoint.py; every step reports its model TFLOP/s and MFU (learner/throughput.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from learner import activation_checkpointing, attention, dapo, devices, packing, sequence_parallel, sharding, throughput
from learner.logprobs import install_head, response_logprobs
from learner.packing import MicroBatch, Response
from learner.update_stats import UpdateStats
from services.weights import checkpoint_names, unique_tensors

if TYPE_CHECKING:  # pragma: no cover
    from services.config import Settings
    from services.messages import ScoredGroup

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MIXED_PRECISION = {torch.float32: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class _Responses:
    """The step's responses (the groups flattened), and their pi_old and pi_ref once the no-grad pass computed them."""

    responses: list[Response]
    groups: int
    response_length_mean: float
    old_logprobs: dict[int, Tensor] = field(default_factory=dict)  # response index -> [R] pi_old
    ref_logprobs: dict[int, Tensor] = field(default_factory=dict)  # response index -> [R] pi_ref (kl_coef > 0)

    def in_loss(self, indices: list[int]) -> list[int]:
        """The responses with a token in the loss: the overlong-filtered ones are never run (the model's work would
        be multiplied by a zero mask), though they set their group's baseline and their mini-batch's membership."""
        return [i for i in indices if self.responses[i].loss_tokens]


class Trainer:
    """The learner's model, optimizer and DAPO update. See the module docstring for the algorithm."""

    def __init__(self, settings: "Settings", model_path: Path, *, model=None, gpu: bool | None = None):
        """The learner's model at `model_path`, or `model` as built by the caller on the device kind `gpu` says
        (`dapo plan`: a model of fake tensors, planned for a GPU on a machine without one; learner/plan.py)."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.config = cfg = settings.learner
        self.model_path = Path(model_path)
        cuda = torch.cuda.is_available() if gpu is None else gpu
        self.compute_dtype = _DTYPES[settings.model.resolved_dtype(on_gpu=cuda)]
        self.served_dtype = self.compute_dtype
        from learner.tracking import accelerator_kwargs

        # Under FSDP the precision is FSDP2's parameter dtype (learner/sharding.py), not accelerate's autocast.
        self.accelerator = Accelerator(
            mixed_precision="no" if cfg.compute.fsdp else _MIXED_PRECISION[self.compute_dtype],
            step_scheduler_with_optimizer=False,
            **accelerator_kwargs(settings),  # experiment trackers (learner.report_to)
        )
        devices.check_accelerator(self.accelerator)
        devices.share_cpu_threads(self.accelerator)
        set_seed(cfg.seed)  # python, numpy, torch (the brief's torch.manual_seed, and the others)
        # Sampling temperature: the behaviour policy samples from softmax(z / T), so that is the policy whose
        # logprobs the learner must compute (T = 0, greedy, has no density: fall back to T = 1).
        self.temperature = settings.sampling.temperature if settings.sampling.temperature > 0 else 1.0
        if settings.sampling.top_p < 1.0:
            log.warning(
                "sampling.top_p=%g: the generators sample from the nucleus, which the learner's logprobs do not "
                "model (the paper trains at top_p 1)", settings.sampling.top_p
            )
        packed = cfg.compute.packing == "on" or (cfg.compute.packing == "auto" and cuda)
        degree = cfg.compute.sequence_parallel
        placement = None if model is None else [False, False]  # a caller's model stays where the caller put it
        if model is None:
            self.attention = attention.implementation(cfg.compute.attention, cuda, packed, self.compute_dtype)
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=torch.float32, trust_remote_code=settings.model.trust_remote_code,
                attn_implementation=sequence_parallel.loaded_attention(self.attention, degree),
            )
        else:
            self.attention = model.config._attn_implementation
        self.sequence = sequence_parallel.join(model, degree, packed, self.attention, cuda)
        activation_checkpointing.prepare_layers(model, cfg.compute.gradient_checkpointing, cfg.compute.compile)
        self.parameter_counts = throughput.parameter_counts(model)
        # The head scores response positions only, in chunks (learner/logprobs.py); installed before any wrapping.
        self.heads = {}
        head = install_head(model, self.temperature, cfg.compute.head_chunk_tokens, cfg.compute.compile)
        self.sharded = cfg.compute.fsdp
        if self.sharded:  # before the optimizer: it holds the shards
            world = dist.get_world_size() if dist.is_initialized() else 1  # accelerate's ranks (or `dapo plan`'s)
            mesh = sharding.device_mesh(world, cfg.compute.fsdp_shard_ranks, self.accelerator.device.type,
                                        cfg.compute.fsdp_offload)
            sharding.shard(model, cfg.compute, self.compute_dtype, mesh, self.accelerator.device)
        # Weight decay on every parameter, as verl (the paper's code) does. On a GPU the fused kernel: one pass
        # over weights, gradients and moments instead of a foreach kernel for each AdamW operation.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.adam_betas),
            weight_decay=cfg.optimizer.weight_decay, fused=True if cuda else None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, dapo.LinearWarmup(cfg.optimizer.warmup_steps))
        self.skips_on_device = bool(optimizer.defaults.get("fused"))  # a non-finite step (train_step)
        if self.sharded:  # accelerate must not wrap the sharded model again (in DDP) or autocast its forward
            self.model, self.optimizer = model, self.accelerator.prepare_optimizer(optimizer)
        else:
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer, device_placement=placement)
        self.heads[id(self.model)] = head
        # Two forward passes feed one backward: fine for DDP (each parameter's gradient hook fires once, on the
        # summed gradient); FSDP and gradient checkpointing (no KV cache in training) take whole rows, and so do
        # compiled layers (a KV cache of every prompt length recompiles them past torch's limit).
        self.share_prompts = (cfg.compute.share_prompt_pass and cfg.compute.gradient_checkpointing == "off"
                              and not cfg.compute.compile and not self.sharded)
        layout: packing.Layout = "packed" if packed else "shared" if self.share_prompts else "padded"
        self.varlen = self.attention in (attention.VARLEN, "flash_attention_2")
        self.packer = packing.Packer(  # (a pack splits into `degree` equal shares: its length a multiple)
            layout, cfg.compute.micro_batch_tokens, pad_token_id=model.config.pad_token_id or 0,
            bucket=math.lcm(packing.length_bucket(layout, cuda, self.varlen, cfg.compute.micro_batch_tokens), degree),
            device=self.accelerator.device, world=max(1, self.accelerator.num_processes // degree),
            rank=self.accelerator.process_index // degree, sequence_degree=degree, sequence_index=self.sequence.rank,
            attention_crossover=throughput.attention_crossover(model.config, self.parameter_counts[0]))
        self.peak_tflops = throughput.peak_tflops(self.accelerator.device, cfg.compute.peak_tflops)
        self.reference = None
        if cfg.loss.kl_coef:
            # A frozen copy of the starting policy, only when the KL penalty is on (paper: off). A full replica
            # per rank (not sharded): fine for the model sizes where one would turn it on.
            self.reference = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.compute_dtype, trust_remote_code=settings.model.trust_remote_code,
                attn_implementation=model.config._attn_implementation,
            )
            self.heads[id(self.reference)] = install_head(self.reference, self.temperature,
                                                           cfg.compute.head_chunk_tokens, cfg.compute.compile)
            self.reference.to(self.accelerator.device).requires_grad_(False).eval()

    @property
    def steps_done(self) -> int:
        """train_step calls so far (restored by checkpoint.read): the schedule's position."""
        return self.scheduler.last_epoch

    # -- public API --------------------------------------------------------------------------------------------
    def train_step(self, groups: Sequence["ScoredGroup"]) -> dict[str, float]:
        """One rollout step of DAPO on these groups (already filtered by dynamic sampling); returns metrics."""
        started = time.perf_counter()
        cfg = self.config
        batch = self.prepare(groups)
        mini_batches = self._mini_batches(batch)
        stats = UpdateStats(self.accelerator.device)
        recompute_started = time.perf_counter()
        self._old_logprobs_pass(batch, mini_batches, stats)
        stats.seconds["forward"] += time.perf_counter() - recompute_started
        lr = self.scheduler.get_last_lr()[0]

        for epoch in range(cfg.batch.epochs):
            for mb in mini_batches:
                if not any(batch.responses[i].loss_tokens for i in mb):  # the same indices on every rank
                    stats.updates += 1
                    stats.skipped += 1
                    continue
                finite = stats.add_norm(self._clipped_gradient(batch, mb, stats, first_epoch=epoch == 0))
                stepped_at = time.perf_counter()
                if self.skips_on_device:  # a non-finite norm skips the update in fused AdamW's kernel: no host read
                    self.scheduler.optimizer.found_inf = (~finite).float()
                    self.optimizer.step()
                elif bool(finite):  # one bad mini-batch must not poison the weights (read here: no device skip)
                    self.optimizer.step()
                stats.seconds["optimizer"] += time.perf_counter() - stepped_at
                self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

        seconds = time.perf_counter() - started
        tokens = sum(r.loss_tokens for r in batch.responses)
        return {
            **stats.metrics(self.accelerator, self.parameter_counts, seconds, self.peak_tflops),
            "lr": lr,
            "tokens": float(tokens),
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "response_length_mean": batch.response_length_mean,
            "step_seconds": seconds,
            "groups": float(batch.groups),
            "samples": float(len(batch.responses)),
            **({"compiled_graphs": float(activation_checkpointing.compiled_graphs())} if cfg.compute.compile else {}),
        }

    def update_without_reads(self, batch: _Responses) -> None:
        """One update on a prepared batch as one mini-batch, as `train_step` makes it, but reading nothing back from
        the device (no skip of a non-finite update, no metrics): what `dapo plan` runs under fake tensors, where a
        read has no value (learner/plan.py)."""
        self._clipped_gradient(batch, list(range(len(batch.responses))), UpdateStats(self.accelerator.device),
                               first_epoch=True)
        self.scheduler.optimizer.found_inf = None  # a skip decided in train_step does not carry over
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def loss_gradients(self, groups: Sequence["ScoredGroup"]) -> tuple[float, dict[str, Tensor]]:
        """Loss and gradient of the DAPO objective over `groups` as one mini-batch, without an update.

        pi_old is the current policy (ratio 1). A diagnostic: gradient checks and tests of accumulation.
        """
        batch = self.prepare(groups)
        indices = list(range(len(batch.responses)))
        stats = UpdateStats(self.accelerator.device)
        self._old_logprobs_pass(batch, [indices], stats)
        self.optimizer.zero_grad(set_to_none=True)
        self._backward_mini_batch(batch, indices, stats, first_epoch=True)
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
                responses.append(Response(g, prompt, list(sample.token_ids), torch.zeros(0), 0.0, False))
        values: dict[int, Tensor] = {}
        todo = [i for i, r in enumerate(responses) if r.response_ids]
        if not todo:
            return [[[] for _ in group.rollout.samples] for group in groups]
        for indices, real in self.packer.lockstep([todo] * self.accelerator.num_processes, responses):
            logp = self.sequence.complete(self._forward(self.model, self.packer.collate(responses, indices), False)[0])
            if real:
                for row, i in enumerate(indices):
                    values[i] = logp[row, : len(responses[i].response_ids)].float().cpu()
        out: list[list[list[float]]] = [[] for _ in groups]
        for i, response in enumerate(responses):
            out[response.group].append(values[i].tolist() if response.response_ids else [])
        return out

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """HF checkpoint names -> CPU, contiguous tensors in the served dtype, copies (safe to serialize later).

        Each tensor once (`services.weights.unique_tensors`: a tied alias dropped). Under FSDP
        every rank must call this; each rank casts its shard to the served dtype, then they gather one parameter at a
        time (bf16: half the bytes of the fp32 master); the main process keeps each copy on the host (the served
        model), the other ranks drop each gathered parameter at once. The full dictionary is on the main process.
        """
        from torch.distributed.tensor import DTensor

        model = self.accelerator.unwrap_model(self.model)
        main = self.accelerator.is_main_process
        out: dict[str, Tensor] = {}
        for name, value in unique_tensors(model).items():
            if isinstance(value, DTensor):
                value = value.to(self.served_dtype).full_tensor()  # a collective: every rank, in the same order
            if main:
                out[name] = value.to("cpu", self.served_dtype, copy=True).contiguous()
        return checkpoint_names(model, out) if main else out

    # -- batch preparation -------------------------------------------------------------------------------------
    def prepare(self, groups: Sequence["ScoredGroup"]) -> _Responses:
        """The groups as the step's responses, with their advantages (Eq. 9): host work, no device read."""
        if not groups:
            raise ValueError("train_step needs at least one group")
        responses: list[Response] = []
        lengths: list[int] = []
        for g, group in enumerate(groups):
            samples, scores = group.rollout.samples, group.scores
            if len(samples) != len(scores):
                raise ValueError(f"group {group.rollout.task.task_id}: {len(samples)} samples, {len(scores)} scores")
            prompt = _prompt_ids(group)
            advantages = dapo.group_advantages([s.reward for s in scores], eps=self.config.loss.adv_eps)
            for sample, score, advantage in zip(samples, scores, advantages.tolist()):
                if len(sample.logprobs) != len(sample.token_ids):
                    raise ValueError(
                        f"group {group.rollout.task.task_id}: {len(sample.token_ids)} tokens but "
                        f"{len(sample.logprobs)} behaviour logprobs"
                    )
                lengths.append(len(sample.token_ids))
                if not sample.token_ids:
                    continue  # nothing to learn from an empty response (it still shaped the baseline)
                responses.append(Response(
                    group=g,
                    prompt_ids=prompt,
                    response_ids=list(sample.token_ids),
                    behaviour_logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
                    advantage=advantage,
                    filtered=self.config.loss.overlong_filter and score.overlong,
                ))
        return _Responses(responses, len(groups), sum(lengths) / max(len(lengths), 1))

    def _mini_batches(self, batch: _Responses) -> list[list[int]]:
        """Shuffle the groups (a generator seeded by seed and step: identical on every rank, reproducible)
        and split them into at most `mini_batches` near-equal runs of whole groups; response indices."""
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.steps_done)
        order = torch.randperm(batch.groups, generator=generator).tolist()
        count = max(1, min(self.config.batch.mini_batches, batch.groups))
        by_group: dict[int, list[int]] = {}
        for i, response in enumerate(batch.responses):
            by_group.setdefault(response.group, []).append(i)
        chunks = [order[k * batch.groups // count:(k + 1) * batch.groups // count] for k in range(count)]
        mini = [[i for g in chunk for i in by_group.get(g, [])] for chunk in chunks]
        return [mb for mb in mini if mb]

    @torch.no_grad()
    def _old_logprobs_pass(self, batch: _Responses, mini_batches: list[list[int]], stats: UpdateStats) -> None:
        """pi_old of the responses this rank will train on in every mini-batch but the first (its training forward
        gives it: `_backward_mini_batch`), and pi_ref of all of them when kl_coef > 0; no grad."""
        recomputed = mini_batches if self.reference is not None else mini_batches[1:]
        if not recomputed:
            return
        per_rank: list[list[int]] = [[] for _ in range(self.accelerator.num_processes)]
        for mb in recomputed:  # sharded exactly as training will shard them
            for rank, shard in enumerate(self.packer.shard(batch.in_loss(mb), batch.responses)):
                per_rank[rank].extend(shard)
        for micro, real in self.packer.lockstep(per_rank, batch.responses):
            inputs = self.packer.collate(batch.responses, micro)
            # Every share's values (sequence parallelism): training packs these tokens otherwise.
            logp = self.sequence.complete(self._forward(self.model, inputs, entropy=False)[0])
            if real:  # a filler (weight 0, another rank's rows) is not this step's work: training counts none either
                stats.count(inputs, trained=False)
            if self.reference is not None:
                with self.accelerator.autocast():
                    ref = self.sequence.complete(self._forward(self.reference, inputs, entropy=False)[0])
            if real:
                for row, i in enumerate(micro):
                    n = len(batch.responses[i].response_ids)
                    batch.old_logprobs[i] = logp[row, :n].float()
                    if self.reference is not None:
                        batch.ref_logprobs[i] = ref[row, :n].float()

    # -- the update --------------------------------------------------------------------------------------------
    def _clipped_gradient(self, batch: _Responses, indices: list[int], stats: UpdateStats, first_epoch: bool) -> Tensor:
        """The mini-batch's gradient, clipped to grad_clip; its norm before clipping (a device tensor)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._backward_mini_batch(batch, indices, stats, first_epoch)
        max_norm = self.config.optimizer.grad_clip if self.config.optimizer.grad_clip > 0 else math.inf
        return self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    def _backward_mini_batch(self, batch: _Responses, indices: list[int], stats: UpdateStats,
                             first_epoch: bool) -> None:
        """Accumulate the gradient of one mini-batch's loss; its loss (this rank's share) goes to `stats`."""
        cfg = self.config
        responses = batch.responses
        # Eq. (12): the normaliser is the whole mini-batch's (token | response) count, whatever the micro-batching.
        denominator = dapo.loss_denominator([responses[i].loss_tokens for i in indices], cfg.loss.loss_agg)
        world = self.accelerator.num_processes
        plan = self.packer.lockstep(self.packer.shard(batch.in_loss(indices), responses), responses)
        for k, (micro, real) in enumerate(plan):
            sync = k == len(plan) - 1
            if self.sharded:  # FSDP2: reduce-scatter now (a rank keeps its gradient shard only), or on the last
                self.model.set_requires_gradient_sync(sync or cfg.compute.gradient_sync == "micro_batch")
            with contextlib.nullcontext() if sync or self.sharded else self.accelerator.no_sync(self.model):
                forward_started = time.perf_counter()
                inputs = self.packer.collate(responses, micro)
                logp, entropy = self._forward(self.model, inputs, entropy=True,
                                              entropy_grad=bool(cfg.loss.entropy_coef))
                mask = inputs.response_mask
                behaviour = self._padded([responses[i].behaviour_logprobs for i in micro], logp)
                whole = self.sequence.complete(logp.detach())  # (each share's values, under sequence parallelism)
                for row, i in enumerate(micro):
                    current = whole[row, :len(responses[i].response_ids)].float()
                    if i not in batch.old_logprobs:  # the step's first mini-batch, before any update: pi_old is now
                        batch.old_logprobs[i] = current
                    if not real and self.reference is not None:  # another rank's rows (weight 0): no pi_ref here
                        batch.ref_logprobs.setdefault(i, current)
                logp_old = self._padded([batch.old_logprobs[i] for i in micro], logp)
                logp_ref = self._padded([batch.ref_logprobs[i] for i in micro], logp) if self.reference else None
                tis = (None if cfg.loss.tis_cap is None
                       else dapo.truncated_importance_weight(logp_old, behaviour, cfg.loss.tis_cap))
                per_token, surrogate = dapo.token_loss(
                    logp, logp_old, inputs.advantages, tis,
                    clip_low=cfg.loss.clip_low, clip_high=cfg.loss.clip_high, dual_clip=cfg.loss.dual_clip,
                    kl_coef=cfg.loss.kl_coef, logp_ref=logp_ref, entropy_coef=cfg.loss.entropy_coef, entropy=entropy,
                )
                loss = dapo.aggregate_loss(per_token, mask, cfg.loss.loss_agg, denominator, inputs.response_tokens)
                backward_started = time.perf_counter()
                stats.seconds["forward"] += backward_started - forward_started
                # DDP/FSDP average gradients over ranks: scale so that the average is the global sum / count.
                self.accelerator.backward(loss * (world if real else 0.0))
                stats.seconds["backward"] += time.perf_counter() - backward_started
            if real:
                stats.count(inputs, trained=True)
                stats.add_tokens(loss, mask, surrogate, entropy, logp.detach(), behaviour, tis, cfg.loss.tis_cap,
                                 first_epoch)

    # -- model plumbing ----------------------------------------------------------------------------------------
    def _forward(self, model, inputs: MicroBatch, entropy: bool, entropy_grad: bool = False):
        """Logprobs (and optionally entropies) of the response tokens, padded to [B, R] (learner/logprobs.py)."""
        return response_logprobs(model, self.heads[id(model)], inputs, self.varlen, entropy, entropy_grad,
                                 self.sequence)

    def _padded(self, values: list[Tensor], like: Tensor) -> Tensor:
        """Ragged [R_i] tensors -> [B, R] aligned with `like` (zeros beyond each length)."""
        out = torch.zeros_like(like, dtype=torch.float32)
        padded = pad_sequence([v.to(like.device, torch.float32, non_blocking=True) for v in values],
                              batch_first=True)
        out[:, : padded.shape[1]] = padded
        return out


def _prompt_ids(group: "ScoredGroup") -> list[int]:
    ids = group.rollout.task.prompt_token_ids
    if not ids:
        raise ValueError(f"task {group.rollout.task.task_id}: prompt_token_ids are required by the learner")
    return list(ids)
