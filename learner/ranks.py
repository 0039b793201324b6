"""Several learner ranks (`accelerate launch`, DDP or FSDP): rank 0 runs the service, every other rank follows.

Rank 0 alone reads and writes the streams, serves HTTP, publishes weights, evaluates, and writes the records and
checkpoint pointers. Every trainer operation in which all ranks take part (a train step, gathering the weights to
publish or writing each rank's share of them, saving or loading a checkpoint) is a command that rank 0 broadcasts
just before it runs the operation itself; the other ranks run `follow`, which receives the commands in the same
order and runs the same operations, so their collectives meet. `stop` ends the followers (rank 0 finished, or was
stopped by a signal after its checkpoint). A signal to a follower's process alone (Kubernetes replacing the second
learner pod of a multi-node run: a rolling update, a drain) reaches rank 0 with the next command: each command ends
in an all-reduce of the signals the followers got, and rank 0 then stops as if signalled itself. Evaluation needs
no command: it runs on the generators, from published weights.

The wire: a command is msgpack (the groups as their signed-stream payloads), broadcast as a length and then the
bytes in a uint8 tensor. No pickle crosses ranks.

Liveness. Every collective has the process group's timeout (`learner.compute.collective_timeout_seconds`). While rank 0
waits for groups or evaluates, the followers wait in a broadcast; rank 0 sends `idle` every HEARTBEAT_SECONDS so
that this legitimate wait never reaches the timeout. A rank that dies makes the next collective fail on the
others (gloo at once, on the closed connection; NCCL at the timeout), so the learner exits non-zero instead of
hanging, and the next start resumes from the checkpoint.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from learner import checkpoint, publish
from services.messages import ScoredGroup, from_wire, to_wire

if TYPE_CHECKING:  # pragma: no cover
    from learner.trainer import Trainer

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 30.0
OPS = ("train", "publish", "write_shards", "save", "load", "idle", "stop")


class RankChannel:
    """Rank 0 -> every rank: commands over the default process group (a no-op with one process)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.world = accelerator.num_processes
        self.device = accelerator.device
        self.last_sent = time.monotonic()
        self.signalled = 0  # a follower: the signal its process got (0: none)
        self.on_follower_signal = None  # rank 0: called with the signal a follower got, at the command after it

    @property
    def is_leader(self) -> bool:
        return self.accelerator.is_main_process

    def send(self, op: str, **body: Any) -> None:
        """Rank 0: announce the operation it is about to run (every rank must run it too)."""
        if op not in OPS:
            raise ValueError(f"unknown rank command {op!r}")
        if self.world == 1:
            return
        payload = msgpack.packb({"op": op, **body}, use_bin_type=True)
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(size, src=0)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        torch.distributed.broadcast(data, src=0)
        self.last_sent = time.monotonic()
        follower_signal = self._signals()
        if follower_signal and self.on_follower_signal is not None:
            self.on_follower_signal(follower_signal)

    def receive(self) -> dict:
        """A follower: the next command (blocks, up to the process group's timeout)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(size, src=0)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        torch.distributed.broadcast(data, src=0)
        self._signals()
        command = msgpack.unpackb(data.cpu().numpy().tobytes(), raw=False)
        if command.get("op") not in OPS:
            raise ValueError(f"unknown rank command {command.get('op')!r}")
        return command

    def _signals(self) -> int:
        """Every rank, after each command: the largest signal number a follower got (0: none)."""
        signalled = torch.tensor([self.signalled], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(signalled, op=torch.distributed.ReduceOp.MAX)
        return int(signalled.item())

    def keepalive(self) -> None:
        """Rank 0, while it waits on the pipeline: tell the followers it is alive (at most every heartbeat)."""
        if self.world > 1 and time.monotonic() - self.last_sent >= HEARTBEAT_SECONDS:
            self.send("idle")

    # -- rank 0: the collective trainer operations, announced then run -----------------------------------------
    def train_step(self, trainer: "Trainer", groups: list[ScoredGroup]) -> dict[str, float]:
        self.send("train", groups=[to_wire(group) for group in groups])
        return trainer.train_step(groups)

    def weights(self, trainer: "Trainer") -> dict:
        self.send("publish")
        return trainer.state_dict_for_publish()

    def write_shards(self, trainer: "Trainer", folder, shard_bytes: int) -> tuple[list, int]:
        """Every rank writes the weights it owns into `folder` (learner/publish.py): every rank's `Written`, and
        the bytes rank 0 wrote."""
        self.send("write_shards", folder=str(folder), shard_bytes=shard_bytes)
        return publish.write_rank_shards(trainer, folder, shard_bytes)

    def save(self, trainer: "Trainer", path, extra: dict) -> None:
        self.send("save", path=str(path))
        checkpoint.write(trainer, path, extra)

    def load(self, trainer: "Trainer", path) -> dict:
        self.send("load", path=str(path))
        return checkpoint.read(trainer, path)

    def stop(self) -> None:
        self.send("stop")


def follow(trainer: "Trainer", channel: RankChannel) -> int:
    """Ranks > 0: run rank 0's commands until `stop`. A signal does not stop a follower: rank 0 hears of it with
    the next command (or gets it too), finishes its step, checkpoints (a collective) and then sends `stop`."""
    def note(signum, frame) -> None:
        log.info("signal %d: told to rank 0, which decides when to stop", signum)
        channel.signalled = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, note)
    rank = channel.accelerator.process_index
    log.info("rank %d of %d: following rank 0", rank, channel.world)
    while True:
        command = channel.receive()
        op = command["op"]
        if op == "train":
            trainer.train_step([from_wire(ScoredGroup, raw) for raw in command["groups"]])
        elif op == "publish":
            trainer.state_dict_for_publish()  # FSDP gathers the full state on rank 0: every rank takes part
        elif op == "write_shards":
            publish.write_rank_shards(trainer, command["folder"], command["shard_bytes"])
        elif op == "save":
            checkpoint.write(trainer, command["path"], {})  # rank 0 writes the extra state
        elif op == "load":
            checkpoint.read(trainer, command["path"])
        elif op == "stop":
            log.info("rank %d: stop", rank)
            return 0

