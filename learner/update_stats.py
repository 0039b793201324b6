"""The running sums of one training step's metrics: loss, clip fractions, entropy, KL to the behaviour policy, the
TIS weights, the largest log-ratio and the model FLOPs, reduced over ranks once at the end of the step."""

from __future__ import annotations

import logging

import torch

from learner import dapo, throughput
from learner.packing import MicroBatch

log = logging.getLogger(__name__)


class UpdateStats:
    """Running sums for the step's metrics (per-token sums over loss tokens; reduced over ranks at the end).

    The sums stay on the device until `reduced`: reading a GPU value waits for the GPU, so the micro-batch loop
    never does (one read a step)."""

    KEYS = ("loss", "tokens", "clip_low", "clip_high", "clip_dual", "entropy", "approx_kl",
            "tis", "tis_capped", "tis_tokens")

    def __init__(self, device):
        self.sums = torch.zeros(len(self.KEYS), dtype=torch.float64, device=device)
        # max |log pi - log mu| over the loss tokens: few tokens or the whole policy?
        self.largest_log_ratio = torch.zeros((), dtype=torch.float64, device=device)
        self.updates = 0
        self.skipped = 0  # mini-batches with no loss token (no step taken); non-finite norms are counted on the device
        self.grad_norms = torch.zeros(2, dtype=torch.float64, device=device)  # the finite norms' sum, non-finite count
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # forward includes pi_old's pass
        # Tokens through the model (padding excluded) and through its head, for the model FLOPs (host counts).
        self.model_tokens = {"trained": 0, "trained_scored": 0, "forward": 0, "forward_scored": 0}

    def count(self, inputs: MicroBatch, trained: bool) -> None:
        kind = "trained" if trained else "forward"
        self.model_tokens[kind] += inputs.real_tokens
        self.model_tokens[f"{kind}_scored"] += inputs.targets.numel()  # a shape, not a read of the device

    def add_norm(self, norm) -> torch.Tensor:
        """Count an update and its gradient norm (a device tensor, never read here); whether it is finite."""
        from torch.distributed.tensor import DTensor

        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach().double()
        norm = norm.to(self.grad_norms.device)  # (FSDP's CPU offload: the gradients, and so their norm, on the host)
        finite = torch.isfinite(norm)
        self.grad_norms += torch.stack([torch.where(finite, norm, 0.0), (~finite).double()])
        self.updates += 1
        return finite

    def add_tokens(self, loss, mask, surrogate, entropy, logp, behaviour, tis, cap, first_epoch) -> None:
        values = {
            "loss": loss.detach(), "tokens": mask.sum(), **dapo.clip_counts(surrogate, mask),
            "entropy": (entropy.detach() * mask).sum(),
            "approx_kl": (dapo.kl_k3(behaviour, logp) * mask).sum(),  # KL(behaviour || current)
        }
        if first_epoch:  # the weights are constant over the step: count each token once
            values["tis"] = ((1.0 if tis is None else tis) * mask).sum()  # no weight (tis_cap null): 1
            if tis is not None:
                values["tis_capped"] = ((tis >= cap * (1 - 1e-6)) * mask).sum()
            values["tis_tokens"] = mask.sum()
        zero = mask.new_zeros(())
        self.sums += torch.stack([values.get(key, zero).double() for key in self.KEYS])
        ratio = ((logp - behaviour).abs() * mask).max().double()
        self.largest_log_ratio = torch.maximum(self.largest_log_ratio, ratio)

    def reduced(self, accelerator, parameter_counts: tuple[int, int] = (0, 0)) -> dict[str, float]:
        """The sums over all ranks (model_flops: every rank's, learner/throughput.py), and log_ratio_max: the largest
        |log pi - log mu| of the step. approx_kl is a mean, and k3 grows like the ratio itself: one token the
        behaviour policy sampled at e^-10 of the learner's probability lifts it to ~1 over 10^4 tokens. A spike with
        this near 10 is a few tokens; near 1, a drift."""
        flops = throughput.model_flops(*parameter_counts, **self.model_tokens)
        sums = torch.cat([self.sums, self.sums.new_tensor([flops])])
        largest = self.largest_log_ratio.reshape(1)
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, reduction="sum")
            largest = accelerator.gather(largest)
        values = dict(zip(self.KEYS + ("model_flops",), sums.tolist()))
        values["log_ratio_max"] = float(largest.max())
        return values

    def metrics(self, accelerator, parameter_counts: tuple[int, int], seconds: float,
                peak_tflops: float | None) -> dict[str, float]:
        """The step's metrics of the update itself, over all ranks (the step's one read of its sums)."""
        totals = self.reduced(accelerator, parameter_counts)
        tokens = max(totals["tokens"], 1.0)
        norms, non_finite = self.grad_norms.tolist()  # the same on every rank: the norm is the whole gradient's
        if non_finite:
            log.warning("%d of %d updates skipped: non-finite gradient norm", non_finite, self.updates)
        skipped = self.skipped + int(non_finite)
        return {
            "loss": totals["loss"] / max(self.updates - self.skipped, 1),  # (a non-finite update's loss counted)
            "clip_frac_low": totals["clip_low"] / tokens,
            "clip_frac_high": totals["clip_high"] / tokens,
            "clip_frac_dual": totals["clip_dual"] / tokens,
            "entropy": totals["entropy"] / tokens,
            "approx_kl": totals["approx_kl"] / tokens,
            "log_ratio_max": totals["log_ratio_max"],
            "tis_mean": totals["tis"] / max(totals["tis_tokens"], 1.0),
            "tis_capped_frac": totals["tis_capped"] / max(totals["tis_tokens"], 1.0),
            "grad_norm": norms / max(self.updates - skipped, 1),
            "updates": float(self.updates),
            "skipped_updates": float(skipped),
            **throughput.utilisation(totals["model_flops"], seconds, accelerator.num_processes, peak_tflops),
            **{f"{phase}_seconds": value for phase, value in self.seconds.items()},  # this rank's
        }
