"""A run's checkpoints, all in one place: where they live, how one is written and read on every rank, which one a
start resumes from, which ones are pruned, and the refill limit's stop record beside them.

Layout, under run_dir:

    checkpoints/step-N/               one checkpoint (`write`, atomically: `step-N.tmp/` renamed into place)
        state/shards/                 the exact fp32 training state, sharded per rank (below)
        state/optimizer.json, state/scheduler.json, state/rng-{rank}.safetensors
        model/                        save_pretrained in the served dtype + the tokenizer: loadable by vLLM
        trainer_state.json            written last: the format and the service's extra state (step, policy, ...)
    checkpoints/latest                the name of the one to resume from, replaced atomically (`Checkpoints.commit`)
    checkpoints/stopped.json          the refill limit's stop record (`on_refill_limit: stop`, exit 3)

The training state: `state/shards/` is a `torch.distributed.checkpoint` (DCP) save in the safetensors format: each
rank writes the part of the weights and AdamW moments it holds (its FSDP shard, or under DDP / one process a share
of the replicated tensors), with the offsets of each piece in the file's metadata. Nothing is gathered on one rank,
so host memory stays at a rank's shard (the 32B recipe's full fp32 state is about 384 GB). Loading reads the pieces
each rank needs for its own shard, whatever the world size that wrote them: a resume on more or fewer ranks is
exact. The reader takes its metadata from the safetensors headers (DCP's default `.metadata` file is a pickle; a
resume never unpickles, so that a planted checkpoint cannot run code).

Crash recovery: a crash between `write`'s two renames leaves `step-N.tmp` (complete once trainer_state.json is in
it) or `step-N.old`; `read` takes the complete one. `latest` names a checkpoint only once it is on disk, fsynced.

The stop record names the checkpointed step it stopped at, so a later start that would resume there finds the run
over, as after total_steps: `dapo learner` exits 0 before it touches the run (a restart policy on failure,
Compose's, then leaves it down), and `dapo run` reports that exit as the stop it is. A start that goes on
(max_refills raised, on_refill_limit set to train, learner.checkpoints.resume=false, or the file deleted) clears it.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from learner.devices import out_of_memory
from services.config import ConfigError
from services.data import DataError
from services.files import fsync_dir, fsync_tree, numbered, write_atomic

if TYPE_CHECKING:  # pragma: no cover
    from learner.trainer import Trainer

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STOPPED = "stopped.json"
STARTED_OVER = "started-over"  # written when `learner.checkpoints.resume: false` started the run over
RUN_RECIPE = "run-recipe.json"  # the recipe of the run's start, for a restart before its first checkpoint
PREFIX = "step-"  # checkpoints/step-N
FORMAT = 4  # 1 accelerate's save_state (pickles); 2 a policy version of its own; 3 full-state gather
STATE_DIR = "state"  # the exact training state, sharded per rank, no pickle anywhere
MODEL_DIR = "model"  # save_pretrained in the served dtype + tokenizer: loadable by vLLM / transformers
TRAINER_STATE = "trainer_state.json"  # format, extra_state (the caller's: step, policy version, ...)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
SHARDS_DIR = "shards"  # DCP, safetensors: weights under model/<name>, AdamW under optimizer/<name>/<slot>
OPTIMIZER_META = "optimizer.json"  # param groups and any non-tensor slot
SCHEDULER_STATE = "scheduler.json"
RNG_STATE = "rng-{rank}.safetensors"  # per rank: torch CPU/CUDA, numpy, python generators


class Checkpoints:
    """The main process's bookkeeping of `run_dir/checkpoints`: the latest, the stop record, pruning."""

    def __init__(self, run_dir: Path, keep: int = 1):
        self.dir = Path(run_dir) / CHECKPOINTS
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step}"

    def steps(self) -> list[int]:
        """The steps of the checkpoint folders present, in order."""
        if not self.dir.is_dir():
            return []
        return sorted(step for p in self.dir.iterdir() if p.is_dir() and (step := numbered(p.name, PREFIX)) is not None)

    def latest_step(self) -> int | None:
        """The step of the checkpoint `latest` names; None when there is none. CheckpointDamaged when it names
        none (a file edited by hand, or damaged)."""
        pointer = self.dir / LATEST
        if not pointer.is_file():
            return None
        named = pointer.read_text().strip()
        if not re.fullmatch(rf"{PREFIX}\d+", named):
            raise CheckpointDamaged(f"{pointer} names {named[:80]!r}, not a checkpoint ({PREFIX}N): write the name "
                                    f"of one of {self.dir}'s {PREFIX}N folders into it, or start over "
                                    "(learner.checkpoints.resume=false)")
        return int(named.removeprefix(PREFIX))

    def extra_state(self, step: int) -> dict:
        """The caller's state saved with step-N (`write`'s extra_state), read without loading the checkpoint (the
        complete copy after a crash between `write`'s renames, as `read` takes)."""
        return json.loads((complete(self.path(step)) / TRAINER_STATE).read_text())["extra_state"]

    def commit(self, step: int) -> None:
        """Point `latest` at step-N (written by `write`), durably, then prune: what writes killed midway left (their
        `.tmp` and `.old` copies), the steps after it (a lineage this run left: killed between a `write` and its
        commit, or a run started over with `resume: false`), then all but the newest `keep`."""
        write_atomic(self.dir / LATEST, self.path(step).name)
        fsync_dir(self.dir)  # `latest` survives a power loss before the caller releases what the step consumed
        self.settle_interrupted_writes()
        for later in (s for s in self.steps() if s > step):
            shutil.rmtree(self.path(later), ignore_errors=True)
        steps = self.steps()
        for old in steps[: max(0, len(steps) - max(1, self.keep))]:
            if old != step:
                shutil.rmtree(self.path(old), ignore_errors=True)

    def settle_interrupted_writes(self) -> None:
        """A write killed between its renames leaves its complete copy aside (`complete`): it takes its step's
        name and its place in the pruning. Every other `.tmp` or `.old` is a write killed midway, or the copy a
        finished one replaced: whole checkpoints nobody reads, which a resume at another step never writes again.
        (Also at the learner's start: a write that filled the disk must not keep the restart from writing.)"""
        if not self.dir.is_dir():
            return
        for suffix in (".tmp", ".old"):  # `.tmp` first: the newer of two complete copies, as `complete` takes
            for leftover in sorted(self.dir.glob(f"{PREFIX}*{suffix}")):
                step = numbered(leftover.name.removesuffix(suffix), PREFIX)
                if step is None or not leftover.is_dir():
                    continue
                if not self.path(step).exists() and (leftover / TRAINER_STATE).is_file():
                    leftover.rename(self.path(step))
                else:
                    shutil.rmtree(leftover, ignore_errors=True)
        fsync_dir(self.dir)

    def mark_run_recipe(self, recipe: dict) -> None:
        """The recipe this run started with: a restart before its first checkpoint is checked against it (the
        groups it left in Redis were sampled and scored by it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / RUN_RECIPE, json.dumps(recipe))

    def run_recipe(self) -> dict | None:
        """What `mark_run_recipe` wrote (None: nothing, or not a recipe)."""
        try:
            saved = json.loads((self.dir / RUN_RECIPE).read_text())
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, dict) else None

    def mark_started_over(self, recipe: dict) -> None:
        write_atomic(self.dir / STARTED_OVER, json.dumps({"at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                                          "recipe": recipe}))

    def started_over_already(self, recipe: dict) -> str | None:
        """When `learner.checkpoints.resume: false` started this run over with this recipe (`mark_started_over`,
        after `forget_latest`), and the run has checkpointed since: the setting was applied (a deployment applies
        its config at every restart: taken again, it would start over the run that start made, finished or
        half-way, every time). None otherwise: a start over with another recipe is another experiment's."""
        try:
            marked = json.loads((self.dir / STARTED_OVER).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(marked, dict) or marked.get("recipe") != recipe or self.latest_step() is None:
            return None
        return str(marked.get("at"))

    def forget_latest(self) -> None:
        """A run started over (`resume: false`): no later start of it may resume the checkpoint of the one before
        (a restart after a crash resumes, and must find this run's own checkpoint or none). The folders stay until
        this run's first checkpoint prunes them."""
        if (self.dir / LATEST).is_file():
            log.warning("starting over: %s no longer names %s (deleted at this run's first checkpoint)",
                        self.dir / LATEST, (self.dir / LATEST).read_text().strip())
            (self.dir / LATEST).unlink()
            fsync_dir(self.dir)

    def record_stop(self, step: int, max_refills: int, reason: str) -> None:
        write_atomic(self.dir / STOPPED, json.dumps({"step": step, "max_refills": max_refills, "reason": reason}))

    def recorded_stop(self) -> dict | None:
        """The stop record when it names the latest checkpoint's step (the run would resume where it stopped), else
        None. An unreadable record is ignored with a warning: it must not keep a run from starting."""
        path = self.dir / STOPPED
        if not path.is_file():
            return None
        try:
            stop = json.loads(path.read_text())
            stop = {"step": int(stop["step"]), "max_refills": int(stop["max_refills"]), "reason": str(stop["reason"])}
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring the unreadable stop record %s (%s)", path, err)
            return None
        return stop if stop["step"] == self.latest_step() else None

    def clear_stop(self) -> None:
        (self.dir / STOPPED).unlink(missing_ok=True)


# -- one checkpoint, written and read by every rank -------------------------------------------------------------
def write(trainer: "Trainer", path: Path, extra_state: dict) -> None:
    """Write `path/` atomically: `state/` (exact fp32 training state: weights, AdamW, scheduler, RNG; safetensors
    and JSON, never a pickle, so that resuming cannot run code planted in a checkpoint),
    `model/` (save_pretrained in the served dtype + the tokenizer) and `trainer_state.json`.

    Written into `path.tmp/` then renamed, so a crash never leaves a half checkpoint under `path`; a write that
    fails (a disk full) takes its half away.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    renaming = []  # set once `tmp` is whole and on disk: from there a failure leaves it for `complete`
    try:
        _write(trainer, path, tmp, extra_state, renaming)
    except BaseException:
        if trainer.accelerator.is_main_process and not renaming:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(trainer: "Trainer", path: Path, tmp: Path, extra_state: dict, renaming: list) -> None:
    old = path.with_name(path.name + ".old")
    accelerator = trainer.accelerator
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / STATE_DIR).mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_training_state(tmp / STATE_DIR, trainer.model, trainer.optimizer.optimizer, trainer.scheduler,
                        accelerator.is_main_process, accelerator.process_index)
    weights = trainer.state_dict_for_publish()
    # Every rank's files (its RNG state) are in `tmp` before rank 0 renames it: a slower rank would write
    # into a folder that is gone (seen in CI: rank 1 died, rank 0 hung in the barrier below).
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model_dir = tmp / MODEL_DIR
        accelerator.unwrap_model(trainer.model).save_pretrained(model_dir, state_dict=weights)
        _set_config_dtype(model_dir, trainer.served_dtype)
        for name in TOKENIZER_FILES:
            if (trainer.model_path / name).is_file():
                shutil.copy2(trainer.model_path / name, model_dir / name)
        meta = json.dumps({"format": FORMAT, "extra_state": extra_state, "files": _state_files(tmp / STATE_DIR)})
        (tmp / TRAINER_STATE).write_text(meta)
        # On disk before the renames make it the checkpoint (and before `latest` names it): after a power loss,
        # a renamed folder of empty files would be a checkpoint that cannot be loaded.
        fsync_tree(tmp)
        renaming.append(True)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


RANKS_SEEN = ".ranks-seen"  # under run_dir: each learner rank's mark, that rank 0 looks for at the start


def check_shared(folder: Path, state) -> None:
    """Every rank (of accelerate's PartialState `state`): refuse a run folder that some learner rank does not see
    as rank 0 does (a volume per node instead of one shared): rank 0 would commit checkpoints without those ranks'
    shards, which no resume could load. Before the model loads."""
    marks = folder / RANKS_SEEN
    if state.is_main_process:
        shutil.rmtree(marks, ignore_errors=True)  # (another launch's marks, on rank 0's view of the folder)
    state.wait_for_everyone()
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"rank-{state.process_index}").write_text(socket.gethostname())
    state.wait_for_everyone()
    if state.is_main_process:
        unseen = [rank for rank in range(state.num_processes) if not (marks / f"rank-{rank}").is_file()]
        shutil.rmtree(marks, ignore_errors=True)
        if unseen:
            raise ConfigError(f"learner ranks {unseen} do not share the run folder {folder} with rank 0 (their marks "
                              f"in {RANKS_SEEN} are not there): every rank writes its checkpoint shards into it, so "
                              "it must be one folder they all mount (a ReadWriteMany volume, NFS)")


def read(trainer: "Trainer", path: Path) -> dict:
    """Every rank: restore weights, optimizer, scheduler and RNG from `write`; return the extra state."""
    path, meta = check_loadable(path)
    load_training_state(path / STATE_DIR, trainer.model, trainer.optimizer.optimizer, trainer.scheduler,
                        trainer.accelerator.process_index)
    return meta["extra_state"]


def check_loadable(path: Path) -> tuple[Path, dict]:
    """The checkpoint at `path` (or the complete copy a crash left, `complete`) and its trainer state, if this
    release can load it: CheckpointDamaged if it was written in another format or its state files are not all as
    written. Files only: the learner asks before it loads the model."""
    try:
        path = complete(Path(path))
    except FileNotFoundError as err:
        raise CheckpointDamaged(f"{err}, which {Path(path).parent / LATEST} names: write the name of one of its "
                                f"{PREFIX}N folders into it, or start over (learner.checkpoints.resume=false)") from err
    meta = json.loads((path / TRAINER_STATE).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointDamaged(f"{path}: checkpoint format {meta.get('format')!r}, and this release reads {FORMAT}: "
                                "finish the run with the release that wrote it, or start over (once: "
                                "learner.checkpoints.resume=false, and delete checkpoints/started-over if a start "
                                "over left it) or in a new run_dir")
    if "files" in meta:  # (none in a checkpoint from before 2026-11-29)
        damaged = _state_files_damaged(path / STATE_DIR, meta["files"])
        if damaged:
            raise CheckpointDamaged(f"{path}: {damaged}; resume from another checkpoint (name it in "
                                    f"{path.parent / LATEST}) or start over (learner.checkpoints.resume=false)")
    return path, meta


def complete(path: Path) -> Path:
    """`path`, or after a crash between `write`'s two renames, the complete copy that survived:
    `path.tmp` once its trainer_state.json (written last) exists, else the previous `path.old`."""
    if path.exists():
        return path
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if (tmp / TRAINER_STATE).is_file():
        return tmp
    if (old / TRAINER_STATE).is_file():
        return old
    raise FileNotFoundError(f"no checkpoint at {path}")


class CheckpointDamaged(DataError):
    """A checkpoint this learner cannot load: its training state not all as written (loading it would mix its
    weights and moments with the fresh model's where a shard file is missing: DCP fills only the pieces it finds),
    or written by a release of another format. A restart would fail the same way: the process exits 65 (`dapo
    run` does not restart it; Compose and Kubernetes do, and the learner refuses it again before it loads the
    model: `over_before_loading`)."""


def _state_files(folder: Path) -> dict[str, int]:
    """Every file of the training state (all ranks' shards, RNG states, the JSON) by its path under `folder`, with
    its size: what `read` checks before it loads."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _state_files_damaged(folder: Path, written: dict[str, int]) -> str | None:
    """Why the training state under `folder` is not the files `write` listed (None: it is)."""
    for name, size in written.items():
        file = folder / name
        if not file.is_file():
            return f"the training state file {name} is missing (a partial copy of the checkpoint?)"
        if file.stat().st_size != size:
            return f"the training state file {name} has {file.stat().st_size:,} bytes, written with {size:,}"
    return None


def _set_config_dtype(model_dir: Path, dtype: torch.dtype) -> None:
    """save_pretrained records the in-memory (fp32 master) dtype; the files hold the served dtype."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# -- the exact training state of one rank (state/) --------------------------------------------------------------
def save_training_state(folder: Path, model, optimizer, scheduler, is_main: bool, rank: int) -> None:
    """Every rank takes part and writes its own shard and RNG state; the main process writes the JSON."""
    tensors, meta = _training_tensors(model, optimizer)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder / SHARDS_DIR), save_distributed=True))
    if is_main:
        (folder / OPTIMIZER_META).write_text(json.dumps(meta))
        (folder / SCHEDULER_STATE).write_text(json.dumps(scheduler.state_dict()))
    tensors, meta = _rng_state()
    save_file(tensors, folder / RNG_STATE.format(rank=rank), metadata={"json": json.dumps(meta)})


def _unwrapped(err: CheckpointException, folder: Path) -> BaseException:
    """What a failed DCP load was: a stop, an I/O error or memory running out as raised (a restart may succeed,
    a stop is a stop); a state of other shapes or keys than the model's a damaged checkpoint (a restart would fail
    alike, loading the model each time)."""
    raised = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
    for transient in (lambda exc: isinstance(exc, (KeyboardInterrupt, OSError)), out_of_memory):
        if found := next((exc for exc in raised if transient(exc)), None):
            return found
    return CheckpointDamaged(f"{folder.parent}: its training state does not fit this model (another model under "
                             f"the same name or folder?): {'; '.join(str(exc)[:300] for exc in raised[:2])}")


def load_training_state(folder: Path, model, optimizer, scheduler, rank: int) -> None:
    """Every rank reads the pieces of its own shard (in place), the JSON, and its own RNG state."""
    tensors, _ = _training_tensors(model, optimizer)  # this rank's tensors, the shapes and shards to fill
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder / SHARDS_DIR)))
    except CheckpointException as err:  # DCP wraps whatever any rank raised: a mismatch is the checkpoint's
        raise _unwrapped(err, folder) from err
    meta = json.loads((folder / OPTIMIZER_META).read_text())
    # The hyperparameters are this start's configuration, not the checkpoint's: a resume that lowers the learning
    # rate or changes the decay, the betas or the warm-up trains with the new values (and says so), as does the
    # kernel AdamW runs (fused on a GPU, foreach: a GPU run resumed on a CPU keeps the live optimizer's). The
    # rate of this step follows from the configured base rate and warm-up at the restored scheduler step.
    changed = set()
    for saved, live in zip(meta["param_groups"], optimizer.param_groups):
        changed |= {key for key in ("initial_lr", "weight_decay", "betas", "eps") if key in saved
                    and key in live and _as_list(saved[key]) != _as_list(live[key])}
        saved.update({key: value for key, value in live.items() if key not in ("params", "lr")})
    model_state = {key.removeprefix("model/"): value for key, value in tensors.items() if key.startswith("model/")}
    optimizer_state = _unflatten_optimizer_state(
        {key.removeprefix("optimizer/"): value for key, value in tensors.items() if key.startswith("optimizer/")},
        meta)
    # Not strict: a tied alias (lm_head.weight of tied-embedding models) was saved once, under its first name.
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(strict=False))
    schedule, live = json.loads((folder / SCHEDULER_STATE).read_text()), scheduler.state_dict()
    if schedule.get("lr_lambdas") != live.get("lr_lambdas"):
        changed.add("warmup_steps")
    scheduler.load_state_dict({**schedule, "base_lrs": live["base_lrs"], "lr_lambdas": live["lr_lambdas"]})
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr reports until the next scheduler step
    if changed:
        log.warning("%s: resumed with this start's optimizer settings, which differ from the checkpoint's in %s",
                    folder.parent, ", ".join(sorted(changed)))
    rng = folder / RNG_STATE.format(rank=rank)
    written_by = len(list(folder.glob(RNG_STATE.format(rank="*"))))
    if rng.is_file() or rank < written_by:  # a rank that wrote the checkpoint must find its file (else: damaged)
        _set_rng_state(*read_tensors(rng))
    else:  # resumed on more ranks than wrote the checkpoint: weights and optimizer are whole, this RNG is new
        log.warning("%s: no RNG state for rank %d (written by %d ranks); it keeps its seeded one", folder, rank,
                    written_by)


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else value


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
