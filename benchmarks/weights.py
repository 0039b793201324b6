"""Weight sync to 8 generators at a size where bytes dominate: HTTP pull against shared-fs, side by side in one run.

One learner publishes a random state dict of --mb MB (float32, `weights.shard_mb` shards + index) through the
real `WeightPublisher` (embedded Redis, the real HTTP router under uvicorn). Then, in interleaved rounds:

  copy       8 processes each copy the version's files with `shutil.copyfile`      (the reference)
  http       8 processes each run `pull_weights` (shards `weights.pull_concurrency` at a time, sha256 on the
             way, rename into place) + the names/shapes read from the headers (`model_schema`)
  shared-fs  8 processes each run `check_shared` (sha256 of every file where it lies, no copy) + `model_schema`

Measured: the time until all 8 hold the version, the bytes the learner sends (counted at its ASGI `send`) and
writes. The 8 are pull clients, not vLLM engines (the engine's reload reads the same folder in both transports).
The shared folder is a local directory here (page cache), not NFS. Usage: python -m benchmarks.weights [--mb 512]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.config import load_settings
from services.http import BackgroundServer, create_app, free_port
from services.keys import create_keys, keys_dir
from services.redis_local import EmbeddedRedis, connect
from services.weights import WeightPublisher, check_shared, model_schema, pull_weights, weights_router

GENERATORS = 8


class EgressCounter:
    """ASGI middleware: bytes of response bodies the learner sends."""

    def __init__(self, app):
        self.app, self.bytes = app, 0

    async def __call__(self, scope, receive, send):
        async def counted(message):
            if message["type"] == "http.response.body":
                self.bytes += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, counted)


def written_bytes() -> int:
    """Bytes this process passed to write() (/proc/self/io wchar)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("wchar")).split()[1])


def one_generator(path: str, announcement, token: str, source: str, dest: str, concurrency: int, go, done) -> None:
    go.wait()
    if path == "copy":
        Path(dest).mkdir(parents=True)
        for entry in announcement.files:
            shutil.copyfile(Path(source) / f"v{announcement.version}" / entry.name, Path(dest) / entry.name)
    elif path == "http":
        model_schema(pull_weights(announcement, token, dest, timeout=600, concurrency=concurrency))
    else:
        model_schema(check_shared(announcement, source, concurrency))
    done.put(time.perf_counter())


def run_path(path: str, announcement, token: str, source: str, scratch: Path, concurrency: int, count: int) -> float:
    """Seconds from the go signal until the last of `count` generator processes holds the version."""
    context = mp.get_context("fork")
    go, done = context.Event(), context.Queue()
    dests = [scratch / f"{path}-{i}" for i in range(count)]
    workers = [
        context.Process(target=one_generator, args=(path, announcement, token, source, str(d), concurrency, go, done))
        for d in dests
    ]
    for worker in workers:
        worker.start()
    time.sleep(0.5)  # every worker waits on the event
    started = time.perf_counter()
    go.set()
    finished = [done.get(timeout=900) for _ in workers]
    for worker in workers:
        worker.join()
        assert worker.exitcode == 0, f"{path}: a generator failed"
    for dest in dests:
        shutil.rmtree(dest, ignore_errors=True)
    return max(finished) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="model size, MB")
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4, help="weights.pull_concurrency")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-weights-"))
    redis_server = EmbeddedRedis(str(tmp / "redis")).start()
    settings = {}
    for transport in ("http", "shared-fs"):
        settings[transport] = load_settings(
            "tiny-cpu", run_dir=str(tmp / "run"), redis={"url": redis_server.url, "run": transport},
            weights={"transport": transport, "shared_dir": str(tmp / "shared"), "shard_mb": args.shard_mb,
                     "pull_concurrency": args.concurrency},
        )
    create_keys(keys_dir(settings["http"]))  # both transports share run_dir, so its keys
    app = create_app("learner", token=settings["http"].token.get_secret_value())
    counter = EgressCounter(app)
    server = BackgroundServer(counter, "127.0.0.1", free_port(),
                              limit_concurrency=settings["http"].http_max_connections).start(wait_s=10)
    gen = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1024, 4096, generator=gen)
             for i in range(args.mb // 16)}

    announced, publish_s, publish_written = {}, {}, {}
    for transport, cfg in settings.items():
        publisher = WeightPublisher(cfg, connect(cfg), server.url)
        if transport == "http":
            app.include_router(weights_router(publisher))
        before, started = written_bytes(), time.perf_counter()
        announced[transport] = publisher.publish(state, version=1)
        publish_s[transport], publish_written[transport] = time.perf_counter() - started, written_bytes() - before
    size = announced["http"].size
    shard_count = len(announced["http"].files) - 1
    print(f"model {size / 1e6:.0f} MB in {shard_count} shards of <= {args.shard_mb} MB + index; "
          f"{GENERATORS} generators; pull_concurrency {args.concurrency}; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    for transport in settings:
        print(f"publish ({transport}): {publish_s[transport]:.2f}s, {publish_written[transport] / 1e6:.0f} MB written")

    scratch = tmp / "generators"
    scratch.mkdir()
    token = settings["http"].token.get_secret_value()
    shared_dir, http_dir = str(tmp / "shared"), str(tmp / "run" / "weights")
    times: dict[tuple[str, int], list[float]] = {}
    egress: dict[tuple[str, int], int] = {}
    order = ["copy", "http", "shared-fs"]
    for r in range(args.rounds):
        for count in (1, GENERATORS):
            for path in order if r % 2 == 0 else order[::-1]:  # alternate the order: the machine's load drifts
                source = http_dir if path == "copy" else shared_dir
                before = counter.bytes
                seconds = run_path(path, announced["http" if path != "shared-fs" else "shared-fs"], token, source,
                                   scratch, args.concurrency, count)
                egress[(path, count)] = counter.bytes - before
                times.setdefault((path, count), []).append(seconds)
                print(f"round {r}: {path:9s} x{count}: {seconds:6.2f}s, "
                      f"learner sent {egress[(path, count)] / 1e6:,.0f} MB")
    med = {key: statistics.median(values) for key, values in times.items()}
    # The ratio is taken within each round (the same share of whatever else loads the machine), then the median.
    ratio = {
        key: statistics.median(t / c for t, c in zip(values, times[("copy", key[1])])) for key, values in times.items()
    }

    print(f"\n| path | generators | s until all hold it (median of {args.rounds}) | MB/s per generator | "
          "bytes the learner sends | x plain copy (median of per-round ratios) |")
    print("|---|---:|---:|---:|---:|---:|")
    for count in (1, GENERATORS):
        for path in order:
            seconds = med[(path, count)]
            sent = egress[(path, count)] + (publish_written["shared-fs"] if path == "shared-fs" else 0)
            print(f"| {path} | {count} | {seconds:.2f} | {size / 1e6 / seconds:,.0f} | {sent / 1e6:,.0f} MB | "
                  f"{ratio[(path, count)]:.2f} |")
    print("(shared-fs: the learner's bytes are its one write of the version to the shared folder, whatever the count)")
    server.stop()
    redis_server.stop()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
