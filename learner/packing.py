"""Responses into model inputs: micro-batch plans, rank balance and the three layouts of a forward pass.

- **packed**: the rows (prompt + response) of a micro-batch concatenated into one sequence without padding,
  position ids restarting at every row; with no attention mask, transformers confines attention to each row from
  the position ids (varlen FlashAttention's cu_seqlens, flex_attention's document mask, or a block-diagonal mask
  for SDPA/eager). A micro-batch holds at most `micro_batch_tokens` real tokens.
- **padded**: rows right-padded to the longest of the micro-batch (rows x longest <= the budget).
- **shared**: the padded layout without the prompts: each distinct prompt runs once (left-padded, `PromptBlock`)
  and its responses run on its KV cache (the trainer's shared prompt pass).

Whatever the layout, a micro-batch says where the hidden state that predicts each response token is
(`hidden_row`, `hidden_pos`) and where its value goes in the `[B, R]` tensors of the loss (`token_response`,
`token_slot`), so the loss code never sees the layout.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Layout = Literal["packed", "padded", "shared"]


@dataclass
class Response:
    """One response to train on, with everything its loss needs except the model's own logprobs."""

    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: Tensor  # [R] float32, mu
    advantage: float
    filtered: bool  # overlong-filtered (paper Sec. 3.4): no token of it enters the loss, and the model never runs it

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_tokens(self) -> int:
        return 0 if self.filtered else len(self.response_ids)


@dataclass
class PromptBlock:
    """The distinct prompts of a micro-batch, left-padded so every prompt's last token is the last column."""

    input_ids: Tensor  # [G, P]
    attention_mask: Tensor  # [G, P]
    position_ids: Tensor  # [G, P]
    of_row: Tensor  # [B] the prompt of each response row

    def to(self, device) -> "PromptBlock":
        return PromptBlock(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                    self.of_row)))


@dataclass
class MicroBatch:
    """Model inputs of one forward pass and where each response token's prediction sits.

    Token order: in the shared layout the first `first_tokens` tokens (each row's first response token) are
    predicted by the prompt pass (`hidden_row` indexes the prompt block there), the rest by the response pass."""

    indices: list[int]  # response indices, in the order of the [B, R] tensors
    input_ids: Tensor  # [rows, L]
    attention_mask: Tensor | None  # [rows, L]; [B, P + R] in the shared layout; None when packed
    position_ids: Tensor  # [rows, L]
    hidden_row: Tensor  # [n] model row of the hidden state that predicts each response token
    hidden_pos: Tensor  # [n] its position in that row (t predicts t + 1)
    token_response: Tensor  # [n] which response of `indices` the token belongs to
    token_slot: Tensor  # [n] its index within the response
    targets: Tensor  # [n] the response token ids
    response_mask: Tensor  # [B, R] 1.0 on response tokens
    prompt: PromptBlock | None = None
    first_tokens: int = 0
    real_tokens: int = 0  # tokens the model runs that are not padding (throughput accounting)
    cu_seqlens: Tensor | None = None  # packed: [rows + 1] int32, where each row (the padding tail one) starts
    longest_row: int = 0  # packed: the longest row of the pack
    advantages: Tensor | None = None  # [B, 1] each response's advantage (Eq. 9)
    response_tokens: Tensor | None = None  # [B] each response's length where response_mask holds a share of it


def length_bucket(layout: Layout, cuda: bool, varlen_kernel: bool, micro_batch_tokens: int) -> int:
    """What a micro-batch's length is rounded up to. On a CPU, 1: nothing is planned per shape there and every
    padding token costs. On a GPU, few distinct shapes where kernels are planned per shape (cuDNN's SDPA): padded
    rows to 64 tokens, packs on a mask to an eighth of the budget. The varlen flash kernels plan nothing, so their
    packs round only to 128 tokens (tensor-core tiles): an eighth of 16k would waste 6 % of a step on average."""
    if not cuda:
        return 1
    if layout != "packed":
        return 64
    return 128 if varlen_kernel else max(1, micro_batch_tokens // 8)


def bucketed(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple`: few distinct shapes, so GPU kernels are not re-planned."""
    return -(-size // multiple) * multiple if multiple > 1 else size


def collate(responses: list[Response], indices: list[int], layout: Layout, pad_token_id: int,
            bucket: int = 1, device: torch.device | str = "cpu", share: tuple[int, int] = (1, 0)) -> MicroBatch:
    """The micro-batch of `indices` in `layout`; the model's sequence dimension rounded up to `bucket`. With
    `share` = (degree, index), packed only: that share of its tokens (`sequence_share`)."""
    rows = [responses[i] for i in indices]
    longest = max(len(r.response_ids) for r in rows)
    response_mask = torch.zeros((len(rows), longest))
    token_response, token_slot, targets = [], [], []
    for b, r in enumerate(rows):
        n = len(r.response_ids)
        response_mask[b, :n] = 1.0
        token_response.append(torch.full((n,), b))
        token_slot.append(torch.arange(n))
        targets.append(torch.tensor(r.response_ids))
    token_response, token_slot, targets = torch.cat(token_response), torch.cat(token_slot), torch.cat(targets)
    if share[0] > 1 and layout != "packed":
        raise ValueError("sequence parallelism splits packed micro-batches only (learner.compute.packing: on)")
    build = {"packed": functools.partial(_packed, share=share), "padded": _padded, "shared": _shared}[layout]
    batch = build(rows, pad_token_id, bucket, token_response, token_slot, targets, response_mask)
    batch.indices = list(indices)
    # Built here, on the host, and copied with the rest: the training loop never makes a tensor from a list.
    batch.advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32).unsqueeze(-1)
    return _on(batch, device)


def _packed(rows, pad_token_id, bucket, token_response, token_slot, targets, response_mask,
            share: tuple[int, int]) -> MicroBatch:
    ids, positions, hidden_pos, starts = [], [], [], [0]
    offset = 0
    for r in rows:
        row = r.prompt_ids + r.response_ids
        ids.extend(row)
        positions.extend(range(len(row)))
        start = offset + len(r.prompt_ids) - 1  # the prompt's last token predicts the first response token
        hidden_pos.extend(range(start, start + len(r.response_ids)))
        offset += len(row)
        starts.append(offset)
    tail = bucketed(offset, bucket) - offset
    ids.extend([pad_token_id] * tail)  # a row of padding of its own: its positions restart, it attends to itself
    positions.extend(range(tail))
    if tail:
        starts.append(offset + tail)
    batch = MicroBatch(
        indices=[], input_ids=torch.tensor([ids]), attention_mask=None, position_ids=torch.tensor([positions]),
        hidden_row=torch.zeros(len(hidden_pos), dtype=torch.long), hidden_pos=torch.tensor(hidden_pos),
        token_response=token_response, token_slot=token_slot, targets=targets, response_mask=response_mask,
        real_tokens=offset, cu_seqlens=torch.tensor(starts, dtype=torch.int32),
        longest_row=max(max(r.length for r in rows), tail),
    )
    return sequence_share(batch, *share, hidden_pos)


def _right_padded(sequences: list[list[int]], pad_token_id: int, width: int) -> tuple[Tensor, Tensor]:
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, ids in enumerate(sequences):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
    return input_ids, attention


def _padded(rows, pad_token_id, bucket, token_response, token_slot, targets, response_mask) -> MicroBatch:
    width = bucketed(max(r.length for r in rows), bucket)
    input_ids, attention = _right_padded([r.prompt_ids + r.response_ids for r in rows], pad_token_id, width)
    prompt_lengths = torch.tensor([len(r.prompt_ids) for r in rows])
    return MicroBatch(
        indices=[], input_ids=input_ids, attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),  # right padding: 0..len-1, pads don't matter
        hidden_row=token_response, hidden_pos=prompt_lengths[token_response] - 1 + token_slot,
        token_response=token_response, token_slot=token_slot, targets=targets, response_mask=response_mask,
        real_tokens=sum(r.length for r in rows),
    )


def _shared(rows, pad_token_id, bucket, token_response, token_slot, targets, response_mask) -> MicroBatch:
    prompt = prompt_block(rows, pad_token_id)
    width = bucketed(max(len(r.response_ids) for r in rows), bucket)
    input_ids, attention = _right_padded([r.response_ids for r in rows], pad_token_id, width)
    lengths = prompt.attention_mask.sum(-1)[prompt.of_row]
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0) + lengths.unsqueeze(-1)  # each continues its prompt
    # First tokens (slot 0) come from the prompt block's last column; token t >= 1 from response position t - 1.
    first = token_slot == 0
    order = torch.cat([first.nonzero().squeeze(-1), (~first).nonzero().squeeze(-1)])
    token_response, token_slot, targets = token_response[order], token_slot[order], targets[order]
    count = int(first.sum())
    hidden_row = torch.cat([prompt.of_row[token_response[:count]], token_response[count:]])
    hidden_pos = torch.cat([torch.full((count,), prompt.input_ids.shape[1] - 1), token_slot[count:] - 1])
    return MicroBatch(
        indices=[], input_ids=input_ids,
        attention_mask=torch.cat([prompt.attention_mask[prompt.of_row], attention], dim=1),
        position_ids=position_ids, hidden_row=hidden_row, hidden_pos=hidden_pos, token_response=token_response,
        token_slot=token_slot, targets=targets, response_mask=response_mask, prompt=prompt, first_tokens=count,
        real_tokens=int(prompt.attention_mask.sum()) + sum(len(r.response_ids) for r in rows),
    )


def prompt_block(rows: list[Response], pad_token_id: int) -> PromptBlock:
    """The distinct prompts of `rows` (a group's responses share one), left-padded, and each row's prompt."""
    slot: dict[tuple[int, ...], int] = {}
    of_row = [slot.setdefault(tuple(r.prompt_ids), len(slot)) for r in rows]
    prompts = list(slot)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for g, ids in enumerate(prompts):
        input_ids[g, width - len(ids):] = torch.tensor(ids)
        attention[g, width - len(ids):] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: the prompt's tokens are 0..len-1
    return PromptBlock(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                       of_row=torch.tensor(of_row))


def _on(batch: MicroBatch, device) -> MicroBatch:
    """The host tensors copied to `device` without waiting: from pinned memory to a GPU, the copy is queued behind
    the work already there, and the host goes on collating the next micro-batch."""
    pin = torch.device(device).type == "cuda"
    for name in ("input_ids", "attention_mask", "position_ids", "hidden_row", "hidden_pos", "token_response",
                 "token_slot", "targets", "response_mask", "cu_seqlens", "advantages", "response_tokens"):
        value = getattr(batch, name)
        if value is not None:
            setattr(batch, name, (value.pin_memory() if pin else value).to(device, non_blocking=True))
    if batch.prompt is not None:
        batch.prompt = batch.prompt.to(device)
    return batch


def sequence_share(batch: MicroBatch, degree: int, index: int, hidden_pos: list[int]) -> MicroBatch:
    """Share `index` of `degree` of a packed micro-batch whose response tokens are predicted at `hidden_pos` (as
    host numbers: ascending in a pack), for sequence parallelism (learner/sequence_parallel.py): a contiguous
    1/degree of its tokens.

    The model runs the share's `input_ids` and `position_ids`; the row boundaries (`cu_seqlens`, `longest_row`)
    stay the whole pack's, for attention. The head scores only the response tokens predicted from inside the share,
    and `response_mask` marks only those, so each token is in exactly one share's loss; `response_tokens` keeps each
    response's whole length (the sample-level loss's per-response mean). Slices only, no read of a tensor's values
    (`dapo plan` runs it on fake tensors)."""
    if degree == 1:
        return batch
    length = batch.input_ids.shape[1]
    if length % degree:
        raise ValueError(f"a pack of {length} tokens does not split in {degree} shares (its bucket must be a multiple)")
    size = length // degree
    low, high = index * size, (index + 1) * size
    first, last = bisect.bisect_left(hidden_pos, low), bisect.bisect_left(hidden_pos, high)  # this share's tokens
    token_response, token_slot = batch.token_response[first:last], batch.token_slot[first:last]
    response_mask = torch.zeros_like(batch.response_mask).index_put((token_response, token_slot),
                                                                    torch.ones(last - first))
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids[:, low:high], position_ids=batch.position_ids[:, low:high],
        hidden_row=batch.hidden_row[first:last], hidden_pos=batch.hidden_pos[first:last] - low,
        token_response=token_response, token_slot=token_slot, targets=batch.targets[first:last],
        response_mask=response_mask, real_tokens=max(0, min(batch.real_tokens, high) - low),
        response_tokens=batch.response_mask.sum(dim=-1),
    )


# -- plans ------------------------------------------------------------------------------------------------------
def balance(indices: list[int], responses: list[Response], world: int,
            attention_crossover: float = math.inf) -> list[list[int]]:
    """Responses dealt to `world` ranks by cost: longest first, each to the least loaded rank (greedy LPT, within
    4/3 of the best split); identical on every rank. A row's cost is its tokens plus its attention's share, which
    grows with the square of its length: `length * (1 + length / attention_crossover)`, the crossover being the
    length at which a row's causal attention costs as much as its matrix products (`throughput.attention_crossover`;
    at 32B about 97k tokens, so a 20k-token row costs 1.2x its tokens)."""
    def cost(i: int) -> float:
        return responses[i].length * (1.0 + responses[i].length / attention_crossover)

    loads = [(0.0, rank) for rank in range(world)]
    shards: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(indices, key=lambda i: (-responses[i].length, i)):
        load, rank = heapq.heappop(loads)
        shards[rank].append(i)
        heapq.heappush(loads, (load + cost(i), rank))
    return shards


def plan(indices: list[int], responses: list[Response], budget: int, packed: bool) -> list[list[int]]:
    """Micro-batches of at most `budget` tokens, longest first: real tokens when packed, rows x longest row when
    padded. A single sequence longer than the budget still gets its own micro-batch."""
    ordered = sorted(indices, key=lambda i: (-responses[i].length, i))
    if packed:  # first fit, longest first: each pack filled close to the budget
        packs, totals = [], []
        for i in ordered:
            length = responses[i].length
            k = next((k for k, total in enumerate(totals) if total + length <= budget), len(packs))
            if k == len(packs):
                packs.append([])
                totals.append(0)
            packs[k].append(i)
            totals[k] += length
        return packs
    padded: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in ordered:
        length = responses[i].length
        if current and max(width, length) * (len(current) + 1) > budget:
            padded.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    if current:
        padded.append(current)
    return padded


@dataclass
class Packer:
    """The trainer's packing settings bound once: its micro-batches, each rank's share, and their tensors.

    `world` and `rank` count data-parallel ranks: with sequence parallelism, the groups of `sequence_degree` ranks
    that train on the same micro-batches, each on its `sequence_index`-th share of the tokens."""

    layout: Layout
    budget: int  # learner.compute.micro_batch_tokens
    pad_token_id: int
    bucket: int  # length_bucket (a multiple of sequence_degree)
    device: torch.device
    world: int
    rank: int
    sequence_degree: int = 1
    sequence_index: int = 0
    attention_crossover: float = math.inf  # balance's cost of a row

    def collate(self, responses: list[Response], indices: list[int]) -> MicroBatch:
        return collate(responses, indices, self.layout, self.pad_token_id, self.bucket, self.device,
                       (self.sequence_degree, self.sequence_index))

    def plan(self, indices: list[int], responses: list[Response]) -> list[list[int]]:
        """Micro-batches of one rank's responses."""
        return plan(indices, responses, self.budget, self.layout == "packed")

    def shard(self, indices: list[int], responses: list[Response]) -> list[list[int]]:
        """Responses dealt to ranks by cost; identical on every rank."""
        return balance(indices, responses, self.world, self.attention_crossover)

    def lockstep(self, per_rank: list[list[int]], responses: list[Response]) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches, padded with weight-0 repeats to the busiest rank's count."""
        return lockstep(per_rank, responses, self.budget, self.layout == "packed", self.rank)


def lockstep(per_rank: list[list[int]], responses: list[Response], budget: int, packed: bool,
             rank: int) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches, padded with weight-0 passes to the busiest rank's count (FSDP's collectives
    need every rank to run the same number of forward passes). A padding pass runs the shortest response of all
    ranks alone, the same on every rank: its content carries no weight, and a rank dealt one very long response
    (few micro-batches) would otherwise run its longest pack again for each."""
    plans = [plan(ix, responses, budget, packed) for ix in per_rank]
    steps = max(len(p) for p in plans)
    if steps == 0:
        return []
    mine = plans[rank]
    filler = [min((i for ix in per_rank for i in ix), key=lambda i: (responses[i].length, i))]
    return [(mine[k], True) if k < len(mine) else (filler, False) for k in range(steps)]
