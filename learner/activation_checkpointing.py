"""What the decoder layers keep for backward, and whether they are compiled (learner.compute.gradient_checkpointing,
learner.compute.compile).

- `off`: every activation is kept (the fastest backward, the most memory: about 180 KB a token and layer at the
  1.5B layer shape in fp32, benchmarks/recompute.py);
- `full`: only each layer's input is kept and the whole layer runs again in backward (a third more of the layers'
  FLOPs: 8N a token instead of 6N);
- `selective`: the outputs of the matrix products, of attention and of sequence parallelism's exchanges are kept, the
  elementwise work between them (norms, rotary, SiLU, residual adds) is recomputed: about three quarters of `off`'s
  activation memory (half, compiled) and none of `full`'s extra FLOPs (torchtitan's op-level selective checkpointing
  keeps fewer products for less memory).

The checkpoint sits inside each layer's forward and `torch.compile`, when on, compiles that forward around it (the
arrangement torchtitan compiles: the recompute is traced with the layer, so the selective policy sees aten ops,
not compiled kernels). The layers stay the model's own modules: state-dict keys, FSDP2's wrapping and checkpoints
are unchanged.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

Checkpointing = Literal["off", "full", "selective"]

# Kept by `selective`: matrix products and every attention kernel torch or flash-attn may run (by name: which
# exist depends on the torch build and on whether flash-attn is installed).
_SAVED_OP_NAMES = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward", "aten._efficient_attention_forward",
    "torch_attn._varlen_attn",  # torch.nn.attention.varlen (learner/attention.py)
    "flash_attn._flash_attn_forward", "flash_attn._flash_attn_varlen_forward",  # flash-attn >= 2.6
    # Sequence parallelism's all-to-alls (learner/sequence_parallel.py): network time, kept as torchtitan keeps its
    # collectives' outputs (recomputed, backward would send q, k, v and the output again: as many as `full`)
    "_c10d_functional.all_to_all_single",
)


@functools.cache
def saved_ops() -> frozenset:
    """The op overloads `selective` keeps (those this process has)."""
    ops = set()
    for name in _SAVED_OP_NAMES:
        namespace, op = name.split(".")
        try:
            ops.add(getattr(getattr(torch.ops, namespace), op).default)
        except (AttributeError, RuntimeError):  # not in this build / not installed
            continue
    return frozenset(ops)


def _keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


# The `context_fn` of a selectively checkpointed layer (benchmarks/gpu_trainer.py's strong baseline takes it too).
SELECTIVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, _keep_products)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of a transformers causal LM (`model.model.layers` for Qwen2 and Llama)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers found (learner.compute.gradient_checkpointing and "
                         "learner.compute.compile need model.get_decoder().layers)")
    return layers


def prepare_layers(model: torch.nn.Module, checkpointing: Checkpointing, compile: bool = False) -> None:
    """Route each decoder layer's forward through `run_layer` (compiled when asked), before any accelerate/FSDP
    wrapping. Every layer calls the same function with itself as an argument: torch.compile traces it for all of
    them (one graph with dynamic lengths, as packs differ in length by design; not one per layer), and the module
    hooks (FSDP2's gathers) stay outside the compiled code."""
    if checkpointing == "off" and not compile:
        return
    run = compiled(run_layer) if compile else run_layer
    for layer in decoder_layers(model):
        layer.forward = functools.partial(run, layer, type(layer).forward, checkpointing)


def compiled(function):
    """torch.compile(function) with dynamic lengths, and an error where torch would silently run it eagerly once
    it has recompiled it `recompile_limit` times (every layer shares one compiled function, and its limit)."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(function, dynamic=True)


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process (a step's metric: a count that keeps growing is recompiling)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_layer(layer: torch.nn.Module, forward, checkpointing: Checkpointing, *args, **kwargs):
    """One decoder layer's forward under its checkpoint. A no-grad forward (pi_old, evaluation) runs plainly:
    there is no backward to save for."""
    if checkpointing == "off" or not torch.is_grad_enabled():
        return forward(layer, *args, **kwargs)
    context = {"context_fn": SELECTIVE_CONTEXT} if checkpointing == "selective" else {}
    return checkpoint(forward, layer, *args, use_reentrant=False, **context, **kwargs)
