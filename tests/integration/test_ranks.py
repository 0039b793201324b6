"""The learner on several ranks (accelerate launch, gloo on CPU): rank 0 drives, the others follow its commands.

Tolerance (stated): after a step of 2 AdamW updates, the weights of 2 ranks (DDP: the gradient is the all-reduced
sum of each rank's share) equal those of 1 rank within 1e-5 absolute (float32 sums in another order; Adam divides
by sqrt(v), so a difference in the 7th digit of a gradient moves a weight by about lr * 1e-6).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_trainer import make_groups, make_settings, model_path, random_offsets, with_behaviour  # noqa: F401

from learner.ranks import RankChannel

TOLERANCE = 1e-5

WORKER = """
import sys
sys.path[:0] = [{here!r}, {repo!r}]
from datetime import timedelta
from pathlib import Path
from accelerate import PartialState
from safetensors.torch import save_file
from test_trainer import make_groups, make_settings, random_offsets, with_behaviour
from learner.ranks import RankChannel, follow
from learner.trainer import Trainer

state = PartialState(cpu=True, timeout=timedelta(seconds=120))
if state.process_index == 1:  # the slower rank: its RNG file comes last, and the checkpoint must wait for it
    import time
    import learner.trainer as trainer_module
    rng_state = trainer_module._rng_state
    trainer_module._rng_state = lambda: (time.sleep(2), rng_state())[1]
tmp = Path({tmp!r})
trainer = Trainer(make_settings(tmp, micro_batch_tokens=40, mini_batches=2, lr=1e-3), Path({model!r}))
channel = RankChannel(trainer.accelerator)
world = channel.world
groups = make_groups(n_groups=4, size=4, seed=3)
groups = with_behaviour(groups, trainer.logprobs(groups), random_offsets(groups, seed=2, scale=0.3))
if channel.is_leader:
    metrics = channel.train_step(trainer, groups)
    channel.keepalive()
    weights = channel.weights(trainer)
    channel.save(trainer, tmp / f"ckpt-{{world}}", {{"step": 1}})
    channel.train_step(trainer, groups)  # moves on, then the checkpoint is loaded back on every rank
    assert channel.load(trainer, tmp / f"ckpt-{{world}}") == {{"step": 1}}
    reloaded = channel.weights(trainer)
    channel.stop()
    save_file(weights, tmp / f"weights-{{world}}.safetensors")
    save_file(reloaded, tmp / f"reloaded-{{world}}.safetensors")
else:
    sys.exit(follow(trainer, channel))
"""


FSDP_WORKER = """
import sys
sys.path[:0] = [{repo!r}]
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM
from learner.dapo import LinearWarmup
from learner.trainer import load_training_state, save_training_state

dist.init_process_group("gloo")
rank, folder = dist.get_rank(), Path({tmp!r}) / "state"


def sharded():
    model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(3))


def full(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


torch.manual_seed(rank)
model, optimizer, scheduler = sharded()
ids = torch.randint(2, 32, (2, 9))
model(input_ids=ids, labels=ids).loss.backward()  # each rank its own data: FSDP reduces the gradients
optimizer.step(), scheduler.step()
if rank == 0:
    folder.mkdir()
dist.barrier()
save_training_state(folder, model, optimizer, scheduler, rank == 0, rank)
dist.barrier()
restored, restored_optimizer, restored_scheduler = sharded()
load_training_state(folder, restored, restored_optimizer, restored_scheduler, rank)
a, b = full(model), full(restored)
if rank == 0:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ"
    assert restored_scheduler.state_dict() == scheduler.state_dict()
for p, q in zip(model.parameters(), restored.parameters()):  # this rank's shard of the AdamW moments
    s, t = optimizer.state[p], restored_optimizer.state[q]
    assert torch.equal(s["exp_avg"].to_local(), t["exp_avg"].to_local())
    assert torch.equal(s["exp_avg_sq"].to_local(), t["exp_avg_sq"].to_local())
print("rank %d ok" % rank, flush=True)  # one write: the two ranks share a pipe (print's pieces interleaved)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accelerate_launch(procs: int) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port())]


def test_one_rank_channel_runs_locally(model_path, tmp_path):
    """With one process the commands are not sent anywhere: the channel is the trainer."""
    from learner.trainer import Trainer

    trainer = Trainer(make_settings(tmp_path), model_path)
    channel = RankChannel(trainer.accelerator)
    assert channel.world == 1 and channel.is_leader
    with pytest.raises(ValueError, match="unknown rank command"):
        channel.send("dance")
    groups = make_groups(n_groups=2, size=2)
    groups = with_behaviour(groups, trainer.logprobs(groups))
    channel.train_step(trainer, groups)
    channel.keepalive()
    channel.stop()
    assert trainer.steps_done == 1


@pytest.mark.slow
def test_two_ranks_following_rank_zero_train_like_one(model_path, tmp_path):
    here = Path(__file__).resolve().parent
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(here=str(here), repo=str(here.parents[1]), tmp=str(tmp_path),
                                    model=str(model_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here.parents[1]), ACCELERATE_USE_CPU="true")
    alone = subprocess.run([sys.executable, str(script)], env=env, timeout=300, capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr[-3000:]
    done = subprocess.run(accelerate_launch(2) + [str(script)], env=env, timeout=300, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = load_file(tmp_path / "weights-1.safetensors"), load_file(tmp_path / "weights-2.safetensors")
    assert one.keys() == two.keys()
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert worst <= TOLERANCE, worst
    moved = max(float((one[k] - load_file(tmp_path / "reloaded-1.safetensors")[k]).abs().max()) for k in one)
    assert moved == 0.0  # the checkpoint restored the weights exactly after a further step (1 rank)
    reloaded = load_file(tmp_path / "reloaded-2.safetensors")
    assert all(torch.equal(reloaded[k], two[k]) for k in two)  # and on 2 ranks
    assert (tmp_path / "ckpt-2" / "state" / "rng-1.safetensors").is_file()  # every rank saved its RNG


@pytest.mark.slow
def test_fsdp2_checkpoint_round_trip_on_cpu(model_path, tmp_path):
    """PyTorch FSDP2 (`fully_shard`) runs on CPU over gloo, accelerate's FSDP does not (its multi-CPU mode is
    DDP). So the trainer's FSDP code that torch can run here, the checkpoint (full-state gather of sharded
    weights and AdamW moments on rank 0, scatter back to every rank's shard), is run on 2 sharded CPU ranks."""
    script = tmp_path / "fsdp.py"
    repo = Path(__file__).resolve().parents[2]
    script.write_text(FSDP_WORKER.format(repo=str(repo), tmp=str(tmp_path), model=str(model_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    done = subprocess.run(torchrun + [str(script)], env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 ok" in done.stdout and "rank 1 ok" in done.stdout, done.stdout[-2000:]
    assert {p.name for p in (tmp_path / "state").iterdir()} >= {"model.safetensors", "optimizer.safetensors",
                                                                 "rng-0.safetensors", "rng-1.safetensors"}
