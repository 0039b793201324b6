"""`dapo plan`: the learner's real step under fake tensors, on a fake process group (learner/plan.py).

Each plan runs in its own process, as a user runs it: the fake process group and accelerate's precision are per
process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

GIB = 2**30


def plan(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "cli", "plan", *args], capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def figures(out: str) -> dict[str, float]:
    """The report's GiB lines: category -> GiB."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^  (\w[\w ]*?)\s+([\d.]+) GiB", out, re.M)}


def test_the_tiny_default_plans_in_seconds_and_fits():
    code, out = plan("tiny-cpu", "--gpus", "1", "--mfu", "0.2")
    assert code == 0 and "at 20% MFU" in out, out  # the time estimate says the MFU it assumes
    sizes = figures(out)
    assert {"parameters", "gradients", "optimizer state", "activations", "runtime", "total"} <= sizes.keys(), out
    assert sizes["activations"] > 0 and "fits with" in out
    assert "estimated, not traced: attention kernel" in out  # what the fake tensors cannot trace is said


def test_an_unknown_card_or_a_row_longer_than_the_micro_batch_is_a_usage_error():
    code, out = plan("tiny-cpu", "--gpus", "1", "--gpu", "tpu")
    assert code == 2 and "unknown GPU 'tpu'" in out
    code, out = plan("tiny-cpu", "--gpus", "1", "--set", "learner.compute.micro_batch_tokens=100")
    assert code == 2 and "longer than learner.compute.micro_batch_tokens 100" in out
    from learner.plan import PlanError, make_plan
    from services.config import load_settings

    settings = load_settings("tiny-cpu")  # (each refused before anything is traced)
    for figures_given, reason in (({"gpus": 0}, "--gpus 0: at least 1"),
                                  ({"gpus": 1, "generated_tokens_per_gpu_s": float("nan")}, "nan generated tokens"),
                                  ({"gpus": 2, "learner_ranks": 0}, "0 learner ranks on 2 GPUs"),
                                  ({"gpus": 1, "mfu": 0.0}, "MFU 0.0: a share of the peak"),
                                  ({"gpus": 2, "generated_tokens_per_gpu_s": -5.0}, "-5.0 generated tokens per")):
        with pytest.raises(PlanError, match=reason):
            make_plan(settings, **figures_given)


def test_settings_the_plan_cannot_trace_are_refused_in_one_line_and_a_hub_model_costs_no_weights(monkeypatch):
    """Each was a traceback (or, for a model with no config, another check's message); a hub id downloaded the
    model's every safetensors file (65 GB at 32B) before the plan fell back to the shipped config."""
    from learner import plan as plan_module
    from learner.plan import PlanError, make_plan, model_config
    from services.config import load_settings

    for overrides, reason in (({"learner": {"loss": {"kl_coef": 0.01}}}, "kl_coef > 0 keeps a reference model"),
                              ({"learner": {"compute": {"fsdp": True, "fsdp_shard_ranks": 3}}},
                               "fsdp_shard_ranks 3 must divide the 2 learner ranks"),
                              ({"model": {"name_or_path": "/nonexistent/model"}}, "no config for model")):
        with pytest.raises(PlanError, match=re.escape(reason)):
            make_plan(load_settings("tiny-cpu", **overrides), 4)

    def no_weights(*args, **kwargs):
        raise AssertionError(f"a download: {args} {kwargs}")

    monkeypatch.setattr("huggingface_hub.snapshot_download", no_weights)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", no_weights)
    assert model_config(load_settings("dapo-qwen2.5-32b")).num_hidden_layers == 64
    # The card's name in any case; and the GRPO rows push B prompts a step (no dynamic sampling): half the sampling.
    monkeypatch.setattr(plan_module, "traced_peak", lambda settings, ranks: ({"parameters": 2**30}, 10**9, 64, 0))
    dapo = make_plan(load_settings("tiny-cpu"), 2, gpu="H100")
    grpo = make_plan(load_settings("tiny-cpu", learner={"batch": {"dynamic_sampling": False}}), 2, gpu="H100")
    assert grpo.generation_seconds == pytest.approx(dapo.generation_seconds / 2)
    # Replicas (fsdp off) on several ranks run under DDP, whose buckets hold a second copy of the gradients.
    replicas = make_plan(load_settings("tiny-cpu", learner={"compute": {"fsdp": False}}), 4)
    alone = make_plan(load_settings("tiny-cpu", learner={"compute": {"fsdp": False}}), 1)
    assert replicas.bytes_by_category["gradients"] - alone.bytes_by_category.get("gradients", 0) == 4 * 10**9


def test_a_one_card_fsdp_plan_leaves_no_process_group_behind_for_the_next_plan():
    """The search plans more ranks after a one-card plan that did not fit: under FSDP that plan made a real
    one-process group and kept it, and the next one failed (`default process group twice`)."""
    script = """if True:
        from learner import plan
        from services.config import load_settings
        settings = load_settings("tiny-cpu", learner={"compute": {"fsdp": True}})
        print(plan.make_plan(settings, 1).learner_ranks, plan.make_plan(settings, 2, learner_ranks=2).learner_ranks)
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["1", "2"], done.stderr[-3000:]


def offload_plans() -> dict:
    """The tiny preset's plan on 2 ranks under FSDP, without and with CPU offload, in bytes (its figures are too
    small for the report's GiB)."""
    script = """if True:
        import json
        from learner import plan
        from services.config import load_settings
        figures = {}
        for name, offload in (("kept", False), ("offloaded", True)):
            settings = load_settings("tiny-cpu", learner={"compute": {"fsdp": True, "fsdp_offload": offload}})
            made = plan.make_plan(settings, 4)
            figures[name] = {**made.bytes_by_category, "host": made.host_bytes, "parameters_n": made.parameters}
        print(json.dumps(figures))
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_with_cpu_offload_the_plan_keeps_the_shards_and_adamw_off_the_card():
    """`fsdp_offload`: the parameter shards (fp32), their gradients and AdamW's two moments are in host memory; the
    card holds the layers gathered in turn and the same activations as without it."""
    kept, offloaded = offload_plans().values()
    parameters = kept.pop("parameters_n")
    assert offloaded["optimizer state"] == 0 and kept["optimizer state"] >= 8 * parameters / 2
    # The host's own peak: fp32 shards, their gradients and AdamW's two moments, 16 bytes a parameter over 2 ranks.
    assert offloaded["host"] == pytest.approx(16 * parameters / 2, rel=0.05) and kept["host"] == 0
    assert offloaded["activations"] == kept["activations"] > 0
    assert offloaded["parameters"] < kept["parameters"]


def test_the_changes_a_plan_tries_end_with_offload_then_more_gpus_and_pairs_add_up():
    from learner.plan import MORE_GPUS, Plan, changes_to_try, pairs_that_may_fit
    from services.config import load_settings

    sharded = load_settings("dapo-qwen2.5-32b")
    tried = changes_to_try(sharded, 32, 16)
    assert [change.what.split(" (")[0] for change in tried[-1 - len(MORE_GPUS):]] == [
        "learner.compute.fsdp_offload: true", *(f"{32 * k} GPUs, {16 * k} learner ranks" for k in MORE_GPUS)]
    assert (tried[-1].gpus, tried[-1].ranks) == (32 * MORE_GPUS[-1], 16 * MORE_GPUS[-1])
    replicas = load_settings("dapo-qwen2.5-32b", learner={"compute": {"fsdp": False}})
    assert changes_to_try(replicas, 32, 16)[0].what == "learner.compute.fsdp: true"
    assert not any("offload" in c.what or "GPUs" in c.what for c in changes_to_try(replicas, 32, 16))

    # A 100 GiB peak on a 100 GiB card: 90 fits, so savings of 10 do (cheapest first); two worlds never pair.
    plan = Plan(preset="p", gpu="x", gpus=32, learner_ranks=16, micro_batch_tokens=1, longest_row=1,
                sequence_parallel=1, bytes_by_category={"activations": int(98 * 2**30)}, host_bytes=0,
                capacity_gib=100.0, parameters=1, step_flops=0, served_bytes=0, shared_fs=False, publish_writers=1,
                learner_seconds=0, generation_seconds=0, total_steps=1)
    split, offload, more, much_more = tried[0], tried[-3], tried[-2], tried[-1]
    assert split.what == "learner.compute.sequence_parallel: 4"  # the preset splits over 2
    pairs = pairs_that_may_fit(plan, [(split, 6.0), (offload, 5.0), (more, 3.0), (much_more, 5.0)])
    assert [pair.what for pair in pairs] == [(split + offload).what, (split + much_more).what,
                                             (offload + much_more).what]
    both = offload + more
    assert both.compute == {"fsdp_offload": True} and (both.gpus, both.ranks) == (64, 32)


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
    # docs/deploy.md prints this budget as the plan prints it (its bracketed comments aside): every figure and line.
    deploy = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    shown = deploy.split("$ dapo plan dapo-qwen2.5-32b --gpus 32\n", 1)[1].split("```", 1)[0]
    assert figures(shown) == sizes, (shown, out)
    printed = [line for line in out.splitlines() if not line.startswith(("  ", "estimated"))]
    assert [line for line in shown.splitlines() if not line.startswith("  ")] == printed, (shown, out)


@pytest.mark.slow
def test_a_recipe_that_does_not_fit_says_so_and_finds_the_change_that_does():
    # The 1.5B preset on one 48 GB card: its selective checkpointing keeps too much; full checkpointing fits.
    code, out = plan("dapo-qwen2.5-math-1.5b", "--gpus", "1", "--gpu", "l40s")
    assert code == 1 and "does NOT fit" in out, out
    # The update accumulates micro-batches: from the second on, the whole fp32 gradient of a replica is held (one
    # micro-batch traced alone peaked before any gradient existed, 5.75 GiB short).
    parameters = float(re.search(r"([\d.]+) B parameters", out)[1]) * 1e9
    assert figures(out)["gradients"] == pytest.approx(4 * parameters / GIB, rel=0.01), out
    tried = re.search(r"^with learner.compute.gradient_checkpointing: full: ([\d.]+) GiB, fits$", out, re.M)
    assert tried and float(tried[1]) < figures(out)["total"], out


def tracked_peak(tracker_class, width: int = 256) -> dict:
    """`tracker_class`'s peak snapshot over a model's forward, backward and AdamW step (after a first one, as the
    plan does: AdamW's moments made, then the steady state tracked)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(),
                                                      torch.nn.Linear(width, 64)) for _ in range(3)))
    optimizer = torch.optim.AdamW(model.parameters())

    def update() -> None:
        model(torch.randn(32, 64)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    update()
    tracker = tracker_class() if issubclass(tracker_class, MemTracker) else tracker_class
    tracker.track_external(model, optimizer)
    with tracker:
        update()
    return {str(device): dict(stats) for device, stats in tracker.get_tracker_snapshot("peak").items()}


def test_the_peak_only_tracker_finds_pytorchs_peak_by_category():
    """The plan's tracker skips PyTorch's per-module peaks (learner/plan.py `peak_only`): its overall peak, by
    category, is MemTracker's own, on a model and its optimizer through forward, backward and a step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from learner.plan import peak_only

    full = tracked_peak(MemTracker)
    assert full["cpu"]["Total"] > 0 and tracked_peak(peak_only(MemTracker)) == full


def test_the_peak_without_what_offload_moves_is_the_highest_moment_of_the_rest():
    """With FSDP's CPU offload the plan's GPU peak leaves out what the host holds (`peak_only`'s `elsewhere`): it is
    the highest of every moment's total less those categories, entry included. Here wide layers' AdamW moments and
    weights outweigh every moment's rest, so the total on entry (the peak PyTorch's tracker starts from) is not it."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    from learner.plan import peak_only

    def rest(snapshot: dict) -> int:
        return snapshot[_TOTAL_KEY] - snapshot.get("Optstate", 0)

    moments, on_entry = [], []

    class EveryMoment(MemTracker):
        def __enter__(self):
            super().__enter__()
            on_entry.extend(snapshot[_TOTAL_KEY] for snapshot in self._curr_mem_snap.values())
            moments.extend(rest(snapshot) for snapshot in self._curr_mem_snap.values())
            return self

        def _update_peak_stats(self, peak_state) -> None:
            moments.extend(rest(snapshot) for snapshot in self._curr_mem_snap.values())

    tracked_peak(EveryMoment, width=4096)
    peak = tracked_peak(peak_only(MemTracker, ("Optstate",)), width=4096)["cpu"]
    assert on_entry[0] > max(moments) > 0 and rest(peak) == max(moments)


def test_dapo_plan_hides_the_gpus_from_its_fake_tensors(monkeypatch):
    """On a machine with a GPU, accelerate would put the plan's inputs there while its fake model stays on the host:
    `dapo plan` runs with no GPU visible, as on a machine without one."""
    import os

    import learner.plan
    from cli.main import run_main

    seen = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(learner.plan, "main", lambda *args, **kwargs: seen.append(os.environ["CUDA_VISIBLE_DEVICES"]))
    run_main(["plan", "tiny-cpu", "--gpus", "1"])
    assert seen == [""]
