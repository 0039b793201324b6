"""Weight sync by broadcast (weights.transport collective) to 1, 2, 4 and 8 generators, against a plain in-memory copy
of the same bytes, side by side in one run.

One learner process (this one) runs the real `Broadcaster` on this machine; each generator is a process that runs
what an engine's worker runs (services/broadcast.py `receive`) and what the generator then checks (`commit_refusal`:
the learner's signature, the digests). The generators are ready and subscribed to the weights channel before the
learner publishes, as live ones are. Each round takes the same generators down both of the transport's paths:

  nearby      registered as on the learner's host (what `dapo run` does): each takes every bucket as a sealed
              memfd over the round's unix socket and copies it into its own memory; nothing to hash;
  chain       registered as on other hosts: join the round's gloo group on loopback, take every bucket from the
              rank before and hand it on, hash as `weights.verify` says;

each timed from the learner's `broadcast()` call until the last generator holds the checked version (the round's
announcement on Redis pub/sub, the rendezvous, the stream, the commit, the checks). Against:

  memcopy     the reference: every generator process copies the version's bytes, at the same moment, from shared
              memory into its own (torch `clone` of a shared-memory tensor): the version moved from the learner's
              memory into each generator's at the speed of memory;
  egress      the bytes the learner sends per version (counted by the Broadcaster).

The engine's pause (`load_staged` into a real vLLM engine, the only stop of generation) is measured by
`--engine`, at the tiny model. Usage: python -m benchmarks.weights_collective [--mb 512] [--verify sampled]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from services.broadcast import HOST, Broadcaster, commit_refusal, leave, parse_round, receive, register_member
from services.config import load_settings
from services.keys import create_keys, keys_dir, load_keyring, load_signer
from services.redis_local import EmbeddedRedis, connect
from services.streams import run_prefix
from services.weights import channel, shareable_state_dict

COUNTS = (1, 2, 4, 8)
PATHS = ("memcopy", "nearby", "chain")


def generator_process(settings, member: str, source: torch.Tensor, commands, done) -> None:
    """A generator: on "round", take the next round that names it; on "copy", copy `source` into its own memory."""
    client = connect(settings)
    prefix, keyring = run_prefix(settings), load_keyring(settings)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel(prefix))
    while pubsub.get_message(timeout=0.1) is not None:
        pass
    done.put((member, "ready", 0.0, None))
    while (command := commands.get()) != "stop":
        if command == "copy":
            copied = source.clone()
            done.put((member, "copy", time.perf_counter(), int(copied.numel() > 0)))
            del copied
            continue
        announcement = None
        while announcement is None or not announcement.takes_part(member):  # rounds it sat out are still queued
            message = pubsub.get_message(timeout=1)
            if message is not None and b'"kind":"broadcast"' in message["data"]:
                announcement = parse_round(message["data"], keyring, channel(prefix))
        receipt = receive(announcement, "127.0.0.1", member)
        refusal = commit_refusal(announcement, receipt.commit, receipt.digests, keyring, channel(prefix))
        done.put((member, "round", time.perf_counter(), refusal))
        del receipt
    os._exit(0)  # gloo's threads torn down by the interpreter may abort the process


def state_of(mb: int) -> dict[str, torch.Tensor]:
    if mb == 0:  # the shipped tiny model
        from safetensors.torch import load_file

        return load_file(str(Path(__file__).resolve().parents[1] / "services" / "tiny_model" / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(1024, 4096, generator=generator).to(torch.bfloat16)
            for i in range(mb // 8)}


def measure(mb: int, verify: str, rounds: int, tmp: Path, redis_url: str) -> list[dict]:
    settings = load_settings("tiny-cpu", run_dir=str(tmp / "run"), redis={"url": redis_url, "run": f"b{mb}"},
                             weights={"transport": "collective", "broadcast_port": 0, "verify": verify,
                                      "broadcast_timeout_s": 120})
    create_keys(keys_dir(settings))
    client, prefix = connect(settings), run_prefix(settings)
    tensors = shareable_state_dict(state_of(mb))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    source = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).share_memory_()
    broadcaster = Broadcaster(settings, client, load_signer(settings, "learner", load_keyring(settings)), prefix,
                              channel(prefix))
    context = mp.get_context("spawn")
    done = context.Queue()
    members = [f"gen-{i}" for i in range(max(COUNTS))]
    commands = {m: context.Queue() for m in members}
    processes = [context.Process(target=generator_process, args=(settings, m, source, commands[m], done))
                 for m in members]
    for process in processes:
        process.start()
    for _ in members:
        done.get(timeout=300)
    rows, version = [], 0
    for r in range(rounds):
        for count in COUNTS:
            chosen = members[:count]
            times = {}
            for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:  # each round starts with another path
                for member in members:  # nearby: as on the learner's host; chain: as on another
                    if member in chosen and path != "memcopy":
                        register_member(client, prefix, member, 1, host=HOST if path == "nearby" else "far")
                    else:
                        leave(client, prefix, member)
                started = time.perf_counter()
                if path == "memcopy":
                    for member in chosen:
                        commands[member].put("copy")
                    sent = 0
                else:
                    version += 1
                    for member in chosen:
                        commands[member].put("round")
                    time.sleep(0.2)  # they are back on the channel
                    result = {}
                    thread = threading.Thread(target=lambda: result.update(r=broadcaster.broadcast(tensors, version)))
                    started = time.perf_counter()
                    thread.start()
                finished = []
                for _ in chosen:
                    member, kind, at, refusal = done.get(timeout=600)
                    assert kind == ("copy" if path == "memcopy" else "round"), kind
                    assert path == "memcopy" or refusal is None, refusal
                    finished.append(at)
                if path != "memcopy":
                    thread.join()
                    assert result["r"].error is None and result["r"].failed == [], result["r"]
                    sent = result["r"].bytes_sent
                times[path] = (max(finished) - started, sent)
            row = {"mb": size / 1e6, "generators": count, "round": r, "memcopy_s": times["memcopy"][0],
                   **{f"{path}_s": times[path][0] for path in PATHS[1:]},
                   **{f"{path}_egress_mb": times[path][1] / 1e6 for path in PATHS[1:]}}
            rows.append(row)
            print(f"{size / 1e6:8.1f} MB x{count}: memcopy {row['memcopy_s']:.3f}s, "
                  + ", ".join(f"{path} {row[f'{path}_s']:.3f}s ({row[f'{path}_s'] / row['memcopy_s']:.2f}x, learner "
                              f"sent {row[f'{path}_egress_mb']:.1f} MB)" for path in PATHS[1:]), flush=True)
    for member in members:
        commands[member].put("stop")
    for process in processes:
        process.join(timeout=60)
    return rows


def engine_pause(tmp: Path, redis_url: str) -> dict:
    """A real vLLM engine (the tiny model) takes a round while it generates: the pause is `load_staged` alone."""
    from generator.engine import VllmEngine
    from services.messages import SamplingParams
    from services.models import model_dir

    settings = load_settings("tiny-cpu", run_dir=str(tmp / "engine-run"), redis={"url": redis_url, "run": "engine"},
                             weights={"transport": "collective", "broadcast_port": 0})
    create_keys(keys_dir(settings))
    client, prefix, keyring = connect(settings), run_prefix(settings), load_keyring(settings)
    folder = model_dir(settings)
    engine = VllmEngine(folder, settings)
    broadcaster = Broadcaster(settings, client, load_signer(settings, "learner", keyring), prefix, channel(prefix))
    tensors = shareable_state_dict(state_of(0))
    prompts = [[1, 2, 3, 4]] * 8
    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=64)
    pauses, reloads, steps_during = [], [], []
    for version in range(1, 6):
        register_member(client, prefix, "engine", engine.workers())
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(channel(prefix))
        threading.Thread(target=broadcaster.broadcast, args=(tensors, version)).start()
        message = None
        while message is None or b'"kind":"broadcast"' not in message["data"]:
            message = pubsub.get_message(timeout=1)
        announcement = parse_round(message["data"], keyring, channel(prefix))
        engine.begin_receive(announcement, "127.0.0.1", "engine")
        for i, prompt in enumerate(prompts):
            engine.submit(f"r{version}-{i}", prompt, sampling)
        steps = 0
        while (statuses := engine.received()) is None:
            if engine.has_unfinished():
                engine.step()
                steps += 1
        steps_during.append(steps)
        while engine.has_unfinished():
            engine.step()
        assert all("error" not in s for s in statuses), statuses
        pauses.append(engine.load_staged())
        reloads.append(engine.reload(folder))
        pubsub.close()
    engine.shutdown()
    return {"load_staged_s": statistics.median(pauses), "reload_from_files_s": statistics.median(reloads),
            "engine_steps_while_receiving": steps_during}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[0, 512], help="model sizes, MB (0: the tiny model)")
    parser.add_argument("--verify", default="sampled", choices=["full", "sampled", "off"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", action="store_true", help="also measure a real engine's pause (tiny model)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dapo-bench-collective-"))
    redis_server = EmbeddedRedis(str(tmp / "redis")).start()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, verify {args.verify}, gloo on loopback")
    try:
        rows = [row for mb in args.mb for row in measure(mb, args.verify, args.rounds, tmp, redis_server.url)]
        print(f"\n| model | generators | memcopy s | nearby s | chain s | nearby x memcopy | chain x memcopy | "
              f"MB the learner sends (nearby, chain) |   (medians of {args.rounds}; ratios per round)")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for mb in sorted({row["mb"] for row in rows}):
            for count in COUNTS:
                mine = [row for row in rows if row["mb"] == mb and row["generators"] == count]
                seconds = [f"{statistics.median(r[f'{path}_s'] for r in mine):.3f}" for path in PATHS]
                ratios = [f"{statistics.median(r[f'{path}_s'] / r['memcopy_s'] for r in mine):.2f}"
                          for path in PATHS[1:]]
                egress = [f"{statistics.median(r[f'{path}_egress_mb'] for r in mine):,.1f}" for path in PATHS[1:]]
                print(f"| {mb:,.1f} MB | {count} | {' | '.join(seconds)} | {' | '.join(ratios)} | "
                      f"{', '.join(egress)} |")
        if args.engine:
            print(engine_pause(tmp, redis_server.url))
    finally:
        redis_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
