"""Token logprobs and entropies through the LM head in chunks: no [tokens x vocab] tensor in fp32 ever exists.

The policy's logprob of a response token is log softmax(h W^T / T)[target] for the hidden state h of the position
before it. Computing it the plain way materialises the logits of every position (prompt and padding included) and
then fp32 copies of them for logsumexp and the entropy's softmax: at Qwen2.5's vocabulary (151,936) and 32k tokens,
about 20 GB per copy. Here only the selected positions reach the head, `chunk_tokens` at a time; the logsumexp,
the target's logit and the entropy are computed per chunk, and the backward pass recomputes each chunk's logits
instead of keeping them (the idea of Liger's fused linear cross-entropy). Peak memory of this part: one chunk's
[chunk x V] logits and softmax, whatever the number of tokens.

`LogprobHead` puts this inside the model's own forward (it replaces `lm_head`, sharing its parameters and names),
so FSDP's hooks gather the head's weight as they would for the plain linear layer.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.nn import functional as F

from learner import activation_checkpointing, attention

if TYPE_CHECKING:  # pragma: no cover
    from learner.packing import MicroBatch
    from learner.sequence_parallel import SequenceGroup


def _matmul_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (bf16 on a GPU), else the weight's."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(hidden [n, H], weight [V, H], bias [V] | None, targets [n]) -> (logp [n], entropy [n]), both fp32.

    Per chunk of c tokens at most three [c, V] fp32 tensors are alive (the logits, their exponentials and
    logsumexp's own); everything else is updated in place."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, dtype, compiled):
        n = hidden.shape[0]
        logp = torch.empty(n, device=hidden.device, dtype=torch.float32)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp)
        w = _logits_weight(weight.to(dtype))
        b = None if bias is None else bias.to(dtype)
        chunk_stats = _compiled(_chunk_stats) if compiled else _chunk_stats
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logp[start:end], lse[start:end], entropy[start:end] = chunk_stats(
                hidden[start:end], w, b, targets[start:end], temperature, dtype)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_tokens, ctx.dtype, ctx.compiled = temperature, chunk_tokens, dtype, compiled
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(targets)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens, dtype = ctx.temperature, ctx.chunk_tokens, ctx.dtype
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias and bias is not None else None
        if grad_logp is None and grad_entropy is None:
            return grad_hidden, grad_weight, grad_bias, None, None, None, None, None
        w = weight.to(dtype)
        w_logits = _logits_weight(w)
        b = None if bias is None else bias.to(dtype)
        chunk_logit_grads = _compiled(_chunk_logit_grads) if ctx.compiled else _chunk_logit_grads
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            grad_z = chunk_logit_grads(
                h, w_logits, b, targets[start:end], lse[start:end], entropy[start:end],
                None if grad_logp is None else grad_logp[start:end],
                None if grad_entropy is None else grad_entropy[start:end], temperature, dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_z @ w).to(hidden.dtype)
            if grad_weight is not None:
                if grad_z.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_z.t(), h)
                else:  # bf16 products accumulated in fp32
                    grad_weight.add_(grad_z.t() @ h)
            if grad_bias is not None:
                grad_bias += grad_z.float().sum(0)
            del grad_z
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _chunk_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(logp of the targets, logsumexp, entropy) of one chunk, [c] each in fp32."""
    z = _chunk_logits(hidden, weight, bias, dtype, temperature)
    lse = torch.logsumexp(z, dim=-1)
    log_p = z.sub_(lse[:, None])
    # H = -sum_v p_v log p_v (the softmax's entropy at temperature T), from log p itself: lse - sum_v p_v z_v, the
    # same in exact arithmetic, loses digits to the cancellation of two numbers the size of the largest logit.
    p = log_p.exp()
    return log_p.gather(-1, targets[:, None]).squeeze(-1), lse, p.mul_(log_p).sum(-1).neg_()


def _chunk_logit_grads(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, lse: Tensor,
                       entropy: Tensor, grad_logp: Tensor | None, grad_entropy: Tensor | None, temperature: float,
                       dtype: torch.dtype) -> Tensor:
    """The loss's gradient in one chunk's logits h W^T + b, [c, V] in `dtype`, from the logits recomputed."""
    log_p = _chunk_logits(hidden, weight, bias, dtype, temperature).sub_(lse[:, None])
    p = log_p.exp()
    # d logp_target / dz = onehot - p;  dH / dz = -p (log p + H):  grad_z = -p (g_logp + g_H (log p + H)),
    # plus g_logp at the target. log_p becomes the bracket, p the gradient, in place.
    if grad_entropy is not None:
        log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None])
        if grad_logp is not None:
            log_p.add_(grad_logp[:, None])
        p.mul_(log_p)
    else:
        p.mul_(grad_logp[:, None])
    del log_p
    grad_z = p.neg_()
    if grad_logp is not None:
        grad_z.scatter_add_(-1, targets[:, None], grad_logp[:, None])
    return grad_z.div_(temperature).to(dtype)  # through z = logits / T


@functools.cache
def _compiled(chunk_function):
    """learner.compute.compile: the same per-chunk work fused by inductor (a few passes over the bf16 logits instead of
    a dozen over fp32 copies of them), made on first use. Lengths are dynamic from the start: every last chunk is
    ragged."""
    return activation_checkpointing.compiled(chunk_function)


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
                  temperature: float) -> Tensor:
    """z = (h W^T + b) / T of one chunk, a fresh fp32 tensor (safe to update in place).

    From bf16 operands the matmul's fp32 accumulator is kept as it is: logits rounded to bf16 before the logsumexp
    would move each logp by up to 2^-9 of its logit (0.03 nats at a logit of 16), more than one update at lr 1e-6
    moves it, and the ratios, clip decisions and TIS weights would follow that noise. `weight` comes from
    `_logits_weight`: in `dtype` for aten's mm with `out_dtype`, or that weight's fp32 copy where the kernel is
    missing (the operands' exact products in fp32, the same values)."""
    h = hidden.to(dtype)
    if weight.dtype != h.dtype:
        with torch.autocast(h.device.type, enabled=False):  # or autocast would round the product to bf16 again
            z = h.float() @ weight.t()
    elif dtype.itemsize < 4:
        z = torch.mm(h, weight.t(), out_dtype=torch.float32)
    else:
        z = h @ weight.t()
    if bias is not None:
        z.add_(bias)
    return z.div_(temperature)


def _logits_weight(weight: Tensor) -> Tensor:
    """The head's weight for `_chunk_logits`, made once per pass: as it is, unless it is bf16 (or fp16) and aten's mm
    with `out_dtype` does not run here, then its fp32 copy."""
    return weight if weight.dtype.itemsize >= 4 or _has_out_dtype_kernel(weight) else weight.float()


@functools.cache
def out_dtype_kernel_works() -> bool:
    """Whether aten's mm with `out_dtype` works under fake tensors (what `dapo plan` and torch.compile trace with):
    the overload came with torch 2.8, its fake-tensor rule works from about 2.10 (pytorch#163393). Probed once, on
    first use."""
    if "dtype" not in torch.ops.aten.mm.overloads():
        return False
    try:
        with FakeTensorMode():
            square = torch.empty(2, 2, dtype=torch.bfloat16)
            return torch.mm(square, square, out_dtype=torch.float32).dtype == torch.float32
    except Exception:  # any failure of that rule means: not here
        return False


def _has_out_dtype_kernel(weight: Tensor) -> bool:
    """Whether aten's mm with `out_dtype` (bf16 in, fp32 out) runs on the weight's backend: CUDA does; a fake tensor
    (`dapo plan`) stands for a GPU's; the CPU has no such kernel."""
    return (weight.is_cuda or is_fake(weight)) and out_dtype_kernel_works()


def token_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float = 1.0,
                   chunk_tokens: int = 1024, compiled: bool = False) -> tuple[Tensor, Tensor]:
    """log softmax(hidden W^T + b) / T)[targets] and the softmax's entropy per token, [n] each in fp32,
    differentiable in hidden, weight and bias, with at most `chunk_tokens` rows of logits alive at a time
    (`compiled`: each chunk's work through torch.compile)."""
    if hidden.shape[0] == 0:
        # Keeps the graph through the head and the body (FSDP's hooks, and a sequence-parallel share that scores
        # nothing still runs its attention's backward exchange with the other ranks of its group).
        empty = hidden.new_zeros(0, dtype=torch.float32) + 0 * weight.sum() + 0 * hidden.sum()
        return empty, empty
    return _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), max(1, int(chunk_tokens)),
                                       _matmul_dtype(weight), compiled)


@dataclass
class HeadQuery:
    """Which hidden states to score: [n] (row, position) in the model's output and the token each predicts."""

    rows: Tensor
    positions: Tensor
    targets: Tensor
    entropy_grad: bool = False  # the entropy's gradient is taken only with an entropy bonus


class LogprobHead(nn.Module):
    """The model's LM head (same `weight`/`bias` parameters, so the same state-dict names and tied embeddings).

    Plain logits while no query is set; inside `scoring(query)`, the model's forward returns `[n, 2]` instead of
    logits: the logprob and the entropy of the queried tokens (fp32), computed in chunks by `token_logprobs`."""

    def __init__(self, linear: nn.Linear, temperature: float, chunk_tokens: int, compiled: bool = False):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.compiled = compiled
        self.query: HeadQuery | None = None

    @contextlib.contextmanager
    def scoring(self, query: HeadQuery):
        self.query = query
        try:
            yield
        finally:
            self.query = None

    def forward(self, hidden: Tensor) -> Tensor:
        if self.query is None:
            return F.linear(hidden, self.weight, self.bias)
        q = self.query
        selected = hidden[q.rows, q.positions]  # [n, H]: response positions only
        logp, entropy = token_logprobs(selected, self.weight, self.bias, q.targets, self.temperature,
                                       self.chunk_tokens, self.compiled)
        return torch.stack([logp, entropy if q.entropy_grad else entropy.detach()], dim=-1)


def install_head(model: nn.Module, temperature: float, chunk_tokens: int, compiled: bool = False) -> LogprobHead:
    """Replace the model's output embedding with a `LogprobHead` over the same parameters (before any wrapping)."""
    linear = model.get_output_embeddings()
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"the learner needs a linear LM head, found {type(linear).__name__}")
    head = LogprobHead(linear, temperature, chunk_tokens, compiled)
    model.set_output_embeddings(head)
    return head


def response_logprobs(model, head: LogprobHead, inputs: "MicroBatch", varlen: bool, entropy: bool,
                      entropy_grad: bool = False, sequence: "SequenceGroup | None" = None):
    """Logprobs (and optionally entropies) of a micro-batch's response tokens through `head`, padded to [B, R];
    `varlen`: the attention kernel takes the pack's row boundaries; `sequence`: `inputs` is this rank's share of a
    pack split over a sequence-parallel group (learner/sequence_parallel.py), whose attention needs the group and
    the boundaries.

    The head scores only the positions that predict response tokens, in chunks:
    the model's forward returns [n, 2] (logprob, entropy) instead of logits."""
    # Train mode only where a gradient is taken; RL fine-tuning assumes a dropout-free model (Qwen2/2.5: 0), so
    # both modes compute the same policy.
    model.train(torch.is_grad_enabled())
    grad = entropy and entropy_grad
    split = sequence is not None and sequence.degree > 1
    prompt, first = inputs.prompt, inputs.first_tokens

    def query(part: slice) -> HeadQuery:
        return HeadQuery(inputs.hidden_row[part], inputs.hidden_pos[part], inputs.targets[part], grad)

    if prompt is None:
        # The varlen kernels get the pack's row boundaries from the host (flash-attn would otherwise derive them
        # from the position ids in every layer, reading the longest row back from the GPU each time).
        rows = (attention.packed_kwargs(inputs.cu_seqlens, inputs.longest_row)
                if varlen or split else {})
        if split:
            rows["sequence_group"] = sequence
        with head.scoring(query(slice(None))):
            scored = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                           position_ids=inputs.position_ids, use_cache=False, **rows).logits
    else:
        # Each prompt once; its KV cache copied to its responses by index, so gradients from every response flow
        # back into the one prompt pass. The prompt's last position predicts each row's first response token.
        with head.scoring(query(slice(0, first))):
            out = model(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask,
                        position_ids=prompt.position_ids, use_cache=True)
        cache = out.past_key_values
        cache.reorder_cache(prompt.of_row)
        with head.scoring(query(slice(first, None))):
            rest = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                         position_ids=inputs.position_ids, past_key_values=cache, use_cache=True).logits
        scored = torch.cat([out.logits, rest])
    scored = scored.float()
    shape, where = inputs.response_mask.shape, (inputs.token_response, inputs.token_slot)
    logp = torch.zeros(shape, device=scored.device).index_put(where, scored[:, 0])
    token_h = torch.zeros(shape, device=scored.device).index_put(where, scored[:, 1]) if entropy else None
    return logp, token_h
