"""Each learner rank writes the weights it owns (`weights.transport: shared-fs`, several ranks): no rank gathers the
whole model, and the ranks write in parallel.

Rank 0 makes the version's temporary folder in the shared folder, which every learner rank must see, and tells the
ranks to write (learner/ranks.py). The parameters are dealt to the writing ranks by size, a layer at a time (`owners`,
`writing_unit`, the same on every rank). Under FSDP each parameter is gathered, in the served dtype, to its owner
alone: a gather within the shard group, so a rank receives about 1/N of the model instead of all of it. Under HSDP the
first replica's shard group writes, since the other replicas hold the same shards. Without FSDP every rank already
holds every parameter and keeps those it owns. Each rank writes its own shards (`model-rankNNN-...`), and sends rank 0
what it wrote: names, sizes and sha256s, as msgpack, no pickle. Rank 0 then writes the index and the signed
announcement and renames the folder into place (`services.weights.WeightPublisher.finish`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor

from services.weights import checkpoint_names, shareable_state_dict, unique_tensors
from services.weights_layout import Written, write_shards

if TYPE_CHECKING:  # pragma: no cover
    from learner.trainer import Trainer


def owners(sizes: dict[str, int], writers: list[int]) -> dict[str, int]:
    """Name (of a tensor, or a `writing_unit`) -> the rank that writes it: largest first, each to the writer with the
    fewest bytes so far (ties to the lowest rank), so no writer takes more than its share by more than the largest."""
    load = dict.fromkeys(writers, 0)
    dealt = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(writers, key=lambda r: (load[r], r))
        dealt[name] = rank
        load[rank] += sizes[name]
    return dealt


def writing_unit(name: str) -> str:
    """What one rank writes whole: a tensor's layer (the name up to its first number, `model.layers.3`), or the
    tensor itself outside the layers. A checkpoint tensor that transformers splits in memory (a fused qkv or gate_up
    projection) is reverted from all its parts (`services.weights.checkpoint_names`), and they are of one layer."""
    layer = re.match(r"(.*?\.\d+)\.", name)
    return layer.group(1) if layer else name


def _writers_and_group(model: torch.nn.Module):
    """The global ranks that write, and the group in which each parameter is gathered to its owner (None: every
    rank holds the whole parameter). This rank takes no part when it is not a writer (HSDP's other replicas)."""
    from torch.distributed.tensor import DTensor

    sharded = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if sharded is None:
        return list(range(dist.get_world_size())), None
    mesh = sharded.device_mesh
    if mesh.ndim == 1:
        return mesh.mesh.tolist(), mesh.get_group()
    return mesh.mesh[0].tolist(), mesh.get_group("shard")  # HSDP (replicate x shard): the first replica writes


def _gather_to(value, owner: int, group, rank: int, device: torch.device) -> Tensor | None:
    """The whole of a parameter sharded on dim 0 (FSDP2's layout: torch.chunk's rows, replicated across HSDP's
    replicas), on its owner only."""
    from torch.distributed.tensor import Shard

    if value.placements[-1] != Shard(0) or not all(p.is_replicate() for p in value.placements[:-1]):
        raise ValueError(f"cannot gather placements {value.placements} to one rank")
    local = value.to_local().to(device)  # (offloaded shards live on the host; NCCL gathers on the GPU)
    size = dist.get_world_size(group)
    rows = -(-value.shape[0] // size)  # torch.chunk's rows per rank; the last ranks hold fewer, or none
    padded = local.new_zeros((rows, *value.shape[1:]))
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(size)] if rank == owner else None
    dist.gather(padded, pieces, dst=owner, group=group)
    return torch.cat(pieces)[: value.shape[0]] if rank == owner else None


def owned_weights(trainer: "Trainer") -> dict[str, Tensor]:
    """The parameters this rank writes, whole, on the host in the served dtype, under the checkpoint's names. A
    collective: every rank calls it, with the same model."""
    from torch.distributed.tensor import DTensor

    model = trainer.accelerator.unwrap_model(trainer.model)
    rank = dist.get_rank()
    writers, group = _writers_and_group(model)
    unique = unique_tensors(model)
    served = torch.empty((), dtype=trainer.served_dtype).element_size()
    unit_of = {name: writing_unit(name) for name in unique}
    sizes: dict[str, int] = {}
    for name, tensor in unique.items():
        sizes[unit_of[name]] = sizes.get(unit_of[name], 0) + tensor.numel() * served
    dealt_units = owners(sizes, writers)
    dealt = {name: dealt_units[unit] for name, unit in unit_of.items()}
    out: dict[str, Tensor] = {}
    if rank not in writers:
        return out
    for name, value in unique.items():
        if isinstance(value, DTensor):
            value = _gather_to(value.to(trainer.served_dtype), dealt[name], group, rank, trainer.accelerator.device)
        if dealt[name] == rank:
            out[name] = value.to("cpu", trainer.served_dtype, copy=True).contiguous()
    return checkpoint_names(model, out)


def write_rank_shards(trainer: "Trainer", folder: Path, shard_bytes: int) -> tuple[list[Written], int]:
    """Every rank: write what it owns into `folder` and send rank 0 what it wrote. Returns, on rank 0, every rank's
    `Written` in rank order (elsewhere an empty list), and the bytes this rank gathered and wrote."""
    weights = owned_weights(trainer)
    written = write_shards(Path(folder), shareable_state_dict(weights), shard_bytes,
                           prefix=f"model-rank{dist.get_rank():03d}")
    return [Written.from_wire(w) for w in _gather_to_rank_0(written.to_wire(), trainer.accelerator.device)], \
        written.total


def _gather_to_rank_0(data: dict, device: torch.device) -> list[dict]:
    """Every rank's `data` (msgpack), in rank order, on rank 0; an empty list elsewhere."""
    payload = torch.frombuffer(bytearray(msgpack.packb(data, use_bin_type=True)), dtype=torch.uint8)
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(device)
    pieces = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, pieces, dst=0)
    if rank != 0:
        return []
    return [msgpack.unpackb(piece[: int(size.item())].cpu().numpy().tobytes(), raw=False)
            for piece, size in zip(pieces, sizes)]
