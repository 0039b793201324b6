"""Reward: answer extraction and verification, reward shaping, the reward worker and its HTTP app.

Library use: `from reward import verify`; `verify(response, ground_truth)` returns a `Verdict` with
`correct`, `extracted`, `rule` and `detail`. It is pure and has no time limit; for untrusted text at scale use
`reward.sandbox.VerifierPool`, which adds a per-item time and memory limit.
"""

from reward.verify import Verdict, verify

__all__ = ["Verdict", "verify"]
