"""The generator service against raw vLLM, and weight sync against a plain file copy, side by side in one run.

1. Throughput, the same prompts and seeds both ways, on one engine (rounds alternate to share the noise):
     raw:      LLM.generate(all prompts, SamplingParams(n, logprobs=0))          (vLLM alone, all at once)
     service:  prompts stream -> RolloutWorker (continuous batching, tasks_per_batch in flight, decode,
               RolloutGroup) -> rollouts stream, acked per task                 (the whole generator path)
2. Weight sync of the tiny model, each step timed: publish (learner writes safetensors + sha256 + announce),
   pull (HTTP, hashed on the way), verify (names/shapes), reload (in place, engine idle); against a plain
   copy of the same file. Then the end-to-end latency in a running worker: publish -> new version serving.
Weight sync at a size where bytes dominate (8 generators, HTTP against shared-fs): benchmarks/weights.py.

Usage: python benchmarks/generator.py [--prompts 256] [--n 8] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

# `python benchmarks/generator.py` puts benchmarks/ first on the path, where this file would shadow the
# `generator` package it measures.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from safetensors.torch import load_file  # noqa: E402

from services.config import load_settings  # noqa: E402
from services.http import BackgroundServer, create_app, free_port  # noqa: E402
from services.messages import PromptTask, RolloutGroup, SamplingParams  # noqa: E402
from services.redis_local import EmbeddedRedis, connect  # noqa: E402
from services.streams import Streams  # noqa: E402
from services.weights import WeightPublisher, check_schema, model_schema, pull_weights, weights_router  # noqa: E402


def prompt_ids(settings, tokenizer, count: int) -> list[list[int]]:
    from services.data import SyntheticTask, render_prompt

    problems = SyntheticTask.from_settings(settings).problems("train", count, seed=1)
    return [
        tokenizer.encode(render_prompt(p, tokenizer, settings.data.prompt_template, settings.data.raw_template))
        for p in problems
    ]


def bench_raw(engine, prompts, sampling: list[SamplingParams]) -> tuple[float, int]:
    from vllm.inputs import TokensPrompt

    params = [engine.engine_params(s) for s in sampling]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = engine.llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return seconds, tokens


def bench_service(settings, engine, model_dir, prompts, sampling, run: str) -> tuple[float, int]:
    from generator.sync import WeightSync
    from generator.worker import RolloutWorker

    settings = settings.model_copy(deep=True)
    settings.redis.run = run
    client = connect(settings)
    streams = Streams(client, settings)
    source, sink = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    for i, (ids, params) in enumerate(zip(prompts, sampling)):
        source.produce(PromptTask(prompt_id=f"p{i}", prompt="", prompt_token_ids=ids, ground_truth="0", sampling=params))
    worker = RolloutWorker(settings, engine, streams, WeightSync(settings, model_dir, client, "bench"), "bench")
    thread = threading.Thread(target=worker.run, daemon=True)
    start = time.perf_counter()
    thread.start()
    while client.xlen(sink.key) < len(prompts):
        time.sleep(0.002)
    seconds = time.perf_counter() - start
    worker.stop()
    thread.join()
    tokens = 0
    for d in sink.consume("count", count=len(prompts) + 1, block_ms=100):
        tokens += sum(len(s.token_ids) for s in d.message.samples)
    return seconds, tokens


def bench_sync(settings, engine, model_dir, rounds: int) -> dict:
    from generator.sync import WeightSync

    client = connect(settings)
    app = create_app("learner", token=settings.token)
    server = BackgroundServer(app, "127.0.0.1", free_port()).start(wait_s=10)
    settings.learner.public_url = server.url  # generators pull from the configured learner only
    publisher = WeightPublisher(settings, client, server.url)
    app.include_router(weights_router(publisher, app.state.require_token))
    sync = WeightSync(settings, model_dir, client, "bench-sync")
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    rows = {k: [] for k in ("publish", "pull", "verify", "reload", "total", "copy")}
    size = 0
    scratch = Path(tempfile.mkdtemp(prefix="copy-"))
    for version in range(1, rounds + 1):
        state = {k: v + 1e-3 * version for k, v in base.items()}
        t0 = time.perf_counter()
        announcement = publisher.publish(state, version)
        t1 = time.perf_counter()
        folder = pull_weights(announcement, settings.token, sync.dir)
        t2 = time.perf_counter()
        check_schema(model_schema(folder), sync.expected, sync.optional)
        t3 = time.perf_counter()
        engine.reload(folder)
        t4 = time.perf_counter()
        for entry in announcement.files:
            shutil.copyfile(publisher.dir / f"v{version}" / entry.name, scratch / entry.name)
        t5 = time.perf_counter()
        size = announcement.size
        for key, value in zip(rows, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, t5 - t4)):
            rows[key].append(value)
    engine.reload(model_dir)  # back to the model folder's weights
    server.stop()
    shutil.rmtree(scratch, ignore_errors=True)
    return {"size": size, **{k: statistics.median(v) for k, v in rows.items()}}


def bench_live_sync(settings, engine, model_dir, rounds: int) -> dict:
    """Publish on a running (idle) worker; time until it reports the new version served."""
    from generator.sync import WeightSync
    from generator.worker import RolloutWorker

    settings = settings.model_copy(deep=True)
    settings.redis.run = "live-sync"
    client = connect(settings)
    app = create_app("learner", token=settings.token)
    server = BackgroundServer(app, "127.0.0.1", free_port()).start(wait_s=10)
    settings.learner.public_url = server.url  # generators pull from the configured learner only
    publisher = WeightPublisher(settings, client, server.url)
    app.include_router(weights_router(publisher, app.state.require_token))
    worker = RolloutWorker(settings, engine, Streams(client, settings), WeightSync(settings, model_dir, client, "live"), "live")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    while not worker.ready:
        time.sleep(0.01)
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    latencies = []
    for version in range(1, rounds + 1):
        state = {k: v + 1e-3 * version for k, v in base.items()}
        start = time.perf_counter()
        publisher.publish(state, version)
        while worker.version != version:
            time.sleep(0.001)
        latencies.append(time.perf_counter() - start)
    worker.stop()
    thread.join()
    engine.reload(model_dir)
    server.stop()
    return {"latency": statistics.median(latencies), "max": max(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync-rounds", type=int, default=5)
    args = parser.parse_args()

    from generator.engine import VllmEngine
    from cli.bootstrap import ensure_model

    tmp = tempfile.mkdtemp(prefix="dapo-bench-")
    redis_server = EmbeddedRedis(os.path.join(tmp, "redis")).start()
    settings = load_settings(
        "tiny-cpu", run_dir=os.path.join(tmp, "run"), redis={"url": redis_server.url, "run": "bench"},
        streams={"high_water": 100_000},
    )
    model_dir = ensure_model(settings)
    engine = VllmEngine(model_dir, settings)
    print(f"model {model_dir} | engine up in {engine.start_seconds:.1f}s | tasks_per_batch {settings.generator.tasks_per_batch}")
    prompts = prompt_ids(settings, engine.tokenizer, args.prompts)
    engine.generate(prompts[:16], SamplingParams(n=args.n, max_tokens=args.max_tokens, seed=0))  # warm-up

    raw_rates, service_rates, ratios = [], [], []
    for r in range(args.rounds):
        sampling = [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=1000 * r + i) for i in range(len(prompts))]
        if r % 2 == 0:  # alternate which path goes first: the machine's load drifts
            raw_s, raw_tokens = bench_raw(engine, prompts, sampling)
            svc_s, svc_tokens = bench_service(settings, engine, model_dir, prompts, sampling, run=f"round{r}")
        else:
            svc_s, svc_tokens = bench_service(settings, engine, model_dir, prompts, sampling, run=f"round{r}")
            raw_s, raw_tokens = bench_raw(engine, prompts, sampling)
        raw_rates.append(raw_tokens / raw_s)
        service_rates.append(svc_tokens / svc_s)
        ratios.append(service_rates[-1] / raw_rates[-1])
        print(
            f"round {r}: raw {raw_tokens} tok in {raw_s:.2f}s = {raw_tokens / raw_s:,.0f} tok/s | "
            f"service {svc_tokens} tok in {svc_s:.2f}s = {svc_tokens / svc_s:,.0f} tok/s | "
            f"ratio {(svc_tokens / svc_s) / (raw_tokens / raw_s):.3f}"
        )
    raw_med, svc_med = statistics.median(raw_rates), statistics.median(service_rates)
    print(f"\n| path | tokens/s (median of {args.rounds}) |\n|---|---|")
    print(f"| raw LLM.generate | {raw_med:,.0f} |\n| service (stream in, engine, stream out) | {svc_med:,.0f} |")
    print(f"| ratio service / raw, median of the per-round ratios | {statistics.median(ratios):.3f} |")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    sync = bench_sync(settings, engine, model_dir, args.sync_rounds)
    print(f"\nweight sync, tiny model ({sync['size'] / 1e6:.2f} MB), median of {args.sync_rounds}:")
    print("| step | ms |\n|---|---|")
    for key in ("publish", "pull", "verify", "reload", "total", "copy"):
        print(f"| {key} | {1000 * sync[key]:.1f} |")
    print(f"| total / plain copy | {sync['total'] / sync['copy']:.1f}x |")

    live = bench_live_sync(settings, engine, model_dir, args.sync_rounds)
    print(f"\nrunning worker, publish -> new version serving: median {1000 * live['latency']:.0f} ms, max {1000 * live['max']:.0f} ms")

    engine.shutdown()
    redis_server.stop()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
