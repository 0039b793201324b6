"""Peak memory of the LM head's part of a training step: the full-vocabulary formula against the chunked head.

The part measured: hidden states of the scored positions -> logprobs of the target tokens and entropies at a
temperature -> a loss through both -> backward into the hidden states and the head's weight. Two ways, each in a
fresh process so that its peak resident memory (ru_maxrss) is its own:

- `full`, the trainer's former formula: logits of every position, an fp32 copy at the temperature, logsumexp,
  the softmax again for the entropy, all kept for backward;
- `chunked`, learner/logprobs.py: `chunk_tokens` positions at a time, recomputed in backward.

Reported: the peak above the process's resident memory once the inputs exist (the head's fp32 weight included,
and its gradient, which both ways allocate), at Qwen2.5's vocabulary (151,936) and Qwen2.5-1.5B's hidden size.
On a CPU, in fp32; a GPU's bf16 logits halve the full formula's first tensor, not its fp32 copies.

    python -m benchmarks.head_memory --tokens 1024 2048 4096 --write
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

from benchmarks.runs import in_fresh_process, print_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "head_memory.json"
VOCAB, HIDDEN = 151_936, 1536


def _resident_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mb(method: str, tokens: int, chunk: int) -> dict:
    """One measurement, meant to run in a fresh process."""
    import torch

    from learner import dapo
    from learner.logprobs import token_logprobs

    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), generator=generator)
    before = _resident_mb()
    if method == "full":
        logits = (hidden @ weight.t()).float() / 0.7
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        entropy = dapo.token_entropy(logits)
    else:
        logp, entropy = token_logprobs(hidden, weight, None, targets, 0.7, chunk)
    (logp.sum() + 0.01 * entropy.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"method": method, "tokens": tokens, "chunk": chunk if method == "chunked" else None,
            "peak_mb": peak - before}


def measure(token_counts: list[int], chunk: int) -> list[dict]:
    rows = []
    for tokens in token_counts:
        for method in ("full", "chunked"):
            rows.append(in_fresh_process(peak_mb, method, tokens, chunk))
            print(rows[-1], flush=True)
    return rows


def report(rows: list[dict], command: str) -> str:
    lines = [
        f"`{command}`", "",
        f"The LM head's part of a step (logprobs and entropies of the scored positions, forward and backward) at "
        f"V = {VOCAB:,}, H = {HIDDEN} (Qwen2.5-1.5B), fp32 on the CPU; peak resident memory above the inputs, "
        "each in a fresh process (the head's weight gradient, 0.9 GB, is in both).", "",
        "| scored tokens | full formula, GB | chunked (chunk tokens), GB | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    by_tokens: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_tokens.setdefault(row["tokens"], {})[row["method"]] = row
    for tokens, pair in sorted(by_tokens.items()):
        full, chunked = pair["full"]["peak_mb"], pair["chunked"]["peak_mb"]
        lines.append(f"| {tokens:,} | {full / 1024:.2f} | {chunked / 1024:.2f} ({pair['chunked']['chunk']}) | "
                     f"{full / chunked:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--chunk", type=int, default=1024, help="learner.compute.head_chunk_tokens")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/head_memory.json")
    args = parser.parse_args()
    rows = measure(args.tokens, args.chunk)
    print_report(rows, report(rows, "python -m benchmarks.head_memory " + " ".join(sys.argv[1:])),
                 RESULTS if args.write else None)


if __name__ == "__main__":
    main()
