"""Chunked logprobs and entropy through the LM head (learner/logprobs.py) against the plain full-vocabulary
formula: values and gradients equal within 1e-5 in fp32, at any chunk size, with a temperature and a bias."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learner import dapo, logprobs
from learner.logprobs import HeadQuery, LogprobHead, token_logprobs


def reference(hidden, weight, bias, targets, temperature):
    logits = (hidden @ weight.t() + (0 if bias is None else bias)).float() / temperature
    logp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, dapo.token_entropy(logits)


def inputs(n=37, hidden=16, vocab=53, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=generator, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=generator) * 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=generator) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (n,), generator=generator)
    return h, w, b, targets


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("temperature, bias", [(1.0, False), (0.6, True)])
def test_chunked_equals_full_in_values_and_gradients(chunk, temperature, bias, compiled=False):
    h, w, b, targets = inputs(bias=bias)
    weights = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (lambda: reference(h, w, b, targets, temperature),
               lambda: token_logprobs(h, w, b, targets, temperature, chunk, compiled)):
        logp, entropy = fn()
        # A loss through both outputs, as the entropy bonus makes it (the policy loss alone is the first term).
        ((logp * weights).sum() + 0.3 * (entropy * weights.flip(0)).sum()).backward()
        params = [h, w] + ([b] if b is not None else [])
        grads.append(([t.grad.clone() for t in params], logp.detach(), entropy.detach()))
        for t in params:
            t.grad = None
    (g_ref, lp_ref, h_ref), (g_new, lp_new, h_new) = grads
    torch.testing.assert_close(lp_new, lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(h_new, h_ref, rtol=0, atol=1e-5)
    for new, ref in zip(g_new, g_ref):
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_chunks_equal_full_in_values_and_gradients():
    # learner.compute.compile: each chunk's work through torch.compile, ragged last chunks included (37 = 7 x 5 + 2)
    # (about 30 s of compiling here).
    test_chunked_equals_full_in_values_and_gradients(5, 0.6, True, compiled=True)
    test_logprob_alone_takes_no_entropy_gradient(compiled=True)


def test_logprob_alone_takes_no_entropy_gradient(compiled=False):
    h, w, b, targets = inputs(bias=False)
    logp, entropy = token_logprobs(h, w, None, targets, 1.0, 8, compiled)
    logp.sum().backward()
    expected_h, expected_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref, _ = reference(h, w, None, targets, 1.0)
    ref.sum().backward()
    torch.testing.assert_close(expected_h, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected_w, w.grad, rtol=1e-5, atol=1e-6)


def test_the_head_is_the_linear_layer_until_asked():
    linear = nn.Linear(16, 53, bias=False)
    head = LogprobHead(linear, temperature=0.7, chunk_tokens=4)
    assert head.weight is linear.weight  # same parameter: same state-dict name, tied embeddings stay tied
    hidden = torch.randn(2, 5, 16)
    torch.testing.assert_close(head(hidden), linear(hidden))
    rows, positions = torch.tensor([0, 1, 1]), torch.tensor([4, 0, 2])
    targets = torch.tensor([3, 9, 52])
    with head.scoring(HeadQuery(rows, positions, targets)):
        scored = head(hidden)
    assert head.query is None and scored.shape == (3, 2)
    logp, entropy = reference(hidden[rows, positions], linear.weight, None, targets, 0.7)
    torch.testing.assert_close(scored[:, 0], logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(scored[:, 1], entropy, rtol=0, atol=1e-5)


def bf16_head_inputs():
    """bf16 operands with logits of a real model's size (tens of nats), and the reference from their exact logits."""
    generator = torch.Generator().manual_seed(1)
    hidden = (torch.randn(96, 64, generator=generator) * 2).bfloat16()
    weight = (torch.randn(3000, 64, generator=generator) * 0.6).bfloat16()
    targets = torch.randint(0, 3000, (96,), generator=generator)
    log_p = ((hidden.double() @ weight.double().t()) / 0.7).log_softmax(-1)
    return hidden, weight, targets, (log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1))


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_operands_give_logprobs_of_fp32_precision(autocast):
    # The head's matmul keeps its fp32 accumulator: FSDP2's bf16 parameters (no autocast) and bf16 autocast alike.
    hidden, weight, targets, (ref_logp, ref_entropy) = bf16_head_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp, entropy = token_logprobs(hidden.float() if autocast else hidden,
                                       weight.float() if autocast else weight, None, targets, 0.7, 40)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=2e-5)
    # What logits rounded to bf16 would have given: off by far more than an update at lr 1e-6 moves a logprob.
    rounded = (hidden.double() @ weight.double().t()).bfloat16().double() / 0.7
    rounded_logp = rounded.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    assert (rounded_logp - ref_logp).abs().max() > 1e-2


@pytest.mark.skipif(not logprobs.out_dtype_kernel_works(), reason="this torch has no fake-tensor rule for mm.dtype")
def test_dapo_plan_sees_the_gpus_bf16_in_fp32_out_matmul():
    # Under fake tensors (`dapo plan`) the head runs aten's mm with out_dtype, as on CUDA: no fp32 copy of the weight.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen, self.copies = set(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.add(str(func))
            if func is torch.ops.aten._to_copy.default:
                self.copies.append((tuple(out.shape), out.dtype))
            return out

    hidden, weight, targets, _ = bf16_head_inputs()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (hidden, weight.requires_grad_(), targets)]
        with Ops() as ops:
            logp, _ = token_logprobs(fake[0], fake[1], None, fake[2], 0.7, 40)
            logp.sum().backward()
    assert "aten.mm.dtype" in ops.seen and logp.dtype == torch.float32
    assert (tuple(weight.shape), torch.float32) not in ops.copies, ops.copies
