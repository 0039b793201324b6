"""Model FLOPs and MFU of a training step (as torchtitan reports them).

Model FLOPs count the arithmetic the model needs, not what the step spent on padding or recomputation:
2 N per token for a forward pass and 6 N for forward plus backward (Kaplan et al.), where N is the parameters a
token goes through: the transformer body for every real token (prompt and response, padding excluded) and the
LM head for the scored response tokens only. The attention's own FLOPs (quadratic in the row) are left out, as
in the issue's reference figures. Gradient checkpointing's recomputation is not model FLOPs: MFU stays a measure
of useful work. MFU = model FLOP/s / (peak FLOP/s of one device x devices).
"""

from __future__ import annotations

import torch
from torch import nn

# Dense bf16 tensor-core peak in TFLOP/s per device (vendor data sheets, no sparsity). Matched as substrings of
# torch.cuda.get_device_name(), most specific first; `learner.compute.peak_tflops` overrides.
PEAK_TFLOPS = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0), ("V100", 125.0),
)


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The device's peak dense TFLOP/s: the override, else the table for a known GPU, else None (a CPU has no
    table entry: its MFU is not reported)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(body, head): parameters every token goes through (embeddings excluded: a lookup, not a matmul), and the
    LM head's, which only the scored positions go through. Counted on the unsharded model, once per tied tensor."""
    head = model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    tied = head is embedding
    body = total - embedding.numel() - (0 if tied else head.numel())
    return body, head.numel()


def attention_crossover(config, body: int) -> float:
    """The row length at which a row's causal attention costs as many FLOPs as its matrix products: per layer
    2 d T^2 forward (QK^T and AV, half of the square), against 2 N T over the layers, so T = N / (d L), with d the
    query heads' width. Attention is not in the MFU's 6N (a conservative count); this is for balancing ranks."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    return body / (width * config.num_hidden_layers)


def model_flops(body: int, head: int, trained: int, trained_scored: int, forward: int, forward_scored: int) -> float:
    """Model FLOPs of a step: 6 N per token trained (forward and backward), 2 N per token of no-grad passes;
    `trained`/`forward` count the tokens through the body, `*_scored` those through the head."""
    return 6.0 * (body * trained + head * trained_scored) + 2.0 * (body * forward + head * forward_scored)


def utilisation(flops: float, seconds: float, devices: int, peak: float | None) -> dict[str, float]:
    """model_tflops (per device) and, where the peak is known, mfu."""
    if seconds <= 0:
        return {"model_tflops": 0.0}
    per_device = flops / seconds / devices / 1e12
    out = {"model_tflops": per_device}
    if peak:
        out["mfu"] = per_device / peak
    return out
