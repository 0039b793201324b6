"""The exact training state on disk: sharded per rank, safetensors and JSON, never a pickle.

`state/shards/` is a `torch.distributed.checkpoint` (DCP) save in the safetensors format: each rank writes the
part of the weights and AdamW moments it holds (its FSDP shard, or under DDP / one process a share of the
replicated tensors), with the offsets of each piece in the file's metadata. Nothing is gathered on one rank, so
host memory stays at a rank's shard (the 32B recipe's full fp32 state is about 384 GB). Loading reads the pieces
each rank needs for its own shard, whatever the world size that wrote them: a resume on more or fewer ranks is
exact. The reader takes its metadata from the safetensors headers (DCP's default `.metadata` file is a pickle;
a resume never unpickles, so that a planted checkpoint cannot run code).

Beside it: `optimizer.json` (param groups and non-tensor slots), `scheduler.json`, `rng-{rank}.safetensors`.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

log = logging.getLogger(__name__)

SHARDS_DIR = "shards"  # DCP, safetensors: weights under model/<name>, AdamW under optimizer/<name>/<slot>
OPTIMIZER_META = "optimizer.json"  # param groups and any non-tensor slot
SCHEDULER_STATE = "scheduler.json"
RNG_STATE = "rng-{rank}.safetensors"  # per rank: torch CPU/CUDA, numpy, python generators


def save_training_state(folder: Path, model, optimizer, scheduler, is_main: bool, rank: int) -> None:
    """Every rank takes part and writes its own shard and RNG state; the main process writes the JSON."""
    tensors, meta = _training_tensors(model, optimizer)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder / SHARDS_DIR), save_distributed=True))
    if is_main:
        (folder / OPTIMIZER_META).write_text(json.dumps(meta))
        (folder / SCHEDULER_STATE).write_text(json.dumps(scheduler.state_dict()))
    tensors, meta = _rng_state()
    save_file(tensors, folder / RNG_STATE.format(rank=rank), metadata={"json": json.dumps(meta)})


def load_training_state(folder: Path, model, optimizer, scheduler, rank: int) -> None:
    """Every rank reads the pieces of its own shard (in place), the JSON, and its own RNG state."""
    tensors, _ = _training_tensors(model, optimizer)  # this rank's tensors, the shapes and shards to fill
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder / SHARDS_DIR)))
    meta = json.loads((folder / OPTIMIZER_META).read_text())
    # Which kernel AdamW runs (fused on a GPU, foreach) is this process's choice, not the checkpoint's: a GPU run
    # resumed on a CPU, or a checkpoint written before the fused kernel, keeps the live optimizer's.
    for saved, live in zip(meta["param_groups"], optimizer.param_groups):
        saved.update({key: live[key] for key in ("fused", "foreach", "capturable") if key in live})
    model_state = {key.removeprefix("model/"): value for key, value in tensors.items() if key.startswith("model/")}
    optimizer_state = _unflatten_optimizer_state(
        {key.removeprefix("optimizer/"): value for key, value in tensors.items() if key.startswith("optimizer/")},
        meta)
    # Not strict: a tied alias (lm_head.weight of tied-embedding models) was saved once, under its first name.
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(strict=False))
    scheduler.load_state_dict(json.loads((folder / SCHEDULER_STATE).read_text()))
    rng = folder / RNG_STATE.format(rank=rank)
    written_by = len(list(folder.glob(RNG_STATE.format(rank="*"))))
    if rng.is_file() or rank < written_by:  # a rank that wrote the checkpoint must find its file (else: damaged)
        _set_rng_state(*read_tensors(rng))
    else:  # resumed on more ranks than wrote the checkpoint: weights and optimizer are whole, this RNG is new
        log.warning("%s: no RNG state for rank %d (written by %d ranks); it keeps its seeded one", folder, rank,
                    written_by)


def _training_tensors(model, optimizer) -> tuple[dict[str, Tensor], dict]:
    """This rank's weights and AdamW moments (DTensor shards under FSDP) under one flat name space, and the JSON
    part of the optimizer state. Tied weights appear once (the same storage under two names would be two copies)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model_state.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        pointer = local.untyped_storage().data_ptr()
        if pointer in seen and local.numel():
            continue
        seen.add(pointer)
        tensors[f"model/{name}"] = tensor
    slots, meta = _flatten_optimizer_state(optimizer_state)
    tensors.update({f"optimizer/{key}": value for key, value in slots.items()})
    return tensors, meta


def _flatten_optimizer_state(state: dict) -> tuple[dict[str, Tensor], dict]:
    """A name-keyed optimizer state dict as tensors (`{parameter}/{slot}`) and JSON (param groups, any
    non-tensor slot)."""
    tensors, other = {}, {}
    for parameter, slots in state["state"].items():
        for slot, value in slots.items():
            if isinstance(value, Tensor):
                tensors[f"{parameter}/{slot}"] = value
            else:
                other.setdefault(parameter, {})[slot] = value
    return tensors, {"param_groups": state["param_groups"], "other": other}


def _unflatten_optimizer_state(tensors: dict[str, Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for key, tensor in tensors.items():
        parameter, slot = key.rsplit("/", 1)
        state.setdefault(parameter, {})[slot] = tensor
    for parameter, slots in meta["other"].items():
        state.setdefault(parameter, {}).update(slots)
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state() -> tuple[dict[str, Tensor], dict]:
    """This process's random generators: torch (CPU, each CUDA device) and numpy as tensors, python's as JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, python_gauss = random.getstate()
    return tensors, {"python": [version, list(internal), python_gauss],
                     "numpy": [kind, int(position), int(has_gauss), float(gauss)]}


def _set_rng_state(tensors: dict[str, Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(torch.cuda.device_count()) if f"cuda.{i}" in tensors]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    kind, position, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), position, has_gauss, gauss))
    version, internal, python_gauss = meta["python"]
    random.setstate((version, tuple(internal), python_gauss))


def read_tensors(path: Path) -> tuple[dict[str, Tensor], dict]:
    """A safetensors file written with `metadata={"json": ...}`: its tensors and that JSON."""
    with safe_open(path, framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, json.loads(handle.metadata()["json"])
