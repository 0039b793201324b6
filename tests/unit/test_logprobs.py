"""Chunked logprobs and entropy through the LM head (learner/logprobs.py) against the plain full-vocabulary
formula: values and gradients equal within 1e-5 in fp32, at any chunk size, with a temperature and a bias."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learner import dapo
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
