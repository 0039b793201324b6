"""The message contracts between services: one pydantic model per message, one wire codec.

Wire format: msgpack of the model dump, with token ids packed as little-endian int32 bytes and logprobs as
float32 bytes (`to_wire` / `from_wire`). That is about 8 bytes per sampled token instead of ~25 as JSON;
`benchmarks/streams.py` measures it. Over HTTP the same models travel as plain JSON lists.

Every message carries `schema_version`; a consumer rejects any other version to the dead stream.

Provenance: stream entries, dead letters and weight announcements are signed by the role that produced them;
the scheme is explained once, in services/keys.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, SerializationInfo, field_serializer, field_validator

from services.keys import SIGNER_OF

if TYPE_CHECKING:
    from services.config import Settings
    from services.keys import Keyring, Signer

SCHEMA_VERSION = 1
log = logging.getLogger(__name__)

ENVELOPE_BYTES = 1 << 20  # a task's text, ids and fields, beyond its tokens
TOKEN_BYTES = 96  # a token's share of an entry at most: its id and logprob (msgpack) and its text (UTF-8)


def entry_limits(settings: "Settings") -> dict[str, int]:
    """The largest entry each stream can need, from the prompt room, max_tokens and n: a larger one is refused by
    its size before it is verified or decoded (a worker could otherwise exhaust a consumer's memory), and the
    embedded Redis refuses to store any value larger than the largest (`services.redis_local.embedded_server`)."""
    sampling = (settings.sampling, settings.eval_sampling)
    prompt = ENVELOPE_BYTES + settings.generator.max_prompt_tokens * TOKEN_BYTES
    group = prompt + max(s.n for s in sampling) * max(s.max_tokens for s in sampling) * TOKEN_BYTES
    return {"prompts": prompt, "rollouts": group, "scored": group, "held": group}


def _wire(info: SerializationInfo) -> bool:
    return bool(info.context and info.context.get("wire"))


def _unpack(value: Any, dtype: str) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(value, dtype=dtype).tolist()
    return value


def _unpack_token_ids(value: Any) -> Any:
    """Token ids from the wire's int32 bytes, or a list whose ids fit them: one that parses must encode again (the
    learner and the reward workers re-encode a group to check its signature; a wider id parsed, then raised there)."""
    if isinstance(value, list) and any(type(v) is int and not -(2**31) <= v < 2**31 for v in value):
        raise ValueError("a token id beyond the wire's int32")
    return _unpack(value, "<i4")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(16, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(20480, ge=1)
    seed: int | None = None


MAX_TASK_ID_CHARS = 128  # the learner's are `train-` and 32 hex digits; a dead letter copies the id of any entry


class PromptTask(Message):
    """One prompt to sample a group for. `task_id` is unique per request (a refill gets a new one)."""

    task_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=MAX_TASK_ID_CHARS)
    prompt_id: str
    prompt: str = Field(description="The prompt text, template already applied.")
    prompt_token_ids: list[int] | None = Field(None, description="Pre-tokenized prompt (preferred by engines).")
    ground_truth: str
    sampling: SamplingParams = SamplingParams()
    split: Literal["train", "eval"] = "train"
    min_version: int = Field(0, ge=0, description="Sample with a policy at least this new.")
    created_at: FiniteFloat = Field(default_factory=time.time)

    def for_generators(self) -> "PromptTask":
        """The task as generators get it: without the ground truth, which only the reward role reads (from the
        learner's `issued` hash)."""
        return self.model_copy(update={"ground_truth": ""})

    @field_serializer("prompt_token_ids")
    def _pack_prompt(self, v: list[int] | None, info: SerializationInfo) -> Any:
        return np.asarray(v, dtype="<i4").tobytes() if (v is not None and _wire(info)) else v

    @field_validator("prompt_token_ids", mode="before")
    @classmethod
    def _unpack_prompt(cls, v: Any) -> Any:
        return _unpack_token_ids(v)


class Sample(BaseModel):
    """One sampled response: its tokens and the behaviour policy's logprob of each sampled token."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length", "abort"]

    @field_serializer("token_ids")
    def _pack_ids(self, v: list[int], info: SerializationInfo) -> Any:
        return np.asarray(v, dtype="<i4").tobytes() if _wire(info) else v

    @field_serializer("logprobs")
    def _pack_logprobs(self, v: list[float], info: SerializationInfo) -> Any:
        return np.asarray(v, dtype="<f4").tobytes() if _wire(info) else v

    @field_validator("token_ids", mode="before")
    @classmethod
    def _unpack_ids(cls, v: Any) -> Any:
        return _unpack_token_ids(v)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _unpack_logprobs(cls, v: Any) -> Any:
        return _unpack(v, "<f4")


class RolloutGroup(Message):
    """All n responses to one task, sampled with one policy version."""

    task: PromptTask
    policy_version: int = Field(ge=0)
    generator_id: str
    samples: list[Sample]
    generated_at: FiniteFloat = Field(default_factory=time.time)
    # The generator's clock when it wrote the group: seconds since it started, by what it was doing (the learner
    # takes differences between steps: where each side's time went).
    generator_busy_s: FiniteFloat = Field(0.0, ge=0, description="Seconds its engine spent generating.")
    generator_reload_s: FiniteFloat = Field(0.0, ge=0, description="Seconds spent pulling and loading weight versions.")
    generator_idle_s: FiniteFloat = Field(0.0, ge=0,
                                          description="Seconds with no task in the engine and no version loading.")

    def malformed(self) -> str | None:
        """Why the samples do not answer their task (`malformed: ...`), None if they do: n samples, each at most
        max_tokens tokens with one logprob a token. Checked by the reward workers before scoring (thousands of
        samples of verifier-timeout text would hold their pool) and by the learner (`learner.workset.shape_error`)."""
        task = self.task
        if len(self.samples) != task.sampling.n:
            return f"malformed: task {task.task_id} asked for n={task.sampling.n} samples; the group has " \
                   f"{len(self.samples)}"
        for i, sample in enumerate(self.samples):
            where = f"malformed: task {task.task_id} sample {i}"
            if len(sample.logprobs) != len(sample.token_ids):
                return f"{where} has {len(sample.token_ids)} token ids and {len(sample.logprobs)} logprobs"
            if len(sample.token_ids) > task.sampling.max_tokens:
                return (f"{where} has {len(sample.token_ids)} tokens, more than the task's max_tokens "
                        f"{task.sampling.max_tokens}")
        return None

    def as_generated(self) -> "RolloutGroup":
        """The group as its generator wrote it: its task as generators get it (a reward worker adds the ground
        truth, the one change it may make; `ScoredGroup.rollout_signature` covers the rest)."""
        return self.model_copy(update={"task": self.task.for_generators()})


class Score(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(description="Rule reward (+1 / -1) plus overlong shaping.")
    correct: bool
    overlong: bool = Field(description="Truncated at max_tokens (finish_reason == length).")
    extracted: str | None = Field(None, description="The answer the verifier read, if any.")
    rule: str = Field(
        description="Which rule decided: answer_line, boxed, math_verify, dapo_minerva (reward.answer_rule dapo), "
        "none, timeout, error."
    )
    detail: str = ""


class ScoredGroup(Message):
    """A rollout group with one score per sample, in sample order."""

    rollout: RolloutGroup
    scores: list[Score]
    rollout_signature: str = Field(
        "", max_length=256, description="The generator's `sig` of the rollout entry the scores are for, as the reward "
        "worker read it (`Streams.rollout_refusal`): a reward worker vouches for its scores, not for the samples.")
    reward_worker_id: str = ""
    scored_at: FiniteFloat = Field(default_factory=time.time)


class WeightsFile(BaseModel):
    """One file of a published version (a shard or the index), with what a reader checks it against."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="File name inside the version folder.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class WeightsAnnouncement(BaseModel):
    """Published by the learner on `dapo:{run}:weights` (pub/sub) and in `dapo:{run}:weights:latest`."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Digest of the file list: the version's identity.")
    size: int = Field(ge=0, description="Bytes of all files.")
    url: str = Field(description="HTTP base of the version: GET {url}/{file name} (bearer token required).")
    files: list[WeightsFile] = Field(
        min_length=1, description="The HF sharded layout: model-0000k-of-0000N.safetensors + "
        "model.safetensors.index.json."
    )
    published_at: float = Field(default_factory=time.time)
    signature: str = Field(
        "", description="The learner's signature of the other fields, `{kid}:{base64}` (`sign_announcement`); "
        "empty = unsigned."
    )


class TensorSlot(BaseModel):
    """Where one tensor lies in a broadcast bucket (services/broadcast.py)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    dtype: str = Field(pattern=r"^(float32|float16|bfloat16)$")
    shape: list[int]
    offset: int = Field(ge=0, description="Byte offset in the bucket (a multiple of 16).")


class WeightsBroadcast(BaseModel):
    """A broadcast round (weights.transport collective), published by the learner on `dapo:{run}:weights`: which
    generator engines meet in which process group, and the buckets that will stream through it."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["broadcast"] = "broadcast"
    version: int = Field(ge=0)
    group: str = Field(pattern=r"^[A-Za-z0-9-]{1,64}$", description="The round's store prefix, new every round.")
    port: int = Field(ge=1, le=65535, description="The learner's rendezvous store (weights.broadcast_port).")
    backend: Literal["gloo", "nccl"]
    world_size: int = Field(ge=1, description="The chain's ranks: the learner (0) and every worker of `ranks`.")
    ranks: dict[str, int] = Field(description="Generator id -> its engine's first worker's rank (the learner: 0).")
    nearby: list[str] = Field(default=[], description="Generators on the learner's host: their workers take sealed "
                              "memory from the learner's `handoff` socket instead of the chain (gloo only).")
    handoff: str = Field(default="", pattern=r"^[A-Za-z0-9-]{0,100}$",
                         description="The round's abstract unix socket (nearby receivers).")
    handoff_token: str = Field(default="", max_length=64, description="What a nearby receiver shows the socket.")
    learner_pid: int = Field(default=0, ge=0, description="Who must serve `handoff` (its peer credentials).")
    buckets: list[list[TensorSlot]] = Field(min_length=1)
    bucket_bytes: list[int]
    verify: Literal["full", "sampled", "off"]
    timeout_s: float = Field(gt=0, description="The longest wait for one bucket.")
    join_timeout_s: float = Field(gt=0, description="The longest wait for every rank to join.")
    published_at: float = Field(default_factory=time.time)
    signature: str = ""

    def takes_part(self, member: str) -> bool:
        return member in self.ranks or member in self.nearby


class BroadcastCommit(BaseModel):
    """The last message of a round, streamed after the buckets: their sha256 digests (none under verify off, or
    when no receiver takes the chain)."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    group: str
    digests: list[str]
    signature: str = ""


AnyAnnouncement = TypeVar("AnyAnnouncement", WeightsAnnouncement, WeightsBroadcast, BroadcastCommit)


def _announcement_bytes(announcement: BaseModel) -> bytes:
    return announcement.model_dump_json(exclude={"signature"}).encode()


def sign_announcement(announcement: AnyAnnouncement, signer: "Signer", context: str) -> AnyAnnouncement:
    """The announcement (or broadcast round, or its commit) signed by the learner's key under `context` (the run's
    weights channel: bound to the run)."""
    return announcement.model_copy(update={"signature": signer.sign(context, _announcement_bytes(announcement))})


def announcement_refusal(announcement: BaseModel, keyring: "Keyring", context: str) -> str | None:
    """Why the announcement is not the learner's for this run (None: it is)."""
    return keyring.refusal(announcement.signature, SIGNER_OF["weights"], "weight announcements", context,
                           _announcement_bytes(announcement))


def read_announcement(model: type[AnyAnnouncement], raw: bytes | str, keyring: "Keyring", context: str,
                      what: str) -> AnyAnnouncement | None:
    """`raw` as a `model` the learner signed under `context`, or None (logged, naming `what`) if it is malformed or
    signed by any other key."""
    try:
        announcement = model.model_validate_json(raw)
    except ValueError:
        log.error("ignoring a malformed %s: %r", what, raw[:200])
        return None
    if refusal := announcement_refusal(announcement, keyring, context):
        log.error("refusing a %s (v%d): %s", what, announcement.version, refusal)
        return None
    return announcement


def to_wire(message: BaseModel) -> bytes:
    """Compact bytes for a Redis stream entry."""
    return msgpack.packb(message.model_dump(context={"wire": True}), use_bin_type=True)


def from_wire(model: type[BaseModel], payload: bytes) -> BaseModel:
    """Parse bytes written by `to_wire`; raises ValueError (msgpack) or ValidationError (schema)."""
    try:
        data = msgpack.unpackb(payload, raw=False)
    except Exception as err:  # msgpack raises several unrelated exception types
        raise ValueError(f"payload is not msgpack: {err}") from err
    return model.model_validate(data)
