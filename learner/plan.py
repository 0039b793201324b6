"""`dapo plan PRESET --gpus N`: whether the learner's step fits the GPUs, found by running it, before renting them.

What runs is the learner's own step (`Trainer.update_without_reads`): the preset's model (its config only, no
weights: shipped in services/configs/models, or read from a local folder), built of fake tensors
(`FakeTensorMode`: shapes, dtypes and devices, no storage, no arithmetic) on a fake process group of the learner's
ranks, wrapped as the trainer wraps it (FSDP2 and its precision policy, activation checkpointing, the chunked
head), AdamW, and one update accumulating two of rank 0's heaviest micro-batch: the longest row the preset allows (a
full prompt and `sampling.max_tokens`) packed with others up to `micro_batch_tokens`, so that the second runs while
the first one's gradient is held, as in a run's mini-batches. PyTorch's `FSDPMemTracker` (or `MemTracker` without
FSDP) counts every tensor alive by category; the plan reports rank 0's peak.

What the fake tensors cannot trace is added by a stated formula, and the report says so:
- attention: the trainer's varlen FlashAttention kernel has no fake implementation on a machine without CUDA, so a
  stand-in with its memory runs instead (it returns the output and keeps q, k, v, the output and the fp32
  logsumexp for backward, as flash does: O(tokens), no [T x T] matrix);
- the runtime: CUDA context, NCCL buffers and the caching allocator's slack, `RUNTIME_GIB`;
- compiled layers (`learner.compute.compile`) run uncompiled here: inductor fuses temporaries away, so the plan
  is an upper bound for them;
- FSDP's CPU offload: fake tensors live on one device (a fake CUDA device aborts a CPU-only torch), so the plan
  sorts by category what offload keeps on the host (`OFFLOADED`: the parameter shards, their gradients, and all
  the optimizer makes, since it steps there): the GPU's peak is that of the rest, the host's is reported beside it.

Time and cost are estimates on top: the step's model FLOPs (6N a trained token, 2N more under full activation
checkpointing, 2N for the pi_old pass over the batch but its first mini-batch) at a stated MFU, and generation at a
stated throughput per GPU, both overridable.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from learner import attention, sequence_parallel, sharding, throughput
from services.config import ConfigError

MODEL_CONFIGS = Path(str(resources.files("services") / "configs" / "models"))
RUNTIME_GIB = 2.0  # CUDA context (~0.5), NCCL buffers (~1), allocator slack: not tensors, so not traced
HEADROOM = 0.10  # a plan "fits" with at least this share of the card free
# Micro-batches the plan's update accumulates: from the second on, the gradient of those before is held (the whole
# gradient without FSDP or under gradient_sync mini_batch, the rank's shard with micro_batch), as in a run's steps.
ACCUMULATED = 2
MORE_GPUS = (2, 4)  # where nothing else fits: the run on this many times the GPUs, learner ranks alike
PAIRS_PLANNED = 2  # where no single change fits: the likeliest pairs of them planned

# --gpu -> (its name in learner/throughput.py's peak TFLOP/s table, memory as torch reports the card in GiB)
GPUS = {"h100": ("H100", 79.1), "h200": ("H200", 139.8), "a100": ("A100", 79.1), "a100-40gb": ("A100", 39.4),
        "l40s": ("L40S", 44.4), "b200": ("B200", 178.4)}
MEASURED_MFU = 0.41  # the 1.5B shape on one H200 (benchmarks/README.md, "GPU trainer")
GENERATED_TOKENS_PER_GPU_S_AT_1B = 40_000.0  # assumed vLLM decode throughput of a 1B model per GPU, scaled by 1/N

# FSDPMemTracker's categories that FSDP2's CPUOffloadPolicy keeps in host memory: the shards, their gradients, and
# AdamW's state and step temporaries (the tracker counts all the optimizer makes as its state; it steps on the host).
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")
# FSDPMemTracker's categories, grouped as the report shows them.
CATEGORIES = {"parameters": ("Sharded Param", "Unsharded Param", "Buffer", "All Gather", "Parameter"),
              "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Gradient"),
              "optimizer state": ("OptState", "Optstate"), "activations": ("Activation",),
              "temporaries": ("Temp",), "inputs": ("Inputs",), "other": ("Other",)}


class PlanError(ConfigError):
    """A plan that cannot be made (no model config, a world the preset cannot run on)."""


@dataclass
class Plan:
    preset: str
    gpu: str
    gpus: int
    learner_ranks: int
    micro_batch_tokens: int
    longest_row: int
    sequence_parallel: int
    bytes_by_category: dict[str, int]  # on the GPU
    host_bytes: int  # in host memory (FSDP's CPU offload): its own peak
    capacity_gib: float
    parameters: int
    step_flops: float
    served_bytes: float  # the model in the served dtype: what one version weighs
    shared_fs: bool  # weights.transport shared-fs: each rank gathers and writes its share (learner/publish.py)
    publish_writers: int  # the ranks that share that work: every one, or HSDP's first shard group
    learner_seconds: float
    generation_seconds: float
    total_steps: int
    mfu: float = MEASURED_MFU  # what learner_seconds assumes
    untraced: list[str] = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return sum(self.bytes_by_category.values()) / 2**30 + RUNTIME_GIB

    @property
    def headroom(self) -> float:
        return 1 - self.peak_gib / self.capacity_gib

    @property
    def fits(self) -> bool:
        return self.headroom >= HEADROOM

    @property
    def gpu_hours(self) -> float:
        return (self.learner_seconds + self.generation_seconds) * self.total_steps * self.gpus / 3600

    def report(self) -> str:
        lines = [f"{self.preset} on {self.gpus} x {self.gpu} ({self.capacity_gib:.1f} GiB each): learner on "
                 f"{self.learner_ranks} rank{'s' * (self.learner_ranks > 1)}, {self.parameters / 1e9:.2f} B parameters",
                 f"rank 0's peak, one update accumulating {ACCUMULATED} micro-batches of up to "
                 f"{self.micro_batch_tokens:,} tokens (longest row {self.longest_row:,})"
                 + (f", its share of 1/{self.sequence_parallel} (sequence parallel):" if self.sequence_parallel > 1
                    else ":")]
        for name, size in self.bytes_by_category.items():
            lines.append(f"  {name:<16} {size / 2**30:8.2f} GiB")
        lines.append(f"  {'runtime':<16} {RUNTIME_GIB:8.2f} GiB  (not traced: CUDA context, NCCL, allocator)")
        lines.append(f"  {'total':<16} {self.peak_gib:8.2f} GiB  = {1 - self.headroom:.0%} of the card: "
                     + (f"fits with {self.headroom:.0%} headroom" if self.fits
                        else f"does NOT fit with {HEADROOM:.0%} headroom"))
        if self.host_bytes:
            lines.append(f"  {'host memory':<16} {self.host_bytes / 2**30:8.2f} GiB  (fsdp_offload, its own peak: "
                         "parameter shards, their gradients, AdamW's state and step; not on the card)")
        lines.append(f"step: {self.step_flops / 1e15:,.1f} PFLOP on the learner, about {self.learner_seconds:,.0f} s "
                     f"at {self.mfu:.0%} MFU, generation about {self.generation_seconds:,.0f} s; "
                     f"{self.total_steps} steps = {self.gpu_hours:,.0f} GPU-hours")
        share = (f"about {self.served_bytes / self.publish_writers / 2**30:.1f} GiB gathered and written by each of "
                 f"{self.publish_writers} ranks")
        lines.append(f"publish: {self.served_bytes / 2**30:.1f} GiB a version; " + (
            f"{share} (shared-fs)" if self.shared_fs else f"gathered by rank 0 (on shared-fs: {share})"))
        lines += [f"estimated, not traced: {note}" for note in self.untraced]
        return "\n".join(lines)


def model_config(settings):
    """The preset's model config, never its weights: a local folder's config.json (the tiny model's, built here),
    else the shipped copy, else the hub's config.json alone (from the cache when HF_HUB_OFFLINE is set)."""
    from transformers import AutoConfig

    from services.config import TINY_NAME
    from services.models import ModelNotAvailable, hf_cache_dir, model_dir

    name = settings.model.name_or_path
    if name == TINY_NAME or Path(name).expanduser().is_dir():
        try:
            return AutoConfig.from_pretrained(model_dir(settings))
        except ModelNotAvailable as err:
            raise PlanError(str(err)) from None
    shipped = MODEL_CONFIGS / f"{name.rsplit('/', 1)[-1].lower()}.json"
    if shipped.is_file():
        values = {k: v for k, v in json.loads(shipped.read_text()).items() if not k.startswith("_")}
        return AutoConfig.for_model(values.pop("model_type"), **values)
    try:
        from huggingface_hub import hf_hub_download

        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        return AutoConfig.from_pretrained(Path(hf_hub_download(name, "config.json", cache_dir=str(hf_cache_dir()),
                                                               local_files_only=offline)).parent)
    except Exception as err:  # the hub raises several types; all mean "no config here"
        raise PlanError(f"no config for model {name!r}: point model.name_or_path at a folder with its config.json, "
                        f"or add one to {MODEL_CONFIGS} ({type(err).__name__})") from None


class _FlashAttentionMemory(torch.autograd.Function):
    """FlashAttention's memory without its arithmetic: the output, and q, k, v, the output and the fp32
    logsumexp [H, T] kept for backward, which returns dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_memory_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                         enable_gqa=False):
    """varlen_attn's signature (learner/attention.py calls it so), `_FlashAttentionMemory`'s memory."""
    return _FlashAttentionMemory.apply(query, key, value)


@contextlib.contextmanager
def _fake_world(ranks: int):
    """A fake process group of `ranks` (every collective returns at once) in which this process is rank 0: FSDP
    shards over it; accelerate, which reads its world from the launcher's environment, sees one process, and the
    plan gives it rank 0's rows only."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sharding.device_mesh.cache_clear()  # its meshes were of the fake group


def longest_row(settings) -> int:
    """The longest row the preset lets a generator make: its context (a full prompt and max_tokens)."""
    return settings.generator.max_model_len or settings.generator.max_prompt_tokens + settings.sampling.max_tokens


def heaviest_rows(settings, budget: int, vocab: int) -> tuple[list, int]:
    """Scored groups whose responses make `ACCUMULATED` of rank 0's heaviest micro-batch, each `budget` tokens of
    the longest rows (a full prompt and max_tokens) and one shorter; (groups, longest row)."""
    from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, Score, ScoredGroup

    longest = longest_row(settings)
    prompt = longest - settings.sampling.max_tokens  # the prompt room a generator leaves
    if longest > budget:
        raise PlanError(f"the longest row ({prompt} prompt + {settings.sampling.max_tokens} response tokens) is "
                        f"longer than learner.compute.micro_batch_tokens {budget}")
    # Truncated responses are common in a DAPO run, and the packer places the longest rows first and fills the
    # budget: rows of a full prompt and max_tokens, and one shorter to the budget's last token. Each row its own
    # group (no shared prompt block), so a micro-batch holds exactly `budget` tokens.
    lengths = [settings.sampling.max_tokens]
    room = budget - longest
    while room > prompt:
        size = min(settings.sampling.max_tokens, room - prompt)
        lengths.append(size)
        room -= prompt + size
    groups = []
    for g, twin in itertools.product(range(len(lengths)), range(ACCUMULATED)):
        part = lengths[g:g + 1]
        sampling = SamplingParams(n=len(part), max_tokens=settings.sampling.max_tokens)
        task = PromptTask(task_id=f"plan-{twin}-{g}", prompt_id=f"plan-{twin}-{g}", prompt="",
                          prompt_token_ids=[1] * prompt, ground_truth="0", sampling=sampling)
        samples = [Sample(text="", token_ids=[min(2, vocab - 1)] * size, logprobs=[-1.0] * size,
                          finish_reason="length") for size in part]
        scores = [Score(reward=float(i % 2), correct=bool(i % 2), overlong=False, rule="answer_line")
                  for i in range(len(part))]
        rollout = RolloutGroup(task=task, samples=samples, policy_version=0, generator_id="plan")
        groups.append(ScoredGroup(rollout=rollout, scores=scores))
    return groups, longest


def traced_peak(settings, ranks: int) -> tuple[dict[str, int], int, int, int]:
    """Rank 0's peak GPU bytes by category over one update of the trainer under fake tensors; (bytes, parameters,
    longest row, the host's own peak bytes: what FSDP's CPU offload keeps there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from transformers import AutoModelForCausalLM

    from learner.trainer import Trainer

    config = model_config(settings)
    compute = settings.learner.compute
    groups, longest = heaviest_rows(settings, compute.micro_batch_tokens, config.vocab_size)
    offloaded = OFFLOADED if compute.fsdp and compute.fsdp_offload else ()
    attention.register()
    with attention.stand_in(_flash_memory_kernel):
        with _fake_world(ranks) if ranks > 1 or compute.fsdp else contextlib.nullcontext():
            if compute.fsdp:  # the mesh is a real tensor of rank numbers: made before the fake mode
                sharding.device_mesh(ranks, compute.fsdp_shard_ranks, "cpu", compute.fsdp_offload)  # the trainer's
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         attn_implementation=attention.VARLEN)
                parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
                trainer = Trainer(settings, Path("."), model=model, gpu=True)
                with unset_fake_temporarily():  # host work on real numbers (the advantages)
                    batch = trainer.prepare(groups)
                # A first update untracked: AdamW makes its moments in its first step, and the first pass of a
                # process holds some of its activations past their backward (by the tracker's count); the
                # second is the steady state, as from a run's second step on.
                trainer.update_without_reads(batch)
                tracked = _tracker(trainer, offloaded)
                with tracked:
                    trainer.update_without_reads(batch)
                peak = tracked.get_tracker_snapshot("peak")
    by_category = {name: 0 for name in CATEGORIES}
    for device_stats in peak.values():
        for kind, size in device_stats.items():
            label = getattr(kind, "value", kind)
            if label not in (*offloaded, "Total"):  # (the total is the sum of the others)
                by_category[next((n for n, kinds in CATEGORIES.items() if label in kinds), "other")] += size
    return by_category, parameters, longest, tracked.elsewhere_peak


def peak_only(tracker_class: type, elsewhere: tuple[str, ...] = ()) -> type:
    """`tracker_class` (PyTorch's MemTracker or FSDPMemTracker) keeping only the overall peak. Theirs also updates
    the peak of every tracked module on every op, a walk over all of them: two thirds of a 28-layer plan's time,
    for figures the plan never reads. The overall peak is theirs, line for line; with `elsewhere` (categories on
    another device, `OFFLOADED`), the peak of the others."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def here(snapshot: dict) -> int:
        return snapshot[_TOTAL_KEY] - sum(snapshot.get(kind, 0) for kind in elsewhere)

    class PeakOnly(tracker_class):
        # Theirs refuses a second forward of a top-level module in one tracked region (its per-module figures would
        # mix), and an update of several micro-batches runs one for each: such a module's figures, which the plan
        # never reads, are dropped before it runs again.
        def _forget_if_top_level(self, module) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.memory_tracking.pop(module, None)

        def _pre_fw_hook(self, module, inputs) -> None:  # MemTracker's (FSDPMemTracker's does nothing)
            self._forget_if_top_level(module)
            super()._pre_fw_hook(module, inputs)

        def _fsdp_state_pre_forward(self, fsdp_module, pre_forward):  # FSDPMemTracker's
            theirs = super()._fsdp_state_pre_forward(fsdp_module, pre_forward)

            def forgetting(*args, **kwargs):
                self._forget_if_top_level(fsdp_module)
                return theirs(*args, **kwargs)

            return forgetting

        elsewhere_peak = 0  # the highest of the `elsewhere` categories together, at any moment

        def __enter__(self):
            super().__enter__()
            if self._depth == 1:  # theirs starts the peak at the total on entry
                self._peak_mem = {device: here(snapshot) for device, snapshot in self._peak_mem_snap.items()}
                self.elsewhere_peak = max((s[_TOTAL_KEY] - here(s) for s in self._peak_mem_snap.values()), default=0)
            return self

        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():  # (on every op: once each)
                rest = here(snapshot)
                self.elsewhere_peak = max(self.elsewhere_peak, snapshot[_TOTAL_KEY] - rest)
                if self._peak_mem.get(device, 0) < rest:
                    self._peak_mem[device] = rest
                    self._peak_mem_snap[device] = copy.deepcopy(snapshot)

    return PeakOnly


def _tracker(trainer, offloaded: tuple[str, ...]):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # the torch optimizer accelerate wraps
    if trainer.sharded:
        return peak_only(FSDPMemTracker, offloaded)(trainer.model, optimizer)
    tracker = peak_only(MemTracker)()
    tracker.track_external(trainer.model, optimizer)
    return tracker


def make_plan(settings, gpus: int, gpu: str = "h100", learner_ranks: int | None = None, mfu: float = MEASURED_MFU,
              generated_tokens_per_gpu_s: float | None = None, informative_ratio: float = 0.5,
              name: str = "") -> Plan:
    """The plan of `settings` on `gpus` cards of kind `gpu`, the learner on `learner_ranks` of them (default: half,
    as the shipped overlays split them; the one card when there is one)."""
    gpu = gpu.lower()
    if gpu not in GPUS:
        raise PlanError(f"unknown GPU {gpu!r}: one of {', '.join(GPUS)}")
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: at least 1")
    ranks = max(1, gpus // 2) if learner_ranks is None else learner_ranks
    if not 1 <= ranks <= gpus:
        raise PlanError(f"{ranks} learner ranks on {gpus} GPUs: from 1 to all of them")
    if not 0 < mfu <= 1:  # (NaN fails this too)
        raise PlanError(f"MFU {mfu}: a share of the peak, above 0 and at most 1")
    if generated_tokens_per_gpu_s is not None and not 0 < generated_tokens_per_gpu_s < math.inf:
        raise PlanError(f"{generated_tokens_per_gpu_s} generated tokens per second per GPU: a number above 0")
    settings = settings.model_copy(deep=True)
    compute = settings.learner.compute
    if settings.learner.loss.kl_coef:
        raise PlanError("learner.loss.kl_coef > 0 keeps a reference model beside the policy, which the plan does not "
                        "trace: plan without it (--set learner.loss.kl_coef=0) and add the reference's weights")
    if compute.fsdp and compute.fsdp_shard_ranks and ranks % compute.fsdp_shard_ranks:
        raise PlanError(f"learner.compute.fsdp_shard_ranks {compute.fsdp_shard_ranks} must divide the {ranks} "
                        "learner ranks (HSDP: shards within a group, replicas across groups)")
    degree = compute.sequence_parallel
    if ranks % degree or not _splits_heads(settings, degree):
        raise PlanError(f"learner.compute.sequence_parallel {degree} must divide the {ranks} learner ranks and split "
                        "the model's attention heads (learner/sequence_parallel.py): plan on more GPUs, or --set "
                        "learner.compute.sequence_parallel=1")
    if not settings.learner.batch.dynamic_sampling:
        informative_ratio = 1.0  # the learner pushes exactly B prompts a step and trains them all
    compute.packing = "on"  # a GPU packs rows (learner.compute.packing auto)
    compiled, compute.compile = compute.compile, False  # inductor needs real kernels
    try:
        by_category, parameters, longest, host = traced_peak(settings, ranks)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)  # the next plan may take another precision
    card, capacity = GPUS[gpu]
    peak_tflops = dict(throughput.PEAK_TFLOPS)[card]
    learner, sampling = settings.learner, settings.sampling
    # Tokens of a step: B groups of n responses, prompts of max_prompt_tokens / 4, responses of max_tokens / 2
    # on average (stated assumptions), over the learner's passes.
    responses = learner.batch.prompts_per_step * sampling.n
    tokens = responses * (settings.generator.max_prompt_tokens / 4 + sampling.max_tokens / 2)
    recompute = 2 if compute.gradient_checkpointing == "full" else 0
    old_pass = 2 * (1 - 1 / max(learner.batch.mini_batches, 1))
    step_flops = parameters * tokens * ((6 + recompute) * learner.batch.epochs + old_pass)
    learner_seconds = step_flops / (ranks * peak_tflops * 1e12 * mfu)
    per_gpu = generated_tokens_per_gpu_s or GENERATED_TOKENS_PER_GPU_S_AT_1B / (parameters / 1e9)
    generated = responses / informative_ratio * sampling.max_tokens / 2
    generation_seconds = generated / (per_gpu * max(gpus - ranks, 1))
    served = 2 if settings.model.resolved_dtype(on_gpu=True) in ("bfloat16", "float16") else 4
    untraced = ["attention kernel: FlashAttention's memory by formula (output; q, k, v, output, fp32 logsumexp kept)",
                f"runtime: {RUNTIME_GIB} GiB (CUDA context, NCCL buffers, allocator slack)",
                f"time: {mfu:.0%} MFU; generation {per_gpu:,.0f} tokens/s per GPU, {informative_ratio:.0%} of groups "
                "informative, responses of max_tokens / 2 on average"]
    if compiled:
        untraced.append("compiled layers ran uncompiled: an upper bound (inductor fuses temporaries away)")
    if not compute.fsdp and ranks > 1:  # accelerate wraps replicas in DDP; the plan traces one process, unwrapped
        by_category["gradients"] = by_category.get("gradients", 0) + 4 * parameters
        untraced.append("DDP's gradient buckets (replicas, fsdp off): 4 bytes a parameter, in gradients")
    if host:
        untraced.append("fsdp_offload: the time leaves out AdamW's step on the host and the copies between host and "
                        "GPU; what the host holds is sorted by category (one fake device holds both)")
    return Plan(preset=name or settings.redis.run, gpu=gpu, gpus=gpus, learner_ranks=ranks,
                micro_batch_tokens=compute.micro_batch_tokens, longest_row=longest,
                sequence_parallel=compute.sequence_parallel,
                bytes_by_category=by_category, host_bytes=host, capacity_gib=capacity, parameters=parameters,
                step_flops=step_flops,
                served_bytes=served * parameters, shared_fs=settings.weights.transport == "shared-fs",
                publish_writers=compute.fsdp_shard_ranks if compute.fsdp and compute.fsdp_shard_ranks else ranks,
                learner_seconds=learner_seconds,
                generation_seconds=generation_seconds, total_steps=learner.total_steps, mfu=mfu, untraced=untraced)


@dataclass(frozen=True)
class Change:
    """A change `dapo plan` tries: `compute` (learner.compute fields) set, the run on `gpus` GPUs of which `ranks`
    are the learner's."""
    what: str
    compute: dict
    gpus: int
    ranks: int

    def applied(self, settings):
        changed = settings.model_copy(deep=True)
        for key, value in self.compute.items():
            setattr(changed.learner.compute, key, value)
        return changed

    def __add__(self, other: Change) -> Change:
        return Change(f"{self.what} and {other.what}", {**self.compute, **other.compute}, max(self.gpus, other.gpus),
                      max(self.ranks, other.ranks))


def changes_to_try(settings, gpus: int, ranks: int) -> list[Change]:
    """Single changes that lower a rank's peak, cheapest first. More GPUs come last: they cost the most."""
    compute = settings.learner.compute
    changes = []
    if not compute.fsdp and ranks > 1 and settings.model.dtype != "float16":  # (FSDP has no loss scaling)
        changes.append(Change("learner.compute.fsdp: true", {"fsdp": True}, gpus, ranks))
    if compute.fsdp and ranks * 2 < gpus:
        changes.append(Change(f"{ranks * 2} learner ranks", {}, gpus, ranks * 2))
    if compute.gradient_checkpointing != "full":
        changes.append(Change("learner.compute.gradient_checkpointing: full", {"gradient_checkpointing": "full"}, gpus,
                              ranks))
    degree = compute.sequence_parallel * 2  # each rank runs 1/degree of a micro-batch's activations
    if ranks % degree == 0 and _splits_heads(settings, degree):
        changes.append(Change(f"learner.compute.sequence_parallel: {degree}", {"sequence_parallel": degree}, gpus,
                              ranks))
    if compute.micro_batch_tokens // 2 >= longest_row(settings):
        changes.append(Change(f"learner.compute.micro_batch_tokens: {compute.micro_batch_tokens // 2}",
                              {"micro_batch_tokens": compute.micro_batch_tokens // 2}, gpus, ranks))
    if compute.fsdp and not compute.fsdp_offload:
        changes.append(Change("learner.compute.fsdp_offload: true (slower: AdamW steps on the host)",
                              {"fsdp_offload": True}, gpus, ranks))
    if compute.fsdp:  # more ranks shard the state thinner; the activations stay
        changes += [Change(f"{gpus * factor} GPUs, {ranks * factor} learner ranks", {}, gpus * factor, ranks * factor)
                    for factor in MORE_GPUS]
    return changes


def pairs_that_may_fit(plan: Plan, savings: list[tuple[Change, float]]) -> list[Change]:
    """Pairs of single changes whose savings (GiB off `plan`'s peak, each planned alone) would add up to a fit,
    cheapest first (the earlier in `changes_to_try`'s order, the cheaper); at most one of a pair changes the world.
    Savings need not add (offload and more ranks both thin the sharded state): each pair is planned before it is
    said to fit."""
    limit = plan.capacity_gib * (1 - HEADROOM)
    pairs = []
    for i, (first, saved_first) in enumerate(savings):
        for j, (second, saved_second) in enumerate(savings[i + 1:], i + 1):
            moves_world = [(c.gpus, c.ranks) != (plan.gpus, plan.learner_ranks) for c in (first, second)]
            if not all(moves_world) and plan.peak_gib - saved_first - saved_second <= limit:
                pairs.append((i + j, first + second))
    return [pair for _, pair in sorted(pairs, key=lambda cost_pair: cost_pair[0])]


def _splits_heads(settings, degree: int) -> bool:
    config = model_config(settings)  # (its PlanError is the user's to read)
    try:
        sequence_parallel.check_heads(config, degree)
    except ValueError:
        return False
    return True


def planned(settings, change: Change, options: dict) -> Plan | None:
    """The plan of `settings` with `change`, its figure printed; None (said) when the change cannot be planned with
    the rest of the settings (e.g. an fsdp_shard_ranks that does not divide its ranks)."""
    try:
        plan = make_plan(change.applied(settings), change.gpus, learner_ranks=change.ranks, **options)
    except PlanError as err:
        print(f"with {change.what}: not planned ({err})", flush=True)
        return None
    host = f" (and {plan.host_bytes / 2**30:.1f} GiB of host memory)" if plan.host_bytes else ""
    print(f"with {change.what}: {plan.peak_gib:.1f} GiB{host}, {'fits' if plan.fits else 'does not fit'}", flush=True)
    return plan


def main(settings, gpus: int, gpu: str = "h100", learner_gpus: int | None = None, mfu: float = MEASURED_MFU,
         tokens_per_gpu_s: float | None = None, name: str = "") -> int:
    """`dapo plan`: print the plan; where it does not fit, the first single change that does, else the first pair
    (of those whose savings add up to a fit) that does. 0 if it fits."""
    options = {"gpu": gpu, "mfu": mfu, "generated_tokens_per_gpu_s": tokens_per_gpu_s, "name": name}
    plan = make_plan(settings, gpus, learner_ranks=learner_gpus, **options)
    print(plan.report(), flush=True)
    if plan.fits:
        return 0
    savings = []
    for change in changes_to_try(settings, gpus, plan.learner_ranks):
        changed = planned(settings, change, options)
        if changed is None:
            continue
        if changed.fits:
            return 1
        savings.append((change, plan.peak_gib - changed.peak_gib))
    pairs = pairs_that_may_fit(plan, savings)[:PAIRS_PLANNED]
    for pair in pairs:
        if (changed := planned(settings, pair, options)) is not None and changed.fits:
            return 1
    print(f"no single change of these fits, nor {len(pairs)} pair{'s' * (len(pairs) != 1)} of them whose savings "
          "add up: several changes at once (--set)", flush=True)
    return 1
