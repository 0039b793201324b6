"""The attacks on the roles of benchmarks/faults.py, one by one against the real server and the learner's own
admission (the fault benchmark itself is a long run): a `scored` group of a real issued task signed with a
generator's key, a task signed with the reward role's key, a replay under a retired key id, and a generator's
Redis user trying commands outside its ACL. 0 accepted: each is dead-lettered with its reason (or refused by
Redis), and the task it names stays in flight, its genuine group still trained."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from signing import vouched

from learner.service import LearnerService
from services.keys import Signer
from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, Score, ScoredGroup, to_wire
from services.redis_local import EmbeddedRedis, client_for
from services.redis_users import REDIS_USERS
from services.streams import Streams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.faults import outside_acl  # noqa: E402


def learner_that_issued(settings, max_tokens: int = 64) -> tuple[LearnerService, PromptTask]:
    """A connected learner service that pushed one task, train-1 (n 2)."""
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)
    issued = PromptTask(task_id="train-1", prompt_id="p1", prompt="1+1=", prompt_token_ids=[5, 6], ground_truth="2",
                        sampling=SamplingParams(n=2, max_tokens=max_tokens))
    service.work.outbox.append(issued)
    service.work.assembler.issued(["train-1"], 0)
    service.work.flush_outbox()
    return service, issued


def group(task: PromptTask) -> ScoredGroup:
    samples = [Sample(token_ids=[5], logprobs=[-0.1], text="Answer: 2", finish_reason="stop")] * task.sampling.n
    scores = [Score(reward=r, correct=r > 0, overlong=False, rule="answer_line") for r in (1.0, -1.0)]
    return ScoredGroup(rollout=RolloutGroup(task=task, policy_version=0, generator_id="g", samples=samples),
                       scores=scores)


def test_signed_attacks_on_the_roles_are_dead_lettered_and_the_genuine_group_trains(settings):
    service, issued = learner_that_issued(settings)
    generator = Streams(service.redis, settings, signs_as=("generator",))
    reward = Streams(service.redis, settings, signs_as=("reward",))
    scored_key, prompts_key = service.streams.key("scored"), service.streams.key("prompts")
    payload = to_wire(group(issued))

    # A scored group of the real issued task, signed with a generator's key (a compromised generator pod).
    service.redis.xadd(scored_key, {b"data": payload, b"sig": generator.signers["generator"].sign(scored_key, payload)})
    # A task signed with the reward role's key (a compromised reward pod issuing work).
    made_up = to_wire(issued.model_copy(update={"task_id": "train-made-up"}).for_generators())
    service.redis.xadd(prompts_key, {b"data": made_up, b"sig": reward.signers["reward"].sign(prompts_key, made_up)})
    # Replays under a kid the run no longer trusts (retired by a rotation): a group and a task.
    retired = {role: Signer(role, Ed25519PrivateKey.generate()) for role in ("reward", "learner")}
    service.redis.xadd(scored_key, {b"data": payload, b"sig": retired["reward"].sign(scored_key, payload)})
    service.redis.xadd(prompts_key, {b"data": made_up, b"sig": retired["learner"].sign(prompts_key, made_up)})
    # A compromised reward pod that rewrote the samples (and the policy version) of a genuine rollout it scored.
    genuine = vouched(generator, group(issued))
    rewritten = genuine.rollout.model_copy(update={"policy_version": 7, "samples": [
        Sample(token_ids=[9, 9], logprobs=[-0.5, -0.5], text="planted", finish_reason="stop")] * 2})
    reward.stream("scored", ScoredGroup).produce(genuine.model_copy(update={"rollout": rewritten}))

    service.work.pump()
    tasks = generator.stream("prompts", PromptTask).consume("gen", count=10, block_ms=0)
    assert [d.message.task_id for d in tasks] == ["train-1"]  # only the learner's own task reaches a generator
    # no forged group admitted
    assert "train-1" in service.work.assembler.in_flight and not service.work.assembler.ready
    reward.stream("scored", ScoredGroup).produce(genuine)  # the genuine group, by the reward role
    service.work.pump()
    assert [g.rollout.task for _, _, g in service.work.assembler.ready] == [issued]
    # the same rewrite after the genuine group was admitted: not dropped as a mere duplicate, dead-lettered
    reward.stream("scored", ScoredGroup).produce(genuine.model_copy(update={"rollout": rewritten}))
    service.work.pump()

    reasons = sorted(d["reason"] for d in service.streams.dead_letters())
    kids = {role: s.signers[role].kid for role, s in (("generator", generator), ("reward", reward))}
    assert reasons == sorted([
        f"forged: signed by the generator role's key {kids['generator']}, and only the reward role signs scored",
        f"forged: signed by the reward role's key {kids['reward']}, and only the learner role signs prompts",
        f"forged: key id {retired['reward'].kid!r} is not in the keyring (retired by a rotation, or never issued)",
        f"forged: key id {retired['learner'].kid!r} is not in the keyring (retired by a rotation, or never issued)",
        *[f"forged: bad signature under {kids['generator']} (tampered, or not signed with that key) (the rollout's "
          "own signature, which its reward worker carries on)"] * 2,
    ])
    service.work.scan_dead_letters()
    assert service.work.assembler.stats.lost == 0  # forged letters never make a task lost


def test_a_generator_user_gets_no_command_outside_its_acl(settings, short_tmp):
    users = {user: secrets.token_hex(16) for user in REDIS_USERS}
    with EmbeddedRedis(os.path.join(short_tmp, "acl"), aof=False, users=users) as server:
        streams = Streams(client_for(server.url), settings, signs_as=())
        attempts = outside_acl(client_for(server.role_url("generator")), "generator", streams)
        assert len(attempts) == 7 and [a.command for a in attempts if not a.refused] == []


def test_a_sample_whose_text_is_not_its_tokens_is_refused(settings):
    """A generator (signing what it wrote, so every signature holds) pairs a correct text with other tokens: the
    reward worker grades the text, the learner would train the tokens, and the generator would choose which
    tokens are rewarded. The learner decodes the tokens as the generator must have."""
    import functools

    from tiny_qwen import build_tokenizer

    from services.models import safe_decode

    tokenizer = build_tokenizer()
    service, issued = learner_that_issued(settings, max_tokens=64)
    service.work.decode = functools.partial(safe_decode, tokenizer)
    streams = Streams(service.redis, settings, signs_as=("reward", "generator"))

    def sample(text: str, tokens_of: str) -> Sample:
        ids = tokenizer.encode(tokens_of, add_special_tokens=False)
        return Sample(token_ids=ids, logprobs=[-0.1] * len(ids), text=text, finish_reason="stop")

    def scored(samples: list[Sample]) -> ScoredGroup:
        scores = [Score(reward=r, correct=r > 0, overlong=False, rule="answer_line") for r in (1.0, -1.0)]
        rollout = RolloutGroup(task=issued.for_generators(), policy_version=0, generator_id="g", samples=samples)
        return vouched(streams, ScoredGroup(rollout=rollout.model_copy(update={"task": issued}), scores=scores))

    # the text the reward worker read says 2 (+1); the tokens the update would reinforce say 3
    streams.stream("scored", ScoredGroup).produce(scored([sample("Answer: 2", "Answer: 3"), sample("Answer: 7",
                                                                                                    "Answer: 7")]))
    service.work.pump()
    assert not service.work.assembler.ready
    (letter,) = service.streams.dead_letters()
    assert letter["reason"] == ("malformed: task train-1 sample 0 has a text that is not its token ids decoded "
                                "(what the reward read is not what would be trained)")


def test_a_dead_letter_dated_past_every_id_neither_crashes_the_learner_nor_hides_the_letters_after_it(settings):
    """One XADD by any worker (`dead` is writable to both roles): at the largest id the learner's next scan failed
    (a read after the largest id), and its restart read from there again, for good; a day ahead, every honest
    letter after it was skipped (its task never given up, its entry parked for ever)."""
    service, issued = learner_that_issued(settings)
    dead_key = service.streams.key("dead")
    service.redis.xadd(dead_key, {b"x": b"y"}, id="18446744073709551615-18446744073709551615")
    service.work.scan_dead_letters()  # no error
    restarted = LearnerService(settings)
    restarted.connect()
    restarted.work.limit_vocabulary(100)
    restarted.work.assembler.issued(["train-1"], 0)
    restarted.work.scan_dead_letters()  # nor after a restart
    restarted.work.pump()  # whose periodic repair deletes it: the dead stream takes letters again
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    (task,) = prompts.consume("gen", count=1, block_ms=0)
    prompts.reject(task, "invalid task: token id 10^9")  # an honest letter, after the planted one
    restarted.work.scan_dead_letters()
    assert restarted.work.assembler.stats.lost == 1  # read, and its task given up
