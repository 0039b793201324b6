"""The trainer on a tiny randomly initialised Qwen2 (built here, no hub): update direction, the loss against the
hand formula, checkpoints, micro-batching, padding."""

from __future__ import annotations

import functools
import json
import logging
import math
import pickle
import random
import statistics

import numpy as np
import pytest
import torch

from learner import dapo
from learner.checkpoint import CheckpointDamaged
from learner.checkpoint import read as read_checkpoint
from learner.checkpoint import write as write_checkpoint
from learner.trainer import Trainer
from services.config import load_settings, moved_keys
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup

VOCAB = 32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")))
    tokenizer.save_pretrained(path)
    return path


def make_settings(tmp_path, **learner):
    base = {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.0, "mini_batches": 1, "epochs": 1, "seed": 0,
            "micro_batch_tokens": 4096, "tis_cap": 2.0}
    base.update(learner)  # learner fields by name, each put in its section
    return load_settings("tiny-cpu", run_dir=str(tmp_path / "run"), **moved_keys({"learner": base}, warn=False))


def make_groups(n_groups=3, size=4, seed=0, rewards=None, overlong=None):
    """Random prompts and responses of unequal lengths; behaviour logprobs filled in later."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 6))]
        task = PromptTask(prompt_id=f"p{g}", prompt="x", prompt_token_ids=prompt, ground_truth="1")
        samples, scores = [], []
        for i in range(size):
            tokens = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 9))]
            samples.append(Sample(token_ids=tokens, logprobs=[0.0] * len(tokens), text="", finish_reason="stop"))
            reward = rewards[i] if rewards else (1.0 if i % 2 == 0 else -1.0)
            long = bool(overlong and overlong[i])
            scores.append(Score(reward=reward, correct=reward > 0, overlong=long, rule="answer_line"))
        rollout = RolloutGroup(task=task, policy_version=0, generator_id="test", samples=samples)
        groups.append(ScoredGroup(rollout=rollout, scores=scores))
    return groups


def with_behaviour(groups, logprobs, offsets=None):
    """Copies of the groups whose samples carry these behaviour logprobs (minus optional per-token offsets)."""
    out = []
    for g, group in enumerate(groups):
        samples = []
        for i, sample in enumerate(group.rollout.samples):
            values = [lp - (offsets[g][i][t] if offsets else 0.0) for t, lp in enumerate(logprobs[g][i])]
            samples.append(sample.model_copy(update={"logprobs": values}))
        out.append(group.model_copy(update={"rollout": group.rollout.model_copy(update={"samples": samples})}))
    return out


def random_offsets(groups, seed=1, scale=1.0):
    rng = random.Random(seed)
    return [[[rng.uniform(-scale, scale) for _ in s.token_ids] for s in g.rollout.samples] for g in groups]


def sequence_logprob(trainer, groups):
    return [[sum(tokens) for tokens in group] for group in trainer.logprobs(groups)]


# -- padding and logprobs ----------------------------------------------------------------------------------------
def assert_same_gradients(got: dict, expected: dict, atol: float = 1e-5) -> None:
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=atol, msg=name)


LAYOUTS = {  # learner settings for each layout of a forward pass (learner/packing.py)
    "shared": {"packing": "off", "share_prompt_pass": True},
    "padded": {"packing": "off", "share_prompt_pass": False},
    "packed": {"packing": "on"},
}


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_match_unpadded_forward(model_path, tmp_path, temperature, layout):
    # The policy is the one the generator samples from: softmax(logits / T). Prompts of 2 to 6 tokens: the shared
    # prompt pass left-pads them in one block; packing puts several rows in one sequence.
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), sampling={"temperature": temperature},
                             **moved_keys({"learner": {"micro_batch_tokens": 30, **LAYOUTS[layout]}}, warn=False))
    trainer = Trainer(settings, model_path)
    assert trainer.packer.layout == layout
    groups = make_groups()
    batched = trainer.logprobs(groups)
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        for g, group in enumerate(groups):
            prompt = group.rollout.task.prompt_token_ids
            for i, sample in enumerate(group.rollout.samples):
                ids = torch.tensor([prompt + sample.token_ids], device=model.device)
                logits = (model(input_ids=ids).logits[0] / temperature).log_softmax(-1)
                # Logits at position t predict token t + 1.
                expected = [logits[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(sample.token_ids)]
                assert batched[g][i] == pytest.approx(expected, abs=1e-5)


# -- the update --------------------------------------------------------------------------------------------------
def test_train_step_raises_positive_and_lowers_negative_responses(model_path, tmp_path):
    trainer = Trainer(make_settings(tmp_path, lr=3e-3, mini_batches=2), model_path)
    groups = make_groups(n_groups=4, size=4)
    groups = with_behaviour(groups, trainer.logprobs(groups))  # on-policy
    before = sequence_logprob(trainer, groups)
    metrics = trainer.train_step(groups)
    after = sequence_logprob(trainer, groups)
    assert trainer.steps_done == 1 and metrics["updates"] == 2
    for g, group in enumerate(groups):
        for i, score in enumerate(group.scores):
            moved = after[g][i] - before[g][i]
            assert moved > 0 if score.reward > 0 else moved < 0, (g, i, moved)
    for key in ("loss", "clip_frac_low", "clip_frac_high", "entropy", "approx_kl", "grad_norm", "lr", "tokens",
                "tokens_per_second", "response_length_mean", "step_seconds", "tis_mean"):
        assert math.isfinite(metrics[key]), key
    assert 0 < metrics["entropy"] <= math.log(VOCAB) + 1e-6
    assert metrics["tis_mean"] == pytest.approx(1.0, abs=1e-5)  # behaviour == learner
    lengths = [len(s.token_ids) for g in groups for s in g.rollout.samples]
    assert metrics["tokens"] == sum(lengths)
    assert metrics["response_length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    # The second mini-batch was trained after the first update: the policy moved, the ratio left 1.
    assert metrics["approx_kl"] > 0


@pytest.mark.parametrize("mini_batches, epochs", [(1, 2), (2, 1), (3, 2)])
def test_pi_old_is_the_step_start_policy_in_every_update(model_path, tmp_path, monkeypatch, mini_batches, epochs):
    # The first mini-batch takes pi_old from its own training forward, the others from the no-grad pass; either way
    # every update of the step, in every pass, must see the policy the step started from (the behaviour here).
    trainer = Trainer(make_settings(tmp_path, lr=1e-2, mini_batches=mini_batches, epochs=epochs,
                                    micro_batch_tokens=40), model_path)
    groups = make_groups(n_groups=3, size=4, seed=5)
    groups = with_behaviour(groups, trainer.logprobs(groups))  # behaviour = the step's starting policy
    seen = []
    original = dapo.truncated_importance_weight

    def spy(logp_old, behaviour, cap):
        seen.append((logp_old.detach().clone(), behaviour.clone()))
        return original(logp_old, behaviour, cap)

    monkeypatch.setattr(dapo, "truncated_importance_weight", spy)
    before = sequence_logprob(trainer, groups)
    metrics = trainer.train_step(groups)
    assert metrics["updates"] == mini_batches * epochs
    assert len(seen) >= mini_batches * epochs
    for logp_old, behaviour in seen:
        torch.testing.assert_close(logp_old, behaviour, rtol=0, atol=1e-5)
    moved = max(abs(a - b) for g_after, g_before in zip(sequence_logprob(trainer, groups), before)
                for a, b in zip(g_after, g_before))
    assert moved > 1e-2  # the policy did move during the step: a pi_old taken after an update would differ


@pytest.mark.parametrize("clip_low, clip_high, clipped", [(0.0, 0.0, True), (0.99, 100.0, False)])
def test_the_update_clips_at_the_range_the_config_sets(model_path, tmp_path, clip_low, clip_high, clipped):
    """The GRPO row's 0.2 / 0.2 and the recipe's 0.2 / 0.28 are one setting apart: the trainer must pass it to the
    loss. A second epoch sees ratios off 1 (the first moved the weights): a zero range clips tokens on both sides,
    a huge one none."""
    trainer = Trainer(make_settings(tmp_path, lr=1e-2, epochs=2, clip_low=clip_low, clip_high=clip_high), model_path)
    groups = make_groups(n_groups=2, size=4, seed=5)
    metrics = trainer.train_step(with_behaviour(groups, trainer.logprobs(groups)))
    fractions = (metrics["clip_frac_low"], metrics["clip_frac_high"])
    assert (min(fractions) > 0) if clipped else fractions == (0.0, 0.0), fractions


@pytest.mark.parametrize("loss_agg, mini_batches, overlong_filter",
                         [("token", 1, True), ("sample", 1, True), ("token", 2, True), ("token", 1, False),
                          ("sample", 1, False)])
def test_loss_with_identical_old_and_new_params_is_the_hand_formula(model_path, tmp_path, loss_agg, mini_batches,
                                                                   overlong_filter):
    # One mini-batch: pi_old is the training forward itself. Two (one group each), lr 0: the second takes it from the
    # separate no-grad pass and the parameters never move, so the ratio is 1 in both updates.
    settings = make_settings(tmp_path, loss_agg=loss_agg, overlong_filter=overlong_filter, tis_cap=1.5,
                             micro_batch_tokens=24, mini_batches=mini_batches, lr=0.0 if mini_batches > 1 else 1e-2)
    trainer = Trainer(settings, model_path)
    # the 4th response is truncated: wrong, with the soft overlong punishment's -0.25 in its reward (Eq. 13)
    rewards = [1.0, -1.0, -1.0, -1.25]
    groups = make_groups(n_groups=2, size=4, rewards=rewards, overlong=[False, False, False, True])
    current = trainer.logprobs(groups)
    offsets = random_offsets(groups)
    groups = with_behaviour(groups, current, offsets)
    collated = []
    collate = trainer.packer.collate
    trainer.packer.collate = lambda responses, indices: collated.append(indices) or collate(responses, indices)
    metrics = trainer.train_step(groups)
    run = sorted({i for micro in collated for i in micro})  # the truncated one (4th of each group) never runs
    assert run == ([0, 1, 2, 4, 5, 6] if overlong_filter else list(range(8)))

    # Ratio 1 (pi_old = current params): loss = -sum_t w_t A_i / N, w_t = min(pi_old / mu, 1.5) = min(e^offset, 1.5).
    # A = (r - mean) / (sample std + eps) over the group's shaped rewards (Eq. 9), the truncated response's included;
    # with overlong filtering its tokens are out of the loss (and out of N), else in it.
    advantages = [(r - statistics.mean(rewards)) / (statistics.stdev(rewards) + 1e-6) for r in rewards]
    trained = range(3) if overlong_filter else range(4)
    token_terms, sample_means, weights = [[], []], [[], []], []
    for g in range(2):
        for i in trained:
            w = [min(math.exp(o), 1.5) for o in offsets[g][i]]
            weights += w
            terms = [-advantages[i] * wt for wt in w]
            token_terms[g] += terms
            sample_means[g].append(sum(terms) / len(terms))
    terms = token_terms if loss_agg == "token" else sample_means
    if mini_batches == 1:
        expected = sum(terms[0] + terms[1]) / len(terms[0] + terms[1])
    else:  # the mean of the two updates' losses, each normalised by its own mini-batch
        expected = (sum(terms[0]) / len(terms[0]) + sum(terms[1]) / len(terms[1])) / 2
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert metrics["updates"] == mini_batches
    assert metrics["tis_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
    assert metrics["tis_capped_frac"] == pytest.approx(sum(w >= 1.5 - 1e-6 for w in weights) / len(weights))
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0
    assert metrics["tokens"] == len(weights)
    assert metrics["approx_kl"] == pytest.approx(  # k3 of KL(behaviour || current), behaviour = current - offset
        sum(math.exp(o) - 1 - o for g in range(2) for i in trained for o in offsets[g][i]) / len(weights), rel=1e-4)
    assert metrics["log_ratio_max"] == pytest.approx(
        max(abs(o) for g in range(2) for i in trained for o in offsets[g][i]), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("loss_agg", ["token", "sample"])
def test_micro_batching_gives_the_gradient_of_the_whole_mini_batch(model_path, tmp_path, loss_agg):
    groups = make_groups(n_groups=3, size=4, seed=3)
    whole = Trainer(make_settings(tmp_path, loss_agg=loss_agg, micro_batch_tokens=100_000), model_path)
    groups = with_behaviour(groups, whole.logprobs(groups), random_offsets(groups, seed=2, scale=0.5))
    loss_whole, grads_whole = whole.loss_gradients(groups)
    # A budget of 1 token: every response is its own micro-batch (12 forward/backward passes).
    split = Trainer(make_settings(tmp_path, loss_agg=loss_agg, micro_batch_tokens=1), model_path)
    assert len(split.packer.plan(list(range(12)), split.prepare(groups).responses)) == 12
    loss_split, grads_split = split.loss_gradients(groups)
    assert loss_split == pytest.approx(loss_whole, rel=1e-5)
    assert grads_whole.keys() == grads_split.keys() and len(grads_whole) > 10
    for name, grad in grads_whole.items():
        assert torch.allclose(grads_split[name], grad, rtol=1e-4, atol=1e-7), name
    assert any(g.abs().max() > 1e-4 for g in grads_whole.values())


@pytest.mark.parametrize("budget", [100_000, 20])
def test_shared_prompt_pass_gives_the_gradient_of_whole_rows(model_path, tmp_path, budget):
    groups = make_groups(n_groups=4, size=4, seed=5)  # prompts of unequal length in one micro-batch
    whole = Trainer(make_settings(tmp_path, share_prompt_pass=False, micro_batch_tokens=budget), model_path)
    shared = Trainer(make_settings(tmp_path, share_prompt_pass=True, micro_batch_tokens=budget), model_path)
    assert shared.share_prompts and not whole.share_prompts
    groups = with_behaviour(groups, whole.logprobs(groups), random_offsets(groups, seed=4, scale=0.5))
    loss_whole, grads_whole = whole.loss_gradients(groups)
    loss_shared, grads_shared = shared.loss_gradients(groups)
    assert loss_shared == pytest.approx(loss_whole, rel=1e-5)
    assert grads_whole.keys() == grads_shared.keys() and len(grads_whole) > 10
    for name, grad in grads_whole.items():
        assert torch.allclose(grads_shared[name], grad, rtol=1e-4, atol=1e-7), name
    assert shared.train_step(groups)["loss"] == pytest.approx(whole.train_step(groups)["loss"], rel=1e-4)


@pytest.mark.parametrize("layout, budget", [("packed", 100_000), ("packed", 20), ("shared", 20)])
def test_every_layout_gives_the_gradient_of_padded_rows(model_path, tmp_path, layout, budget):
    # fp32: packed rows (attention confined to each row by the position ids) and the shared prompt pass give the
    # padded rows' loss and gradient within 1e-5.
    groups = make_groups(n_groups=4, size=4, seed=5)
    padded = Trainer(make_settings(tmp_path, **LAYOUTS["padded"], micro_batch_tokens=budget), model_path)
    other = Trainer(make_settings(tmp_path, **LAYOUTS[layout], micro_batch_tokens=budget), model_path)
    assert (padded.packer.layout, other.packer.layout) == ("padded", layout)
    groups = with_behaviour(groups, padded.logprobs(groups), random_offsets(groups, seed=4, scale=0.5))
    loss_padded, grads_padded = padded.loss_gradients(groups)
    loss_other, grads_other = other.loss_gradients(groups)
    assert loss_other == pytest.approx(loss_padded, rel=1e-5, abs=1e-7)
    assert grads_padded.keys() == grads_other.keys() and len(grads_padded) > 10
    assert_same_gradients(grads_other, grads_padded)
    assert any(g.abs().max() > 1e-4 for g in grads_padded.values())
    a, b = padded.train_step(groups), other.train_step(groups)
    for key in ("loss", "entropy", "approx_kl", "clip_frac_high", "tokens"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_checkpointed_layers_give_the_same_gradient_at_their_cost_in_flops(model_path, tmp_path, layout):
    # learner/activation_checkpointing.py: full recomputes each layer's forward in backward, selective keeps the
    # matrix products and attention (counted: no FLOP beyond the uncheckpointed step's), and both give its gradient.
    from torch.utils.flop_counter import FlopCounterMode

    groups = make_groups(n_groups=4, size=4, seed=5)
    results = {}
    for mode in ("off", "full", "selective"):
        trainer = Trainer(make_settings(tmp_path, **LAYOUTS[layout], micro_batch_tokens=20,
                                        gradient_checkpointing=mode), model_path)
        assert trainer.packer.layout == layout
        if mode == "off":
            groups = with_behaviour(groups, trainer.logprobs(groups), random_offsets(groups, seed=4, scale=0.5))
        with FlopCounterMode(display=False) as flops:
            loss, grads = trainer.loss_gradients(groups)
        results[mode] = loss, grads, flops.get_total_flops()
    loss_off, grads_off, flops_off = results["off"]
    for mode in ("full", "selective"):
        loss, grads, _ = results[mode]
        assert loss == pytest.approx(loss_off, rel=1e-6)
        assert_same_gradients(grads, grads_off, atol=1e-6)
    assert results["selective"][2] == flops_off
    assert results["full"][2] > 1.15 * flops_off  # the layers' forward again (the head is chunked alike in all)


def test_accelerates_own_fsdp_is_refused_for_rounding_the_logprobs(model_path, tmp_path, monkeypatch):
    # accelerate's FSDP with bf16 casts the root's output, the head's fp32 logprobs, to bf16 (learner/sharding.py).
    import accelerate
    from accelerate.utils import DistributedType

    class FsdpAccelerator(accelerate.Accelerator):
        distributed_type = DistributedType.FSDP  # what `accelerate launch` with distributed_type: FSDP gives

    monkeypatch.setattr(accelerate, "Accelerator", FsdpAccelerator)
    with pytest.raises(ValueError, match="casts every sharded module's output to bf16.*learner.compute.fsdp: true"):
        Trainer(make_settings(tmp_path), model_path)


def test_accelerates_gradient_accumulation_is_refused_for_scaling_every_loss(model_path, tmp_path, monkeypatch):
    """Set in the environment, it divides every loss the trainer backpropagates (and so the gradient the clip
    threshold is measured against) by its step count."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(ValueError, match="unset ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        Trainer(make_settings(tmp_path), model_path)


@pytest.mark.slow
def test_compiled_checkpointed_layers_give_the_eager_gradient(model_path, tmp_path):
    # learner.compute.compile on a 10-layer model, packs of several lengths: the layers share their compiled graphs
    # (past 8 recompiles dynamo would run the rest eagerly, silently), no graph break, the eager gradient (about
    # a minute of compiling here).
    import shutil

    from torch._dynamo.utils import counters
    from transformers import AutoConfig, Qwen2ForCausalLM

    deep = tmp_path / "deep"
    config = AutoConfig.from_pretrained(model_path)
    config.num_hidden_layers, config.layer_types = 10, ["full_attention"] * 10
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(deep)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, deep / name)
    groups = make_groups(n_groups=4, size=4, seed=5)
    eager = Trainer(make_settings(tmp_path, **LAYOUTS["packed"], micro_batch_tokens=20), deep)
    compiled = Trainer(make_settings(tmp_path, packing="on", micro_batch_tokens=20, gradient_checkpointing="selective",
                                     compile=True), deep)
    groups = with_behaviour(groups, eager.logprobs(groups), random_offsets(groups, seed=4, scale=0.5))
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    loss_eager, grads_eager = eager.loss_gradients(groups)
    loss_compiled, grads_compiled = compiled.loss_gradients(groups)
    # Dynamic lengths from the start: one graph for every layer and pack length (one more where a no-grad pass
    # runs) and one for each of the head's two chunk functions; not one per layer or per length.
    assert 0 < counters["stats"]["unique_graphs"] - graphs <= 4
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert loss_compiled == pytest.approx(loss_eager, rel=1e-5)
    assert_same_gradients(grads_compiled, grads_eager)


def test_a_step_reports_its_model_flops(model_path, tmp_path):
    trainer = Trainer(make_settings(tmp_path, **LAYOUTS["packed"], mini_batches=2), model_path)
    groups = make_groups(n_groups=4, size=4, seed=5)
    groups = with_behaviour(groups, trainer.logprobs(groups))
    metrics = trainer.train_step(groups)
    body, head = trainer.parameter_counts
    tokens = sum(len(g.rollout.task.prompt_token_ids) + len(s.token_ids) for g in groups for s in g.rollout.samples)
    scored = sum(len(s.token_ids) for g in groups for s in g.rollout.samples)
    # Every token trained once; the second mini-batch's also had a no-grad pi_old pass (about half of them).
    low = 6 * (body * tokens + head * scored)
    assert low < metrics["model_tflops"] * 1e12 * metrics["step_seconds"] < low * (1 + 2 / 6)
    assert "mfu" not in metrics  # no peak for a CPU
    trainer = Trainer(make_settings(tmp_path, peak_tflops=0.5), model_path)
    metrics = trainer.train_step(groups)
    assert metrics["mfu"] == pytest.approx(metrics["model_tflops"] / 0.5)


def test_warmup_is_counted_in_train_steps(model_path, tmp_path):
    # Three mini-batch updates per step, all at the step's rate; the rate rises once per step.
    trainer = Trainer(make_settings(tmp_path, lr=1e-3, warmup_steps=3, mini_batches=3), model_path)
    groups = make_groups(n_groups=3, size=2)
    groups = with_behaviour(groups, trainer.logprobs(groups))
    steps = [trainer.train_step(groups) for _ in range(4)]
    assert [m["lr"] for m in steps] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    assert [m["updates"] for m in steps] == [3, 3, 3, 3] and trainer.steps_done == 4


def test_kl_penalty_and_entropy_bonus(model_path, tmp_path):
    groups = make_groups(n_groups=2, size=4, seed=7)
    plain = Trainer(make_settings(tmp_path), model_path)
    groups = with_behaviour(groups, plain.logprobs(groups))
    loss_plain, grads_plain = plain.loss_gradients(groups)
    entropy = plain.train_step(groups)["entropy"]  # mean token entropy at the starting parameters

    # The reference is the starting policy: at step 0 the k3 penalty and its gradient are exactly 0.
    with_kl = Trainer(make_settings(tmp_path, kl_coef=0.5), model_path)
    loss_kl, grads_kl = with_kl.loss_gradients(groups)
    assert loss_kl == pytest.approx(loss_plain, abs=1e-7)
    assert all(torch.allclose(grads_kl[n], g, atol=1e-7) for n, g in grads_plain.items())
    with_kl.train_step(groups)
    moved_plain, _ = plain.loss_gradients(groups)
    moved_kl, _ = with_kl.loss_gradients(groups)
    assert moved_kl > moved_plain  # both took the same first step; now the penalty is positive

    # Entropy bonus, token level: loss - coef * mean entropy; it changes the gradient.
    with_h = Trainer(make_settings(tmp_path, entropy_coef=0.1), model_path)
    loss_h, grads_h = with_h.loss_gradients(groups)
    assert loss_h == pytest.approx(loss_plain - 0.1 * entropy, rel=1e-5)
    assert not torch.allclose(grads_h["model.norm.weight"], grads_plain["model.norm.weight"])


def test_without_a_tis_cap_the_behaviour_logprobs_do_not_weigh(model_path, tmp_path):
    # tis_cap null (the paper's verl recipe): the loss is the clipped surrogate against the recomputed pi_old alone,
    # so how far the behaviour policy was from it changes nothing; with a cap the same groups weigh differently.
    groups = make_groups(n_groups=2, size=4, seed=11)
    unweighted = Trainer(make_settings(tmp_path, max_staleness=0, tis_cap=None), model_path)
    on_policy = with_behaviour(groups, unweighted.logprobs(groups))
    off_policy = with_behaviour(groups, unweighted.logprobs(groups), random_offsets(groups, seed=4, scale=0.5))
    _, on = unweighted.loss_gradients(on_policy)
    _, off = unweighted.loss_gradients(off_policy)
    assert all(torch.equal(off[n], g) for n, g in on.items())
    _, weighted = Trainer(make_settings(tmp_path, tis_cap=2.0), model_path).loss_gradients(off_policy)
    assert not torch.allclose(weighted["model.norm.weight"], off["model.norm.weight"])
    assert unweighted.train_step(off_policy)["tis_mean"] == 1.0


def test_a_mini_batch_with_no_loss_token_takes_no_step(model_path, tmp_path):
    # Every response overlong-filtered: no gradient, and AdamW's weight decay must not move the weights either.
    groups = make_groups(n_groups=2, size=2, seed=5, overlong=[True, True])
    trainer = Trainer(make_settings(tmp_path, overlong_filter=True, weight_decay=0.1, mini_batches=2), model_path)
    groups = with_behaviour(groups, trainer.logprobs(groups))
    before = {n: t.clone() for n, t in trainer.state_dict_for_publish().items()}
    metrics = trainer.train_step(groups)
    assert metrics["updates"] == metrics["skipped_updates"] == 2
    assert all(torch.equal(before[n], t) for n, t in trainer.state_dict_for_publish().items())


def test_the_step_loss_is_the_mean_over_the_updates_taken_not_over_the_skipped_ones(model_path, tmp_path):
    """A mini-batch whose every response is overlong-filtered takes no step; the step's loss counted it as a zero
    update all the same (halved here), while grad_norm left it out."""
    trained = make_groups(n_groups=1, size=2, seed=5)
    filtered = make_groups(n_groups=1, size=2, seed=6, overlong=[True, True])
    settings = make_settings(tmp_path, overlong_filter=True, mini_batches=2, lr=0.0)
    trainer = Trainer(settings, model_path)
    both = with_behaviour(trained + filtered, trainer.logprobs(trained + filtered))
    metrics = trainer.train_step(both)
    assert (metrics["updates"], metrics["skipped_updates"]) == (2, 1)
    alone = Trainer(make_settings(tmp_path, overlong_filter=True, mini_batches=1, lr=0.0), model_path)
    assert metrics["loss"] == pytest.approx(alone.train_step(both[:1])["loss"], rel=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["read-on-host", "fused-skips-on-device"])
def test_a_non_finite_gradient_skips_its_update_and_moves_nothing(model_path, tmp_path, monkeypatch, fused):
    # Without a fused AdamW the host reads the norm and does not step; a fused one (a GPU's) is told by `found_inf`
    # and skips in its kernel, so the loop reads nothing: weights, moments and step counts stay as they were.
    if fused:  # CPU's fused kernel honours found_inf as CUDA's does
        adamw = torch.optim.AdamW
        monkeypatch.setattr(torch.optim, "AdamW", lambda *args, **kwargs: adamw(*args, **{**kwargs, "fused": True}))
    trainer = Trainer(make_settings(tmp_path, weight_decay=0.1, mini_batches=2), model_path)
    assert trainer.skips_on_device == fused
    groups = make_groups(n_groups=2, size=4, seed=5)
    groups = with_behaviour(groups, trainer.logprobs(groups))
    before = {n: t.clone() for n, t in trainer.state_dict_for_publish().items()}
    embedding = trainer.accelerator.unwrap_model(trainer.model).get_input_embeddings().weight
    hook = embedding.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    metrics = trainer.train_step(groups)
    assert metrics["updates"] == metrics["skipped_updates"] == 2 and metrics["grad_norm"] == 0.0
    assert all(torch.equal(before[n], t) for n, t in trainer.state_dict_for_publish().items())
    assert all(float(state["step"]) == 0 for state in trainer.scheduler.optimizer.state.values())
    hook.remove()
    metrics = trainer.train_step(groups)  # the same trainer steps again once the gradient is finite
    assert metrics["skipped_updates"] == 0 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert not all(torch.equal(before[n], t) for n, t in trainer.state_dict_for_publish().items())


def test_a_rank_without_rows_pads_with_another_ranks_rows_under_kl(model_path, tmp_path, monkeypatch):
    # Rank 1 of 2 with a one-response mini-batch has no rows of its own: it runs rank 0's rows at weight 0 in
    # lockstep, and has no pi_ref for them (its no-grad pass computed only its own); that must not fail.
    groups = make_groups(n_groups=1, size=1, seed=2)
    trainer = Trainer(make_settings(tmp_path, kl_coef=0.5, mini_batches=1), model_path)
    groups = with_behaviour(groups, trainer.logprobs(groups))

    class SecondOfTwo:  # the accelerator as rank 1 sees it; collectives of one process stay local
        num_processes, process_index = 2, 1

        def __getattr__(self, name):
            return getattr(accelerator, name)

    accelerator = trainer.accelerator
    monkeypatch.setattr(trainer, "accelerator", SecondOfTwo())
    before = {n: t.clone() for n, t in trainer.state_dict_for_publish().items()}
    metrics = trainer.train_step(groups)
    assert metrics["tokens"] > 0 and metrics["loss"] == 0.0  # rank 0's rows ran here, and weighed nothing
    assert all(torch.equal(before[n], t) for n, t in trainer.state_dict_for_publish().items())


# -- publishing and checkpoints ----------------------------------------------------------------------------------
def test_state_dict_for_publish(model_path, tmp_path):
    trainer = Trainer(make_settings(tmp_path), model_path)
    state = trainer.state_dict_for_publish()
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = dict(model.named_parameters())
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state  # tied alias dropped
    assert set(state) == set(params)
    for name, tensor in state.items():
        assert tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype == torch.float32
        assert torch.equal(tensor, params[name].detach().cpu())
        assert tensor.data_ptr() != params[name].data_ptr()  # a copy: training on cannot change it


def _optimizer_state(trainer):
    return {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in trainer.optimizer.state_dict()["state"].items()}


def refuse_unpickling(monkeypatch):
    """Any unpickling from here on fails the test (torch.load, pickle.load/loads and their Unpickler)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was read")

    monkeypatch.setattr(torch, "load", refuse)
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)


def test_checkpoint_round_trip(model_path, tmp_path, monkeypatch):
    """Exact resume (weights, AdamW moments, schedule, RNG), from a checkpoint holding no pickle, read without
    unpickling anything."""
    settings = make_settings(tmp_path, mini_batches=2, warmup_steps=3)
    groups = make_groups(n_groups=2, size=4, seed=5)
    first = Trainer(settings, model_path)
    groups = with_behaviour(groups, first.logprobs(groups), random_offsets(groups, seed=4, scale=0.3))
    first.train_step(groups)
    checkpoint = tmp_path / "ckpt" / "step-1"
    write_checkpoint(first, checkpoint, {"step": 1, "carry": ["task-a"]})
    at_save = first.state_dict_for_publish()
    rng_at_save = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()[1]}
    write_checkpoint(first, checkpoint, {"step": 1, "carry": ["task-a"]})  # overwriting is atomic too
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step-1"]  # no tmp / old left behind
    model_files = {p.name for p in (checkpoint / "model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= model_files
    assert json.loads((checkpoint / "model" / "config.json").read_text())["dtype"] == "float32"
    files = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert {"state/optimizer.json", "state/scheduler.json", "state/rng-0.safetensors", "trainer_state.json"} <= files
    shards = [f for f in files if f.startswith("state/shards/")]
    assert shards and all(f.endswith(".safetensors") for f in shards), files  # DCP, safetensors, one per rank
    assert not [f for f in files if f.endswith((".pkl", ".bin", ".pt", ".pth"))], files

    second = Trainer(settings, model_path)
    assert second.steps_done == 0
    torch.manual_seed(123), random.seed(123), np.random.seed(123)  # moved on: the checkpoint must restore them
    with monkeypatch.context() as patch:
        refuse_unpickling(patch)
        extra = read_checkpoint(second, checkpoint)
    assert extra == {"step": 1, "carry": ["task-a"]} and second.steps_done == 1
    a, b = first.state_dict_for_publish(), second.state_dict_for_publish()
    assert all(torch.equal(a[name], b[name]) for name in a)
    state_a, state_b = _optimizer_state(first), _optimizer_state(second)
    assert state_a.keys() == state_b.keys() and state_a
    for key in state_a:
        for name, value in state_a[key].items():
            assert torch.equal(value, state_b[key][name]) if torch.is_tensor(value) else value == state_b[key][name]
    assert second.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    assert second.scheduler.state_dict() == first.scheduler.state_dict()
    assert torch.equal(torch.get_rng_state(), rng_at_save["torch"]) and random.getstate() == rng_at_save["python"]
    assert (np.random.get_state()[1] == rng_at_save["numpy"]).all()

    # Both continue identically (same weights, moments, schedule and shuffling).
    m1, m2 = first.train_step(groups), second.train_step(groups)
    assert m1["lr"] == m2["lr"] and m1["loss"] == pytest.approx(m2["loss"], abs=1e-7)
    a, b = first.state_dict_for_publish(), second.state_dict_for_publish()
    assert all(torch.allclose(a[name], b[name], atol=1e-7) for name in a)

    # And the HF copy is a loadable model with the same weights.
    from transformers import AutoModelForCausalLM

    exported = dict(AutoModelForCausalLM.from_pretrained(checkpoint / "model").named_parameters())
    assert exported.keys() == at_save.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in at_save.items())


def test_a_resume_keeps_the_resuming_process_adamw_kernel(model_path, tmp_path):
    # A checkpoint written with the foreach kernel (a CPU, or before the fused one) resumed where AdamW is fused (a
    # GPU) stays fused, and the other way round: the kernel is the process's choice, the state is the checkpoint's.
    settings = make_settings(tmp_path)
    groups = make_groups(n_groups=2, size=4, seed=5)
    first = Trainer(settings, model_path)
    first.train_step(with_behaviour(groups, first.logprobs(groups)))
    write_checkpoint(first, tmp_path / "ckpt" / "step-1", {"step": 1})
    assert not first.optimizer.param_groups[0]["fused"]
    for fused in (True, None):
        second = Trainer(settings, model_path)
        second.optimizer.param_groups[0]["fused"] = fused
        read_checkpoint(second, tmp_path / "ckpt" / "step-1")
        assert second.optimizer.param_groups[0]["fused"] is fused
        assert second.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]


def test_a_resume_trains_with_this_starts_optimizer_settings(model_path, tmp_path, caplog):
    """Lowering the learning rate (or changing the decay, the betas, the warm-up) and resuming: the new values, at
    the restored step of the schedule, not the checkpoint's."""
    groups = make_groups(n_groups=2, size=4, seed=5)
    first = Trainer(make_settings(tmp_path, warmup_steps=0), model_path)
    first.train_step(with_behaviour(groups, first.logprobs(groups)))
    write_checkpoint(first, tmp_path / "ckpt" / "step-1", {"step": 1})
    settings = make_settings(tmp_path, lr=1e-4, warmup_steps=4, weight_decay=0.05, adam_betas=(0.8, 0.95))
    second = Trainer(settings, model_path)
    with caplog.at_level(logging.WARNING):
        read_checkpoint(second, tmp_path / "ckpt" / "step-1")
    assert "initial_lr, warmup_steps, weight_decay" in caplog.text and "betas" in caplog.text
    group = second.optimizer.param_groups[0]
    assert second.steps_done == 1  # the schedule's step is the checkpoint's
    assert group["lr"] == pytest.approx(1e-4 * 2 / 4) and second.scheduler.get_last_lr() == [group["lr"]]
    assert group["weight_decay"] == 0.05 and tuple(group["betas"]) == (0.8, 0.95)
    metrics = second.train_step(with_behaviour(groups, second.logprobs(groups)))
    assert metrics["lr"] == pytest.approx(1e-4 * 2 / 4)
    assert second.scheduler.get_last_lr()[0] == pytest.approx(1e-4 * 3 / 4)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_checkpoint_missing_part_of_its_training_state_is_refused_not_mixed_with_the_fresh_model(
        model_path, tmp_path, damage):
    """DCP fills only the pieces of a tensor it finds: without a shard file (a partial copy of the run folder) the
    weights would be half the checkpoint's, half the base model's, with no error."""
    from learner.checkpoint import CheckpointDamaged

    trainer = Trainer(make_settings(tmp_path), model_path)
    write_checkpoint(trainer, tmp_path / "ckpt" / "step-1", {"step": 1})
    (shard,) = (tmp_path / "ckpt" / "step-1" / "state" / "shards").glob("*.safetensors")
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointDamaged, match=r"shards/.*(is missing|has [\d,]+ bytes, written with)"):
        read_checkpoint(Trainer(make_settings(tmp_path), model_path), tmp_path / "ckpt" / "step-1")


def test_published_weights_carry_the_checkpoints_names_for_a_model_transformers_converts(tmp_path):
    """transformers 5 holds an MoE layer's experts fused (`experts.gate_up_proj`); the checkpoint, and so vLLM and
    every generator's schema check, name each expert's weights: a version in the in-memory names was refused."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from learner.checkpoint import MODEL_DIR
    from services.weights import model_schema

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    trainer = Trainer(make_settings(tmp_path), tmp_path / "moe")
    schema = model_schema(tmp_path / "moe")
    published = trainer.state_dict_for_publish()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in schema
    assert published.keys() == schema.keys()
    assert all(tuple(published[name].shape) == shape for name, (_, shape) in schema.items())
    write_checkpoint(trainer, tmp_path / "ckpt" / "step-1", {"step": 1})
    assert model_schema(tmp_path / "ckpt" / "step-1" / MODEL_DIR).keys() == schema.keys()
    # Several learner ranks on shared-fs each write what they own (learner/publish.py): in those names too
    import torch.distributed as dist

    from learner.publish import write_rank_shards

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    (tmp_path / "ranks").mkdir()
    try:
        (written,), _ = write_rank_shards(trainer, tmp_path / "ranks", 1 << 20)
    finally:
        dist.destroy_process_group()
    assert written.weight_map.keys() == schema.keys()


def test_bad_groups_are_refused(model_path, tmp_path):
    trainer = Trainer(make_settings(tmp_path), model_path)
    group = make_groups(n_groups=1)[0]
    no_prompt = group.model_copy(update={"rollout": group.rollout.model_copy(
        update={"task": group.rollout.task.model_copy(update={"prompt_token_ids": None})})})
    with pytest.raises(ValueError, match="prompt_token_ids"):
        trainer.train_step([no_prompt])
    sample = group.rollout.samples[0].model_copy(update={"logprobs": [0.0]})
    short = group.model_copy(update={"rollout": group.rollout.model_copy(
        update={"samples": [sample] + group.rollout.samples[1:]})})
    if len(group.rollout.samples[0].token_ids) != 1:
        with pytest.raises(ValueError, match="behaviour logprobs"):
            trainer.train_step([short])
    with pytest.raises(ValueError):
        trainer.train_step([])
    assert trainer.steps_done == 0


def test_interrupted_overwrite_is_recovered(model_path, tmp_path):
    trainer = Trainer(make_settings(tmp_path), model_path)
    checkpoint = tmp_path / "latest"
    write_checkpoint(trainer, checkpoint, {"step": 0})
    # A crash after `latest` was moved to `latest.old` and before `latest.tmp` took its place.
    checkpoint.rename(tmp_path / "latest.old")
    assert read_checkpoint(trainer, checkpoint) == {"step": 0}
    with pytest.raises(CheckpointDamaged, match="no checkpoint at"):  # exit 65 naming it, not a traceback
        read_checkpoint(trainer, tmp_path / "missing")


WORKER = """
import sys, torch
sys.path[:0] = [{here!r}, {tests!r}, {repo!r}]
from pathlib import Path
from test_trainer import make_groups, make_settings, random_offsets, with_behaviour
from learner.checkpoint import read as read_checkpoint, write as write_checkpoint
from learner.trainer import Trainer

trainer = Trainer(make_settings(Path({tmp!r}), micro_batch_tokens=40, mini_batches=2), Path({model!r}))
groups = make_groups(n_groups=3, size=4, seed=3)
groups = with_behaviour(groups, trainer.logprobs(groups), random_offsets(groups, seed=2, scale=0.5))
loss, grads = trainer.loss_gradients(groups)
metrics = trainer.train_step(groups)
write_checkpoint(trainer, Path({tmp!r}) / ("ckpt-%d" % trainer.accelerator.num_processes), {{"ok": True}})
assert read_checkpoint(trainer, Path({tmp!r}) / ("ckpt-%d" % trainer.accelerator.num_processes)) == {{"ok": True}}
if trainer.accelerator.is_main_process:
    torch.save({{"loss": loss, "grads": grads, "metrics": metrics, "world": trainer.accelerator.num_processes}},
               Path({tmp!r}) / ("result-%d.pt" % trainer.accelerator.num_processes))
"""


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(model_path, tmp_path):
    """torchrun, 2 CPU processes (gloo): sharding, lockstep micro-batches and the world-size scaling give the
    single-process gradient and metrics."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent.parent
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(here=str(Path(__file__).resolve().parent), tests=str(tests), repo=str(tests.parent),
                                    tmp=str(tmp_path), model=str(model_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")
    alone = subprocess.run([sys.executable, str(script)], env=env, timeout=300, capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr[-3000:]
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    done = subprocess.run(torchrun + [str(script)], env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    one = torch.load(tmp_path / "result-1.pt", weights_only=False)
    two = torch.load(tmp_path / "result-2.pt", weights_only=False)
    assert two["world"] == 2
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name, grad in one["grads"].items():
        assert torch.allclose(two["grads"][name], grad, rtol=1e-4, atol=1e-7), name
    for key in ("loss", "clip_frac_low", "clip_frac_high", "entropy", "approx_kl", "log_ratio_max", "grad_norm",
                "tokens", "tis_mean"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key
    assert (tmp_path / "ckpt-2" / "trainer_state.json").is_file()


# -- the varlen kernel's plumbing on CPU (the kernel itself is CUDA-only: tests/integration/test_trainer_gpu.py) ---
def _segments(q, k, v, cu, scale, causal, gqa):
    """What torch.nn.attention.varlen.varlen_attn computes, row by row with SDPA: [T, H, D] in and out."""
    starts = cu.tolist()
    out = []
    for a, b in zip(starts, starts[1:]):
        rows = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
        out.append(torch.nn.functional.scaled_dot_product_attention(*rows, is_causal=causal, scale=scale,
                                                                    enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(out)


def varlen_today(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == int(cu_seq_q.diff().max())
    return _segments(q, k, v, cu_seq_q, scale, window_size == (-1, 0), enable_gqa)


def varlen_torch_2_10(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    assert q.shape[1] == k.shape[1], "no grouped-query support in this signature: heads repeated by the caller"
    return _segments(q, k, v, cu_seq_q, None, is_causal, False)  # no scale argument: D^-1/2


@pytest.mark.parametrize("kernel", [varlen_today, varlen_torch_2_10])
@pytest.mark.parametrize("budget, bucket, checkpointing", [(100_000, 1, "off"), (20, 16, "full")])
def test_packed_rows_through_the_varlen_interface_match_padded_rows(model_path, tmp_path, monkeypatch, kernel,
                                                                     budget, bucket, checkpointing):
    # The varlen attention (learner/attention.py) with a CPU stand-in of the kernel: the boundaries the trainer
    # passes (a padding tail as a row of its own where packs are rounded up, as on a GPU), the head layout,
    # grouped-query heads, gradient checkpointing's recompute and either signature of the kernel give the padded
    # gradient.
    from learner import attention

    monkeypatch.setattr(attention, "available", lambda cuda, dtype: True)
    calls = []

    @functools.wraps(kernel)  # the same signature
    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "kernel", lambda: counted)
    groups = make_groups(n_groups=4, size=4, seed=5)
    padded = Trainer(make_settings(tmp_path, **LAYOUTS["padded"], micro_batch_tokens=budget), model_path)
    varlen = Trainer(make_settings(tmp_path, packing="on", attention="varlen", micro_batch_tokens=budget,
                                   gradient_checkpointing=checkpointing), model_path)
    assert (varlen.packer.layout, varlen.attention) == ("packed", attention.VARLEN)
    varlen.packer.bucket = bucket
    groups = with_behaviour(groups, padded.logprobs(groups), random_offsets(groups, seed=4, scale=0.5))
    loss_padded, grads_padded = padded.loss_gradients(groups)
    loss_varlen, grads_varlen = varlen.loss_gradients(groups)
    assert loss_varlen == pytest.approx(loss_padded, rel=1e-5, abs=1e-7)
    assert_same_gradients(grads_varlen, grads_padded)
    assert calls  # the kernel ran (not SDPA on a block mask, which gives the same values)


def test_varlen_attention_is_refused_where_it_cannot_run(model_path, tmp_path):
    with pytest.raises(ValueError, match="varlen needs packed rows on a GPU"):
        Trainer(make_settings(tmp_path, packing="on", attention="varlen"), model_path)


def test_the_attention_kernel_auto_picks(monkeypatch):
    from learner import attention

    bf16 = torch.bfloat16
    monkeypatch.setattr(attention, "available", lambda cuda, dtype: False)  # a torch before 2.10, or an old GPU
    assert attention.implementation("auto", True, True, bf16) == "sdpa"
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())  # flash-attn installed
    assert attention.implementation("auto", True, True, bf16) == "flash_attention_2"
    assert attention.implementation("auto", True, False, torch.float32) == "sdpa"
    assert attention.implementation("auto", False, True, bf16) == "sdpa"
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(attention, "available", lambda cuda, dtype: cuda)
    assert attention.implementation("auto", True, True, bf16) == attention.VARLEN
    assert attention.implementation("auto", True, False, bf16) == "sdpa"  # padded rows: a mask


@pytest.mark.slow
def test_a_compiled_function_past_its_recompile_limit_fails_instead_of_running_eagerly_unseen():
    from torch._dynamo.utils import counters

    from learner import activation_checkpointing

    before = activation_checkpointing.compiled_graphs()
    double = activation_checkpointing.compiled(lambda x: x * 2)
    with torch._dynamo.config.patch(recompile_limit=1):
        double(torch.ones(3))
        assert activation_checkpointing.compiled_graphs() == before + 1 == counters["stats"]["unique_graphs"]
        with pytest.raises(Exception, match="recompile_limit|cache_size_limit|[Rr]ecompil"):
            double(torch.ones(3, dtype=torch.float64))  # another dtype: a recompile, past the limit of 1


def test_flex_attention_is_refused_on_a_cpu(model_path, tmp_path):
    """torch has no flex-attention backward on a CPU: refused at start, not at the first update (whose error would
    count against every group of its batch and quarantine them)."""
    with pytest.raises(ValueError, match="flex_attention needs a GPU"):
        Trainer(make_settings(tmp_path, attention="flex_attention"), model_path)


def test_the_pi_old_pass_counts_no_filler_in_the_model_flops(model_path, tmp_path):
    """A rank with fewer micro-batches than the busiest runs weight-0 fillers to keep the collectives in step: work
    for nothing, not the step's FLOPs. Two data-parallel ranks simulated in one process count what one process does."""
    from learner.update_stats import UpdateStats

    class Rank:  # the trainer's accelerator as rank `index` of 2 sees it
        def __init__(self, accelerator, index):
            self.accelerator, self.num_processes, self.process_index = accelerator, 2, index

        def __getattr__(self, name):
            return getattr(self.accelerator, name)

    groups = make_groups(n_groups=3, size=2, seed=3)
    first = groups[0].rollout
    samples = [first.samples[0], first.samples[1].model_copy(update={"token_ids": [], "logprobs": []})]
    groups[0] = groups[0].model_copy(update={"rollout": first.model_copy(update={"samples": samples})})
    trainer = Trainer(make_settings(tmp_path, packing="on", micro_batch_tokens=9, mini_batches=3), model_path)
    groups = with_behaviour(groups, trainer.logprobs(groups))
    mini_batches = trainer._mini_batches(trainer.prepare(groups))
    alone = UpdateStats("cpu")
    trainer._old_logprobs_pass(trainer.prepare(groups), mini_batches, alone)
    accelerator, counted = trainer.accelerator, {}
    for index in range(2):
        trainer.accelerator, trainer.packer.world, trainer.packer.rank = Rank(accelerator, index), 2, index
        stats = UpdateStats("cpu")
        trainer._old_logprobs_pass(trainer.prepare(groups), mini_batches, stats)
        counted = {kind: counted.get(kind, 0) + tokens for kind, tokens in stats.model_tokens.items()}
    assert counted == alone.model_tokens
