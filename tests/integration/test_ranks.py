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
import os
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
    import learner.checkpoint as trainer_module
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
    code = 0
else:
    code = follow(trainer, channel)
# Its files are written: exit without the interpreter's teardown, where gloo's threads abort a rank now and then
# ("terminate called without an active exception", exit -6, even after destroy_process_group; not what is tested).
sys.stdout.flush()
os._exit(code)
"""


FSDP_WORKER = """
import os, sys
sys.path[:0] = [{repo!r}]
from pathlib import Path
import torch, torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from transformers import AutoModelForCausalLM
from learner import packing
from learner.checkpoint import load_training_state, save_training_state
from learner.dapo import LinearWarmup
from learner.logprobs import HeadQuery, install_head
from learner.activation_checkpointing import prepare_layers

dist.init_process_group("gloo")
rank, tmp = dist.get_rank(), Path({tmp!r})
folder = tmp / "state"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def sharded():
    model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32)
    head = install_head(model, temperature=0.7, chunk_tokens=5, compiled={compiled})  # in the forward: FSDP gathers it
    prepare_layers(model, {checkpointing!r}, {compiled})  # as the trainer does, before sharding: backward gathers again
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, head, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(3))


def flat(model, optimizer):
    weights, moments = get_state_dict(model, optimizer, options=FULL)  # on rank 0 only
    if not moments:
        return {{}}
    out = {{"model/" + k: v.contiguous() for k, v in weights.items() if k != "lm_head.weight"}}
    for fqn, slots in moments["state"].items():
        out.update({{f"optimizer/{{fqn}}/{{slot}}": v.reshape(-1).contiguous() for slot, v in slots.items()}})
    return out


# Packed rows (positions restart, no mask) scored by the chunked head under FSDP2: every rank runs the same rows,
# so the averaged gradient is the single-process gradient of the plain full-vocabulary formula.
generator = torch.Generator().manual_seed(0)
rows = []
for i in range(5):
    prompt = torch.randint(2, 32, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator)
    reply = torch.randint(2, 32, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator)
    rows.append(packing.Response(i, prompt.tolist(), reply.tolist(), torch.zeros(len(reply)), 0.0, False))
batch = packing.collate(rows, list(range(5)), "packed", pad_token_id=0, bucket=16)
weights = torch.linspace(-1, 1, batch.targets.numel())
model, head, optimizer, scheduler = sharded()
with head.scoring(HeadQuery(batch.hidden_row, batch.hidden_pos, batch.targets)):
    scored = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
(scored[:, 0] * weights).sum().backward()
grads = {{n: p.grad.full_tensor() for n, p in model.named_parameters()}}
if {compiled}:  # compiled for real: FSDP2's hooks stay outside the compiled layer, so nothing breaks the graph
    from torch._dynamo.utils import counters
    assert counters["stats"]["unique_graphs"] >= 3 and not counters["graph_break"], dict(counters["graph_break"])
if rank == 0:
    plain = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32)
    for r, row in enumerate(rows):
        ids = torch.tensor([row.prompt_ids + row.response_ids])
        logits = (plain(input_ids=ids).logits[0] / 0.7).log_softmax(-1)
        start = len(row.prompt_ids) - 1
        logp = logits[start:start + len(row.response_ids)].gather(-1, torch.tensor(row.response_ids)[:, None])
        (logp.squeeze(-1) * weights[batch.token_response == r]).sum().backward()
    for name, param in plain.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-4, atol=1e-5), name
optimizer.step(), scheduler.step()
if rank == 0:
    folder.mkdir()
dist.barrier()
save_training_state(folder, model, optimizer, scheduler, rank == 0, rank)
dist.barrier()
restored, _, restored_optimizer, restored_scheduler = sharded()
load_training_state(folder, restored, restored_optimizer, restored_scheduler, rank)
a, b = flat(model, optimizer), flat(restored, restored_optimizer)
if rank == 0:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "state differs"
    assert restored_scheduler.state_dict() == scheduler.state_dict()
    save_file(a, tmp / "full.safetensors")  # for the resume on one process
print("rank %d ok" % rank, flush=True)  # one write: the two ranks share a pipe (print's pieces interleaved)
dist.barrier()
os._exit(0)  # as WORKER: the interpreter's teardown of gloo's threads aborts a rank now and then
"""

ONE_PROCESS_RESUME = """
import sys
sys.path[:0] = [{repo!r}]
from pathlib import Path
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoModelForCausalLM
from learner.checkpoint import load_training_state
from learner.dapo import LinearWarmup
from learner.logprobs import install_head

tmp = Path({tmp!r})
model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32)
install_head(model, temperature=0.7, chunk_tokens=5)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(3))
load_training_state(tmp / "state", model, optimizer, scheduler, rank=0)
expected = load_file(tmp / "full.safetensors")
weights, moments = get_state_dict(model, optimizer)
for key, value in expected.items():
    kind, name = key.split("/", 1)
    if kind == "model":
        assert torch.equal(weights[name], value), key
    else:
        fqn, slot = name.rsplit("/", 1)
        assert torch.equal(moments["state"][fqn][slot].reshape(-1), value), key
assert scheduler.last_epoch == 1
print("one process ok", flush=True)
"""


FSDP_TRAINER_WORKER = """
import os
import sys
sys.path[:0] = [{here!r}, {repo!r}]
from datetime import timedelta
from pathlib import Path
import torch
from accelerate import PartialState
from safetensors.torch import save_file
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
from torch.distributed.tensor import DTensor
from test_trainer import make_groups, make_settings, random_offsets, with_behaviour
from learner.checkpoint import read as read_checkpoint, write as write_checkpoint
from learner.publish import write_rank_shards, writing_unit
from learner.trainer import Trainer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file
from services.keys import Signer
from services.weights_layout import INDEX_FILE, check_file, finish_version
import json

state = PartialState(cpu=True, timeout=timedelta(seconds=120))
tmp, world = Path({tmp!r}), state.num_processes
groups = make_groups(n_groups=4, size=4, seed=3)


def written_by_ranks(name, trainer, weights):
    # Transport shared-fs: every rank writes the weights it owns (learner/publish.py) and rank 0 completes the
    # version. Its files verify, and hold exactly the tensors one rank gathers whole.
    if world == 1:
        return
    root = tmp / f"published-{{name}}-{{world}}"
    folder = root / ".v1-ranks"
    folder.mkdir(parents=True, exist_ok=True)
    writers, wrote = write_rank_shards(trainer, folder, 64 * 1024)
    (root / f"wrote-{{state.process_index}}").write_text(str(wrote))  # (printed lines of two ranks interleave)
    if not state.is_main_process:
        return
    signer = Signer("learner", Ed25519PrivateKey.generate())
    announcement = finish_version(root, folder, 1, writers, "http://unused", signer, "dapo:t:weights")
    assert not any(check_file(root / "v1" / f.name, f) for f in announcement.files), name
    loaded = {{}}
    for shard in set(json.loads((root / "v1" / INDEX_FILE).read_text())["weight_map"].values()):
        loaded.update(load_file(root / "v1" / shard))
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[n], weights[n]) for n in weights), name
    units = {{}}  # what one rank writes whole: a layer, or a tensor outside the layers
    for n, t in weights.items():
        units[writing_unit(n)] = units.get(writing_unit(n), 0) + t.numel() * t.element_size()
    (root / "sizes").write_text(f"{{sum(units.values())}} {{max(units.values())}}")


def unsharded_gradients(model):
    # Parameters of which this rank holds a whole (not reduce-scattered) gradient.
    held = 0
    for module in model.modules():
        fsdp = _get_module_fsdp_state(module)
        for param in (fsdp._fsdp_param_group.fsdp_params if fsdp and fsdp._fsdp_param_group else []):
            whole = getattr(param, "_unsharded_param", None)
            held += param.unsharded_accumulated_grad is not None or (whole is not None and whole.grad is not None)
    return held


def run(name, dtype="float32", resume=None, micro_batch_tokens=40, **learner):
    settings = make_settings(tmp / name, micro_batch_tokens=micro_batch_tokens, lr=1e-3, **learner)
    settings.model.dtype = dtype
    trainer = Trainer(settings, Path({model!r}))
    if resume:  # another world's sharded checkpoint, read back here
        read_checkpoint(trainer, tmp / resume)
        weights = trainer.state_dict_for_publish()
        written_by_ranks(name, trainer, weights)
        if state.is_main_process:
            save_file({{"weight/" + n: w.float() for n, w in weights.items()}}, tmp / f"{{name}}-{{world}}.safetensors")
        return
    behaviour = with_behaviour(groups, trainer.logprobs(groups), random_offsets(groups, seed=2, scale=0.3))
    logprobs = trainer.logprobs(groups)
    held, backward = [], trainer.accelerator.backward
    def counted(loss):
        backward(loss)
        if trainer.sharded:
            held.append(unsharded_gradients(trainer.model))
    trainer.accelerator.backward = counted
    loss, grads = trainer.loss_gradients(behaviour)
    grads = {{n: (g.full_tensor() if isinstance(g, DTensor) else g).contiguous() for n, g in grads.items()}}
    trainer.train_step(behaviour)
    weights = trainer.state_dict_for_publish()
    written_by_ranks(name, trainer, weights)
    if name == "fsdp":  # the sharded checkpoint, read back by a fresh trainer on this world (and on others)
        write_checkpoint(trainer, tmp / f"ckpt-{{name}}-{{world}}", {{"step": 1}})
        again = Trainer(settings, Path({model!r}))
        assert read_checkpoint(again, tmp / f"ckpt-{{name}}-{{world}}") == {{"step": 1}}
        reloaded = again.state_dict_for_publish()
        assert all(torch.equal(reloaded[n], weights[n]) for n in weights) and reloaded.keys() == weights.keys()
    if state.is_main_process:
        flat = torch.tensor([x for g in logprobs for s in g for x in s], dtype=torch.float32)
        tensors = {{"logprobs": flat, **{{"grad/" + n: g for n, g in grads.items()}},
                   **{{"weight/" + n: w.float() for n, w in weights.items()}}}}
        save_file(tensors, tmp / f"{{name}}-{{world}}.safetensors")
        print(name, "micro-batches holding whole gradients:", held, flush=True)


for variant in {variants!r}:
    run(**variant)
print("rank %d ok" % state.process_index, flush=True)
os._exit(0)  # as WORKER: the interpreter's teardown of gloo's threads aborts a rank now and then
"""


SIGNAL_WORKER = """
import os, signal, sys, threading, time
sys.path[:0] = [{repo!r}]
from datetime import timedelta
from accelerate import PartialState
from learner.ranks import RankChannel, follow

state = PartialState(cpu=True, timeout=timedelta(seconds=60))
channel = RankChannel(state)
if channel.is_leader:
    heard = []
    channel.on_follower_signal = heard.append
    channel.send("idle")
    time.sleep(3)  # the follower's process gets SIGTERM meanwhile, and waits in the next command
    assert heard == [], heard
    channel.send("idle")
    assert heard == [signal.SIGTERM], heard
    channel.stop()
    print("rank 0 heard signal", heard[0], flush=True)
else:
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert follow(None, channel) == 0
sys.stdout.flush()
os._exit(0)
"""


def test_a_signal_to_a_follower_alone_reaches_rank_zero_with_the_next_command(tmp_path):
    """Kubernetes replaces the second learner pod alone (a rolling update, a drain): its ranks got SIGTERM, rank 0
    none, so no checkpoint was written, and the run failed at the next collective once those ranks were killed."""
    here = Path(__file__).resolve().parent
    script = tmp_path / "signal_worker.py"
    script.write_text(SIGNAL_WORKER.format(repo=str(here.parents[1])))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here.parents[1]), ACCELERATE_USE_CPU="true")
    done = subprocess.run(accelerate_launch(2) + [str(script)], env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 heard signal 15" in done.stdout


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accelerate_launch(procs: int) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port())]


def test_one_rank_channel_runs_locally(model_path, tmp_path):  # noqa: F811
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
def test_two_ranks_following_rank_zero_train_like_one(model_path, tmp_path):  # noqa: F811
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
@pytest.mark.parametrize("checkpointing, compiled", [("selective", True), ("full", False)],
                         ids=["as-the-1.5b-preset", "as-the-32b-preset"])
def test_fsdp2_head_packing_and_sharded_checkpoint_on_cpu(model_path, tmp_path, checkpointing, compiled):  # noqa: F811
    """PyTorch FSDP2 (`fully_shard`) runs on CPU over gloo, accelerate's FSDP does not (its multi-CPU mode is
    DDP). So the trainer's FSDP code that torch can run here is run on 2 sharded CPU ranks: packed rows scored by
    the chunked head inside the sharded model, the layers checkpointed (and compiled) as each Qwen preset has them
    (the gradient of the plain formula), and the sharded checkpoint (each rank writes its own shard, nothing
    gathered), read back exactly on 2 ranks and on 1 process."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_WORKER.format(repo=str(repo), tmp=str(tmp_path), model=str(model_path),
                                         checkpointing=checkpointing, compiled=compiled))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    done = subprocess.run(torchrun + [str(script)], env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 ok" in done.stdout and "rank 1 ok" in done.stdout, done.stdout[-2000:]
    shards = sorted(p.name for p in (tmp_path / "state" / "shards").iterdir())
    assert len([name for name in shards if name.endswith(".safetensors")]) == 2, shards  # one per rank
    assert {p.name for p in (tmp_path / "state").iterdir()} >= {"optimizer.json", "scheduler.json",
                                                                 "rng-0.safetensors", "rng-1.safetensors"}
    assert not list((tmp_path / "state").rglob(".metadata"))  # DCP's pickled metadata is never written
    resume = tmp_path / "resume.py"
    resume.write_text(ONE_PROCESS_RESUME.format(repo=str(repo), tmp=str(tmp_path), model=str(model_path)))
    alone = subprocess.run([sys.executable, str(resume)], env=env, timeout=300, capture_output=True, text=True)
    assert alone.returncode == 0 and "one process ok" in alone.stdout, alone.stderr[-3000:]


FSDP_VARIANTS = [
    {"name": "replicas"},  # DDP on 2 ranks, the whole model on each: the reference
    {"name": "fsdp", "compute": {"fsdp": True}},  # the 32B preset's setting: each micro-batch reduce-scattered
    {"name": "fsdp-held", "compute": {"fsdp": True, "gradient_sync": "mini_batch"}},
    {"name": "hsdp", "compute": {"fsdp": True, "fsdp_shard_ranks": 1}},  # replicate x shard = 2 x 1
    {"name": "offload", "compute": {"fsdp": True, "fsdp_offload": True}},
    {"name": "fsdp-bf16", "dtype": "bfloat16", "compute": {"fsdp": True}},  # the GPU precision policy
]


@pytest.mark.slow
def test_the_trainer_shards_itself_with_fsdp2_and_trains_as_one_process(model_path, tmp_path):  # noqa: F811
    """learner.compute.fsdp: the trainer's own FSDP2 on 2 gloo ranks, through the real Trainer (accelerate cannot
    run its FSDP on CPU): logprobs, gradients and the weights after a step of 2 updates equal one process's within
    1e-5, under FSDP, HSDP and CPU offload alike; no rank holds a whole gradient after any micro-batch (unless
    `gradient_sync: mini_batch` asks for it); bf16 compute gives fp32 logprobs, not bf16-rounded ones; and the
    sharded checkpoint of 2 ranks reads back exactly on 2 ranks, on 1 process and on 4 ranks."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here.parents[1]), ACCELERATE_USE_CPU="true")

    def launch(prefix: list[str], variants: list[dict]) -> str:
        script = tmp_path / "fsdp-trainer.py"
        script.write_text(FSDP_TRAINER_WORKER.format(here=str(here), repo=str(here.parents[1]), tmp=str(tmp_path),
                                                     model=str(model_path), variants=variants))
        done = subprocess.run(prefix + [str(script)], env=env, timeout=400, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    launch([sys.executable], [FSDP_VARIANTS[0], FSDP_VARIANTS[-1]])  # one process: fp32, and bf16 FSDP on its own
    out = launch(accelerate_launch(2), FSDP_VARIANTS)
    resume = {"name": "resumed", "resume": "ckpt-fsdp-2", "compute": {"fsdp": True}}
    launch([sys.executable], [resume])  # the 2 ranks' sharded checkpoint on one process, and on 4 ranks
    launch(accelerate_launch(4), [resume])
    # Each rank wrote its own share of the published weights (checked whole in the worker): about 1/N of the bytes
    # each under FSDP and DDP, all on the first replica's shard group under HSDP (2 x 1: rank 0 alone).
    for name, world in [(variant["name"], 2) for variant in FSDP_VARIANTS] + [("resumed", 4)]:
        root = tmp_path / f"published-{name}-{world}"
        shares = [int((root / f"wrote-{rank}").read_text()) for rank in range(world)]
        total, largest = map(int, (root / "sizes").read_text().split())
        writers = 1 if name == "hsdp" else world
        assert sum(shares) == total and max(shares) <= total / writers + largest, (name, shares)  # largest unit
        assert shares.count(0) == world - writers, (name, shares)
    alone = load_file(tmp_path / "replicas-1.safetensors")
    for name in ("replicas", "fsdp", "fsdp-held", "hsdp", "offload"):
        ranks = load_file(tmp_path / f"{name}-2.safetensors")
        assert ranks.keys() == alone.keys(), name
        worst = max(float((ranks[k] - alone[k]).abs().max()) for k in alone)
        assert worst <= TOLERANCE, (name, worst)
    fsdp = load_file(tmp_path / "fsdp-2.safetensors")
    for world in (1, 4):
        resumed = load_file(tmp_path / f"resumed-{world}.safetensors")
        assert resumed.keys() and all(torch.equal(resumed[k], fsdp[k]) for k in resumed), world  # exactly
    held = {line.split(":")[0].split()[0]: eval(line.split(":")[1]) for line in out.splitlines() if "holding" in line}
    assert len(held["fsdp"]) >= 3 and not any(held["fsdp"]), held  # several micro-batches, none held a gradient
    assert any(held["fsdp-held"]), held  # the check sees a kept gradient when one is kept
    # bf16 compute: the logprobs stay fp32 (on the bf16 grid, a log-ratio moves by 0.016 nats at logp -3) ...
    bf16 = load_file(tmp_path / "fsdp-bf16-2.safetensors")["logprobs"]
    assert bf16.dtype == torch.float32
    assert float((bf16 == bf16.bfloat16().float()).float().mean()) < 0.2
    # ... equal one process's under the same policy, and the fp32 model's to bf16 compute's precision
    assert float((bf16 - load_file(tmp_path / "fsdp-bf16-1.safetensors")["logprobs"]).abs().max()) <= TOLERANCE
    assert 0 < float((bf16 - alone["logprobs"]).abs().max()) < 0.1


# Sequence parallelism: each world's variants, and the one-process reference each is compared with. Packed rows
# (the layout it splits); micro-batches of 40 tokens, so a share of a pack over 4 ranks is at most 10 tokens while
# rows run up to 15: rows cross shares, and attention must see the other ranks' tokens. With 3 mini-batches the
# pi_old pass packs the tokens otherwise than training does; with the KL term the reference model runs split too;
# with micro-batches of 8 tokens every row is a pack of its own and some shares hold only prompt tokens (they score
# nothing, and still take part in the exchanges).
PACKED = {"packing": "on"}
ULYSSES_CASES = [  # (variant, world, its reference's name)
    ({"name": "ulysses", "compute": {**PACKED, "sequence_parallel": 2}}, 2, "one"),
    ({"name": "ulysses-fsdp", "compute": {**PACKED, "sequence_parallel": 2, "fsdp": True}}, 2, "one"),
    ({"name": "ulysses-sample", "loss_agg": "sample", "compute": {**PACKED, "sequence_parallel": 2}}, 2, "one-sample"),
    ({"name": "ulysses-mini", "mini_batches": 3, "compute": {**PACKED, "sequence_parallel": 2}}, 2, "one-mini"),
    ({"name": "ulysses-kl", "kl_coef": 0.1, "mini_batches": 2, "compute": {**PACKED, "sequence_parallel": 2}}, 2,
     "one-kl"),
    ({"name": "ulysses-compiled", "compute": {**PACKED, "sequence_parallel": 2, "compile": True,
                                              "gradient_checkpointing": "selective"}}, 2, "one"),
    ({"name": "ulysses", "compute": {**PACKED, "sequence_parallel": 4}}, 4, "one"),
    ({"name": "ulysses-rows", "micro_batch_tokens": 8, "compute": {**PACKED, "sequence_parallel": 4}}, 4, "one-rows"),
    ({"name": "ulysses-2x2", "mini_batches": 3, "compute": {**PACKED, "sequence_parallel": 2, "fsdp": True}}, 4,
     "one-mini"),
]
ULYSSES_REFERENCES = [
    {"name": "one", "compute": PACKED}, {"name": "one-sample", "loss_agg": "sample", "compute": PACKED},
    {"name": "one-mini", "mini_batches": 3, "compute": PACKED},
    {"name": "one-kl", "kl_coef": 0.1, "mini_batches": 2, "compute": PACKED},
    {"name": "one-rows", "micro_batch_tokens": 8, "compute": PACKED},
]


@pytest.mark.slow
def test_sequence_parallel_ranks_split_each_row_and_train_as_one_process(model_path, tmp_path):  # noqa: F811
    """learner.compute.sequence_parallel (Ulysses): a pack's tokens split over 2 and 4 gloo ranks, attention
    exchanged by all-to-all (the test model's 4 query and 2 key/value heads: at 4 ranks each KV head is repeated).
    Logprobs, gradients and the weights after a step equal one process's within 1e-5: alone, under FSDP, with the
    sample-level loss (each response's mean over shares), over 3 mini-batches (pi_old recomputed on other packs),
    with the KL term's reference model, with compiled layers (the exchange inside the compiled graph), with shares
    that score nothing, and as 2 data-parallel groups of 2."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(here.parents[1]), ACCELERATE_USE_CPU="true")
    groups = make_groups(n_groups=4, size=4, seed=3)
    longest = max(len(g.rollout.task.prompt_token_ids) + len(s.token_ids) for g in groups for s in g.rollout.samples)
    assert longest > 40 // 4  # a row longer than a rank's share
    assert any(len(g.rollout.task.prompt_token_ids) > 3 for g in groups)  # rows of 8 tokens at most: shares of 2 or 3
    for world, variants in ((1, ULYSSES_REFERENCES), (2, [v for v, w, _ in ULYSSES_CASES if w == 2]),
                            (4, [v for v, w, _ in ULYSSES_CASES if w == 4])):
        script = tmp_path / f"ulysses-{world}.py"
        script.write_text(FSDP_TRAINER_WORKER.format(here=str(here), repo=str(here.parents[1]), tmp=str(tmp_path),
                                                     model=str(model_path), variants=variants))
        prefix = [sys.executable] if world == 1 else accelerate_launch(world)
        done = subprocess.run(prefix + [str(script)], env=env, timeout=400, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    for variant, world, reference in ULYSSES_CASES:
        name = variant["name"]
        alone, ranks = (load_file(tmp_path / f"{reference}-1.safetensors"),
                        load_file(tmp_path / f"{name}-{world}.safetensors"))
        assert ranks.keys() == alone.keys(), name
        worst = {k: float((ranks[k] - alone[k]).abs().max()) for k in alone}
        assert max(worst.values()) <= TOLERANCE, (name, world, max(worst.items(), key=lambda kv: kv[1]))
    moved = load_file(tmp_path / "one-1.safetensors")
    assert any(float(v.abs().max()) > 0 for k, v in moved.items() if k.startswith("grad/"))  # not a vacuous match
