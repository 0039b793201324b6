"""`dapo plan`: the learner's real step under fake tensors, on a fake process group (learner/plan.py).

Each plan runs in its own process, as a user runs it: the fake process group and accelerate's precision are per
process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

GIB = 2**30


def plan(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "cli", "plan", *args], capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def figures(out: str) -> dict[str, float]:
    """The report's GiB lines: category -> GiB."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^  (\w[\w ]*?)\s+([\d.]+) GiB", out, re.M)}


def test_the_tiny_default_plans_in_seconds_and_fits():
    code, out = plan("tiny-cpu", "--gpus", "1")
    assert code == 0, out
    sizes = figures(out)
    assert {"parameters", "gradients", "optimizer state", "activations", "runtime", "total"} <= sizes.keys(), out
    assert sizes["activations"] > 0 and "fits with" in out
    assert "estimated, not traced: attention kernel" in out  # what the fake tensors cannot trace is said


def test_an_unknown_card_or_a_row_longer_than_the_micro_batch_is_a_usage_error():
    code, out = plan("tiny-cpu", "--gpus", "1", "--gpu", "tpu")
    assert code == 2 and "unknown GPU 'tpu'" in out
    code, out = plan("tiny-cpu", "--gpus", "1", "--set", "learner.compute.micro_batch_tokens=100")
    assert code == 2 and "longer than learner.compute.micro_batch_tokens 100" in out


@pytest.mark.slow
def test_the_papers_recipe_fits_its_overlay_with_headroom_and_shards_its_state():
    """The shipped 32B preset on the overlay's 32 GPUs (16 learner ranks of 80 GB): fits with >= 10 % free, and
    AdamW's two fp32 moments are 1/16 of 8 bytes a parameter on each rank."""
    code, out = plan("dapo-qwen2.5-32b", "--gpus", "32")
    assert code == 0, out
    parameters = float(re.search(r"([\d.]+) B parameters", out)[1]) * 1e9
    sizes = figures(out)
    assert sizes["optimizer state"] == pytest.approx(8 * parameters / 16 / GIB, rel=0.01)
    assert sizes["total"] <= 0.9 * 79.1, out
    headroom = int(re.search(r"fits with (\d+)% headroom", out)[1])
    assert headroom >= 10


@pytest.mark.slow
def test_a_recipe_that_does_not_fit_says_so_and_finds_the_change_that_does():
    # The 1.5B preset on one 48 GB card: its selective checkpointing keeps too much; full checkpointing fits.
    code, out = plan("dapo-qwen2.5-math-1.5b", "--gpus", "1", "--gpu", "l40s")
    assert code == 1 and "does NOT fit" in out, out
    tried = re.search(r"^with learner.compute.gradient_checkpointing: full: ([\d.]+) GiB, fits$", out, re.M)
    assert tried and float(tried[1]) < figures(out)["total"], out


def test_the_peak_only_tracker_finds_pytorchs_peak_by_category():
    """The plan's tracker skips PyTorch's per-module peaks (learner/plan.py `peak_only`): its overall peak, by
    category, is MemTracker's own, on a model and its optimizer through forward, backward and a step."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from learner.plan import peak_only

    def peak(tracker_class) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                          torch.nn.Linear(256, 64)) for _ in range(3)))
        optimizer = torch.optim.AdamW(model.parameters())

        def update() -> None:
            model(torch.randn(32, 64)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        update()  # as the plan does: AdamW's moments made, then the steady state tracked
        tracker = tracker_class()
        tracker.track_external(model, optimizer)
        with tracker:
            update()
        return {str(device): dict(stats) for device, stats in tracker.get_tracker_snapshot("peak").items()}

    full = peak(MemTracker)
    assert full["cpu"]["Total"] > 0 and peak(peak_only(MemTracker)) == full
