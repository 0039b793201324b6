"""benchmarks/gpu_trainer.py runs its variants end to end (on a CPU here, with the tiny shape: the same code
the device run takes) and reports every figure; the FLOP count is the same for every variant."""

from __future__ import annotations

from benchmarks.gpu_trainer import report, step_flops, synthetic_groups


def test_the_benchmark_runs_its_variants_and_reports_them():
    from benchmarks.gpu_trainer import measure

    partial = []
    variants = ["project", "project-padded", "project-selective", "plain", "strong"]
    result = measure("tiny", 2, 1, "tiny-cpu", variants, 4, (4, 12), (8, 40), None,
                     progress=lambda r: partial.append(len(r["rows"])))
    assert [r["variant"] for r in result["rows"]] == variants
    assert partial == [1, 2, 3, 4, 5]  # written after every variant: a run cut short keeps what it measured
    for row in result["rows"]:
        assert row["seconds"] > 0 and row["model_tflops"] > 0 and row["response_tokens_per_second"] > 0
        assert row["gpu_busy"] is None and "mfu" not in row  # a CPU: no busy fraction, no peak to divide by
    text = report(result, "python -m benchmarks.gpu_trainer --model tiny")
    assert "| plain (sdpa) |" in text and "| 1.00 |" in text and "2 groups x 4 responses" in text
    assert "| strong (sdpa) |" in text and "vs strong" in text
    project = result["rows"][0]  # publishing its weights, timed beside its step
    assert project["publish_bytes"] > 0 and project["publish_gather_seconds"] > 0
    assert project["publish_share"] >= project["publish_share_overlapped"] > 0
    assert not any("publish_share" in row for row in result["rows"][1:])
    assert "Publishing after the `project` step" in text and "% of the step" in text


def test_flops_count_every_trained_and_recomputed_token():
    groups = synthetic_groups(3, 2, 100, (5, 5), (10, 10))
    # 6 rows of 15 tokens (10 scored), one epoch, 3 mini-batches: 2/3 of the rows run once more without a gradient.
    assert step_flops((7, 3), groups, 3, 1) == 6 * (7 * 90 + 3 * 60) + 2 * (7 * 60 + 3 * 40)


def test_the_busy_fraction_is_nvml_utilisation_sampled_over_the_steps(monkeypatch):
    import time
    import types

    import torch

    from benchmarks.gpu_trainer import BusySampler

    readings = iter([90, 100, 80] + [85] * 1000)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: next(readings))
    with BusySampler(types.SimpleNamespace(type="cuda"), every=0.01) as sampler:
        time.sleep(0.1)
    assert len(sampler.samples) >= 3 and sampler.samples[:3] == [0.9, 1.0, 0.8]
    assert 0.8 <= sampler.fraction <= 1.0
    with BusySampler(torch.device("cpu")) as cpu:
        time.sleep(0.02)
    assert cpu.fraction is None  # a CPU: no figure


def test_without_nvml_there_is_no_busy_figure(monkeypatch):
    import time
    import types

    import torch

    from benchmarks.gpu_trainer import BusySampler

    def unreadable(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", unreadable)
    with BusySampler(types.SimpleNamespace(type="cuda"), every=0.01) as sampler:
        time.sleep(0.05)
    assert sampler.fraction is None


def test_the_strong_baseline_scores_and_differentiates_as_the_plain_loop(tmp_path):
    """`strong` packs rows, checkpoints each layer selectively and scores chunks of positions: the same logprobs
    and the same gradient as the plain padded loop, on the same rows (a chunk smaller than the rows, so several)."""
    import torch

    from benchmarks.gpu_trainer import SHAPES, PlainLoop, StrongLoop, build_model
    from services.config import load_settings

    model = build_model("tiny", tmp_path / "model")
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path / "run"), model={"name_or_path": str(model)},
                             learner={"compute": {"gradient_checkpointing": "selective"}})
    groups = synthetic_groups(2, 3, SHAPES["tiny"]["vocab_size"], (3, 9), (4, 20))
    rows = [(g.rollout.task.prompt_token_ids + s.token_ids, len(g.rollout.task.prompt_token_ids), 1.0)
            for g in groups for s in g.rollout.samples]
    plain, strong = PlainLoop(settings, model, torch.device("cpu")), StrongLoop(settings, model, torch.device("cpu"))
    strong.CHUNK = 16
    values = {}
    for name, loop in (("plain", plain), ("strong", strong)):
        logp, mask = loop._logp(rows)
        (logp * mask).sum().backward()
        values[name] = (logp[mask.bool()], {n.replace("._checkpoint_wrapped_module", ""): p.grad
                                             for n, p in loop.model.named_parameters()})
    assert torch.allclose(values["plain"][0], values["strong"][0], atol=1e-5)
    assert values["plain"][1].keys() == values["strong"][1].keys()
    for name, grad in values["plain"][1].items():
        assert torch.allclose(grad, values["strong"][1][name], atol=1e-5), name
