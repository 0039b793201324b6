"""The trainer on a CUDA device in bf16 against fp32 references (skipped where no GPU is visible; a few seconds on
one): packed rows and the chunked head under autocast, the gradient, and the sharded checkpoint.

Tolerances (stated): bf16 keeps 8 bits of mantissa, so logprobs of the tiny model (about -3.5 nats) computed through
bf16 layers agree with fp32 ones within 0.05 nats (the head alone, from the same bf16 operands, to fp32 precision),
and each weight matrix's gradient points the same way as the fp32 one (cosine > 0.99)."""

from __future__ import annotations

import pytest
import torch
from test_trainer import make_groups, model_path, random_offsets, with_behaviour  # noqa: F401

from learner import attention
from learner.checkpoint import read as read_checkpoint
from learner.checkpoint import write as write_checkpoint
from learner.logprobs import token_logprobs
from learner.trainer import Trainer
from services.config import load_settings, moved_keys

pytestmark = pytest.mark.gpu


def settings(tmp_path, dtype, **learner):
    base = {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.0, "mini_batches": 2, "epochs": 1, "seed": 0,
            "micro_batch_tokens": 64, "tis_cap": 2.0, **learner}
    return load_settings("tiny-cpu", run_dir=str(tmp_path / "run"), model={"dtype": dtype},
                         **moved_keys({"learner": base}, warn=False))  # learner fields by name, put in their sections


@pytest.mark.parametrize("compiled", [False, True])
def test_chunked_head_under_bf16_autocast_keeps_fp32_logits(compiled):
    # The operands are bf16, the logits not: cuBLAS's fp32 accumulator reaches the logsumexp (aten's mm with
    # out_dtype, eager and compiled), so logprobs equal the exact ones of the bf16 operands to fp32 precision.
    # Logits rounded to bf16 would be off by about 0.1 nats at these logits (tens of nats).
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(300, 64, generator=generator) * 2).bfloat16().float()
    weight = (torch.randn(5000, 64, generator=generator) * 0.6).bfloat16().float()
    targets = torch.randint(0, 5000, (300,), generator=generator)
    log_p = ((hidden.double() @ weight.double().t()) / 0.7).log_softmax(-1)
    ref_logp, ref_h = log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp, entropy = token_logprobs(hidden.cuda(), weight.cuda(), None, targets.cuda(), 0.7, 64, compiled)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.cpu().double(), ref_logp, rtol=0, atol=5e-5)
    torch.testing.assert_close(entropy.cpu().double(), ref_h, rtol=0, atol=5e-5)


def fresh_accelerator_state() -> None:
    """accelerate keeps one mixed-precision setting a process: a second Trainer in another dtype needs it reset."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("checkpointing, compiled", [("full", False), ("selective", False), ("selective", True)])
def test_packed_bf16_on_cuda_matches_the_fp32_reference(model_path, tmp_path, checkpointing, compiled):  # noqa: F811
    # The reference first (padded rows, fp32, SDPA), then the preset's GPU path (packed rows, bf16 autocast, the
    # varlen flash kernel where torch has it, checkpointed layers, fused AdamW) from the same weights.
    groups = make_groups(n_groups=4, size=4, seed=5)
    fresh_accelerator_state()
    reference = Trainer(settings(tmp_path, "float32", packing="off"), model_path)
    expected = reference.logprobs(groups)
    groups = with_behaviour(groups, expected, random_offsets(groups, seed=4, scale=0.3))
    loss_ref, grads_ref = reference.loss_gradients(groups)
    del reference
    fresh_accelerator_state()
    gpu = Trainer(settings(tmp_path, "bfloat16", gradient_checkpointing=checkpointing, compile=compiled), model_path)
    assert gpu.accelerator.device.type == "cuda" and gpu.packer.layout == "packed"
    assert gpu.compute_dtype == torch.bfloat16
    assert gpu.optimizer.param_groups[0]["fused"]
    assert gpu.attention in (attention.VARLEN, "flash_attention_2"), gpu.attention  # rows' boundaries, no mask
    for g_expected, g_got in zip(expected, gpu.logprobs(groups)):
        for a, b in zip(g_expected, g_got):
            assert b == pytest.approx(a, abs=0.05)
    loss_gpu, grads_gpu = gpu.loss_gradients(groups)
    assert loss_gpu == pytest.approx(loss_ref, rel=0.05, abs=0.01)
    for name, grad in grads_ref.items():
        if grad.numel() >= 256:
            cosine = torch.nn.functional.cosine_similarity(grads_gpu[name].float().cpu().flatten(),
                                                           grad.float().cpu().flatten(), 0)
            assert cosine > 0.99, (name, float(cosine))
    metrics = gpu.train_step(groups)
    assert metrics["model_tflops"] > 0 and 0 < metrics["mfu"] < 1  # a known card has a peak in the table


def test_sharded_checkpoint_round_trip_on_cuda(model_path, tmp_path):  # noqa: F811
    fresh_accelerator_state()
    first = Trainer(settings(tmp_path, "bfloat16"), model_path)
    groups = make_groups(n_groups=2, size=4, seed=5)
    groups = with_behaviour(groups, first.logprobs(groups))
    first.train_step(groups)
    write_checkpoint(first, tmp_path / "ckpt", {"step": 1})
    second = Trainer(settings(tmp_path, "bfloat16"), model_path)
    assert read_checkpoint(second, tmp_path / "ckpt") == {"step": 1}
    a, b = first.state_dict_for_publish(), second.state_dict_for_publish()
    assert all(torch.equal(a[name], b[name]) for name in a)
    state_a, state_b = first.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for slot, value in state_a[key].items():
            assert torch.equal(value, state_b[key][slot]), (key, slot)


def test_the_micro_batch_loop_never_waits_on_the_host(model_path, tmp_path):  # noqa: F811
    """An update (forward, loss, backward of every micro-batch, the clip and the fused AdamW step) under CUDA's sync
    debug mode "error": any copy or read that makes the host wait for the GPU raises."""
    trainer = Trainer(settings(tmp_path, "bfloat16", mini_batches=1), model_path)
    groups = make_groups(n_groups=4, size=4, seed=5)
    groups = with_behaviour(groups, trainer.logprobs(groups), random_offsets(groups, seed=3, scale=0.2))
    trainer.update_without_reads(trainer.prepare(groups))  # the first: the allocator, lazy initialisation
    batch = trainer.prepare(groups)  # host work, before the loop
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.update_without_reads(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_train_step_reads_the_device_only_for_its_metrics(model_path, tmp_path, monkeypatch):  # noqa: F811
    """A whole train_step (the pi_old pass, every micro-batch, the clip, the non-finite skip decided by fused
    AdamW's kernel, two updates) under sync debug mode "error" until its metrics are read at the end; a poisoned
    gradient skips its update there too."""
    from learner.update_stats import UpdateStats

    trainer = Trainer(settings(tmp_path, "bfloat16", mini_batches=2), model_path)
    assert trainer.skips_on_device
    groups = make_groups(n_groups=4, size=4, seed=5)
    groups = with_behaviour(groups, trainer.logprobs(groups), random_offsets(groups, seed=3, scale=0.2))
    trainer.train_step(groups)  # the first: the allocator, lazy initialisation
    metrics_of = UpdateStats.metrics

    def metrics(self, *args, **kwargs):  # the step's one read: allowed
        torch.cuda.set_sync_debug_mode("default")
        return metrics_of(self, *args, **kwargs)

    monkeypatch.setattr(UpdateStats, "metrics", metrics)
    embedding = trainer.accelerator.unwrap_model(trainer.model).get_input_embeddings().weight
    for poisoned in (False, True):
        hook = embedding.register_hook(lambda grad: torch.full_like(grad, float("nan"))) if poisoned else None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = trainer.train_step(groups)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert result["skipped_updates"] == (2 if poisoned else 0), result
        if hook is not None:
            hook.remove()
