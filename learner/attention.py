"""Attention confined to each row of a packed micro-batch, through PyTorch's own varlen FlashAttention.

A packed micro-batch (learner/packing.py) is one sequence holding many rows. Without the flash-attn package,
transformers' SDPA path confines attention to each row with a dense `[T x T]` block-diagonal mask: every query
still visits every key of the pack (by count, at a 16k-token pack of the 1.5B shape about as many FLOPs as all
its linear layers: 4 T^2 d L = 4.6e13 against 2 N T = 5.0e13) and the mask itself is `T^2` bytes.
`torch.nn.attention.varlen.varlen_attn` (PyTorch >= 2.10, CUDA, fp16/bf16) runs the flash kernel on the rows'
boundaries (`cu_seqlens`) instead: no mask, no wasted block. It is registered with transformers as the
attention implementation `VARLEN`, and the trainer passes each pack's boundaries, computed on the host when the
pack is built, as keyword arguments of the forward (`cu_seq_lens_q`, ... : the names transformers gives them for
FlashAttention), so the step never reads a length back from the device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect

import torch
from torch import Tensor

VARLEN = "dapo_varlen"
_stand_in = None  # `stand_in`'s kernel while it is in force


@contextlib.contextmanager
def stand_in(kernel):
    """Run `kernel` (varlen_attn's signature) in place of PyTorch's varlen kernel for the duration: `dapo plan`'s
    fake tensors have no CUDA kernel to run (learner/plan.py)."""
    global _stand_in
    _stand_in = kernel
    try:
        yield
    finally:
        _stand_in = None


def kernel():
    """PyTorch's varlen flash kernel (`stand_in`'s while one is in force); None in a torch without it."""
    if _stand_in is not None:
        return _stand_in
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def available(cuda: bool, dtype: torch.dtype) -> bool:
    """Whether packed rows can run on the varlen kernel: a torch with it, a half-precision compute dtype, and a GPU
    its flash kernel runs on (Ampere or newer; a T4 or V100 keeps SDPA)."""
    if not (cuda and dtype in (torch.bfloat16, torch.float16) and kernel() is not None):
        return False
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability() >= (8, 0)


@functools.cache
def _options(kernel) -> tuple[bool, bool, dict]:
    """(native grouped-query support, a `scale` argument, the keyword that makes it causal): the signature changed
    across torch releases (2.10 took `is_causal` and no scale, later ones `scale`, a `window_size` of (-1, 0) and
    then `enable_gqa`)."""
    parameters = inspect.signature(kernel).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    return "enable_gqa" in parameters, "scale" in parameters, causal


def varlen_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, scaling=None,
                             cu_seq_lens_q: Tensor | None = None, max_length_q: int | None = None,
                             sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"attention {VARLEN!r} runs packed rows only: the forward needs cu_seq_lens_q and "
                         "max_length_q (learner/packing.py builds them)")
    if query.shape[0] != 1:
        raise ValueError(f"attention {VARLEN!r}: a packed micro-batch is one sequence, got {query.shape[0]}")
    if sliding_window is not None or softcap is not None or s_aux is not None:
        raise ValueError(f"attention {VARLEN!r} is plain causal attention: this model asks for a sliding window, "
                         "a softcap or attention sinks (set learner.compute.attention: sdpa)")
    # Under autocast the rotary embedding leaves q and k in fp32 (SDPA is cast by autocast; this op is not).
    dtype = torch.get_autocast_dtype(query.device.type) if torch.is_autocast_enabled(query.device.type) \
        else value.dtype
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))  # [T, H, D]
    run = kernel()
    native_gqa, takes_scale, causal = _options(run)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not native_gqa:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    options = {**causal, **({"enable_gqa": True} if groups > 1 and native_gqa else {})}
    if takes_scale:
        options["scale"] = scaling
    elif scaling is not None:  # the kernel's own scale is D^-1/2: fold the model's into the queries
        q = q * (scaling * q.shape[-1] ** 0.5)
    out = run(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, **options)
    return out.unsqueeze(0), None


def register() -> None:
    """Make `VARLEN` a valid `attn_implementation` (with no mask: the rows' boundaries replace it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


def packed_kwargs(cu_seqlens: Tensor, longest_row: int) -> dict:
    """The forward's keyword arguments for a pack whose rows start at `cu_seqlens` (int32, on the device)."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": longest_row,
            "max_length_k": longest_row}


def implementation(choice: str, cuda: bool, packed: bool, dtype: torch.dtype) -> str:
    """The attention kernel the learner's model runs. `auto`, on a GPU in half precision: varlen FlashAttention-2
    where the flash-attn package is installed, else for packed rows PyTorch's own varlen flash kernel
    (learner/attention.py); both see the rows' boundaries, no mask. Otherwise PyTorch's SDPA (on packed rows with
    a block-diagonal mask built from the position ids: correct, but every query visits the whole pack)."""
    varlen = available(cuda, dtype)
    if choice == "varlen":
        if not (packed and varlen):
            raise ValueError("learner.compute.attention=varlen needs packed rows on a GPU in bf16/fp16 "
                             "and torch >= 2.10")
        choice = VARLEN
    elif choice == "auto":
        # flash-attn brings its own kernel: it needs no torch >= 2.10, only a GPU and half precision
        if cuda and dtype in (torch.bfloat16, torch.float16) and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        choice = VARLEN if packed and varlen else "sdpa"
    elif choice == "flex_attention" and not cuda:  # torch 2.13: no backward on a CPU, and its CPU codegen fails
        raise ValueError("learner.compute.attention=flex_attention needs a GPU (on a CPU torch has no backward for "
                         "it): use auto, sdpa or eager")
    if choice == VARLEN:
        register()
    return choice
