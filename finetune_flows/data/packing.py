"""Padding-free training batches: rows packed into token-budget micro-batches.

A micro-batch is one row of `sum(len(row))` tokens: `input_ids`, `labels` and per-row `position_ids` are
concatenated, and `cu_seq_lens_q/k` (cumulative row lengths) with `max_length_q/k` (Python ints, as the varlen
kernels want them) tell the attention where each row starts, so no token ever attends across rows and no dense
mask is built (models/attention.py). The first label of every row is set to -100: after the causal shift the last
token of one row never learns to predict the first token of the next, so the loss equals the per-row loss.

The schedule is fixed up front from the seed: rows are shuffled per epoch and filled into packs of at most
`budget` tokens; pack `j` goes to rank `j % world` (accelerate hands a sequential sampler's batches out round-robin),
so every rank gets packs of about the same number of tokens (no straggler waits on variable-length data). After an
out-of-memory retry each pack is cut into `split` pieces and the accumulation multiplied by `split`: every optimizer
step then sees exactly the same rows as before, so the results do not change, only the peak memory.

Without packing (`train.packing: false`, and the evaluation's loss) rows are padded into batches (PadCollator).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from transformers import DataCollatorWithFlattening

from finetune_flows.data.dataset import IGNORE_INDEX


def fill_packs(lengths: Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """Fill rows in the given order into packs of at most `budget` tokens (a longer row gets a pack of its own)."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = lengths[i]
        if current and used + n > budget:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return packs


def split_pack(pack: list[int], lengths: Sequence[int], pieces: int) -> list[list[int]]:
    """Cut a pack into `pieces` consecutive parts of about equal tokens; parts may be empty for short packs."""
    total = sum(lengths[i] for i in pack)
    parts: list[list[int]] = [[] for _ in range(pieces)]
    seen = 0
    for i in pack:
        # a row goes to the part its middle token falls in, so the parts stay balanced and in order
        part = min(pieces - 1, int((seen + lengths[i] / 2) * pieces / max(total, 1)))
        parts[part].append(i)
        seen += lengths[i]
    return parts


@dataclass(frozen=True)
class PackSchedule:
    """The global order of micro-batches for a whole run (every rank derives the same one)."""

    micro_batches: list[list[int]]  # row indices per micro-batch, in sampler order (round-robin over ranks)
    steps: int  # optimizer steps this schedule covers
    accumulation: int  # micro-batches per rank per optimizer step (after splitting)
    packs_per_epoch: int
    tokens_per_step: float  # mean real tokens per optimizer step, all ranks

    @property
    def micro_batch_count(self) -> int:
        return len(self.micro_batches)


def first_packs(lengths: Sequence[int], budget: int, accumulation: int, world: int, seed: int) -> list[list[int]]:
    """The first epoch's packs; ValueError where they are fewer than one optimizer step takes (`accumulation` per
    rank on each of `world` ranks). Cheap: the training step checks it before any rank starts."""
    first = fill_packs(lengths, _shuffled(len(lengths), seed, 0), budget)
    if len(first) < accumulation * world:
        raise ValueError(f"{len(lengths)} rows make {len(first)} packs of <= {budget} tokens, fewer than one "
                         f"optimizer step needs ({accumulation} per rank x {world} ranks)")
    return first


def build_schedule(lengths: Sequence[int], budget: int, accumulation: int, world: int, seed: int,
                   max_steps: int, epochs: float = 1.0, split: int = 1) -> PackSchedule:
    """Packs for `max_steps` optimizer steps (or `epochs` when max_steps is -1), in sampler order.

    Each optimizer step consumes `accumulation * world` packs; with `split` > 1 every pack becomes `split` consecutive
    micro-batches of the same rank and the accumulation is multiplied by `split`.
    """
    if budget < 1 or accumulation < 1 or world < 1 or split < 1:
        raise ValueError(f"invalid schedule: budget={budget} accumulation={accumulation} world={world} split={split}")
    per_step = accumulation * world
    first = first_packs(lengths, budget, accumulation, world, seed)
    steps = max_steps if max_steps > 0 else max(1, math.floor(len(first) / per_step * epochs))
    packs = list(first)
    epoch = 1
    while len(packs) < steps * per_step:
        packs += fill_packs(lengths, _shuffled(len(lengths), seed, epoch), budget)
        epoch += 1
    packs = packs[: steps * per_step]

    order: list[list[int]] = []
    for step in range(steps):
        block = packs[step * per_step:(step + 1) * per_step]  # pack (a * world + r) is micro-step a of rank r
        for a in range(accumulation):
            by_rank = [block[a * world + r] for r in range(world)]
            pieces = [split_pack(p, lengths, split) if split > 1 else [p] for p in by_rank]
            for j in range(split):
                order += [pieces[r][j] for r in range(world)]
    tokens = sum(lengths[i] for p in packs for i in p)
    return PackSchedule(micro_batches=order, steps=steps, accumulation=accumulation * split,
                        packs_per_epoch=len(first), tokens_per_step=tokens / steps)


def _shuffled(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


class PackedDataset:
    """Map-style dataset whose items are whole micro-batches (lists of rows); the DataLoader's batch size is 1."""

    def __init__(self, rows: list[dict[str, list[int]]], schedule: PackSchedule):
        self.rows = rows
        self.schedule = schedule

    def __len__(self) -> int:
        return self.schedule.micro_batch_count

    def __getitem__(self, i: int) -> list[dict[str, list[int]]]:
        return [self.rows[j] for j in self.schedule.micro_batches[i]]


class TokenTally:
    """Real tokens of the micro-batches the model has run on. The DataLoader builds a batch before training needs
    it (accelerate fetches the next one early, to know which is last), so a collator notes each batch's tokens when
    it builds it (`built`), and `count_on(model)` adds them to `tokens` when the model runs that batch: each step is
    timed with its own tokens, the last one included."""

    def __init__(self):
        self.tokens = 0
        self._built: deque[int] = deque()

    def built(self, tokens: int) -> None:
        self._built.append(tokens)

    def count_on(self, model) -> None:
        def ran(module, args) -> None:  # a forward pre-hook: one call per micro-batch, in the order they were built
            if self._built:
                self.tokens += self._built.popleft()

        model.register_forward_pre_hook(ran)


@dataclass(frozen=True)
class FixedShape:
    """One shape for every micro-batch of a run (what CUDA graphs replay): `tokens` in each packed row, `segments`
    rows in its cu_seq_lens (empty ones at the end), `max_length` as the attention's longest row."""

    tokens: int
    segments: int
    max_length: int

    @classmethod
    def for_schedule(cls, schedule: PackSchedule, lengths: Sequence[int], tokens: int) -> FixedShape:
        """Room for the largest micro-batch of `schedule`: its most rows, plus padding cut into pieces no longer
        than the longest row."""
        longest = max(lengths)
        real = max(sum(lengths[i] for i in mb) for mb in schedule.micro_batches)
        tokens = max(tokens, real)
        rows = max(max(len(mb) for mb in schedule.micro_batches), 1)
        return cls(tokens=tokens, segments=rows + math.ceil(tokens / longest), max_length=longest)


class PackedCollator(TokenTally):
    """One micro-batch (a list of rows) -> one packed row with position ids and varlen attention kwargs: transformers'
    DataCollatorWithFlattening, plus the token tally and a stand-in for an empty piece of a split pack.

    With `fixed` (FixedShape) every micro-batch has the same shape: the packed row is filled up to `fixed.tokens`
    with padding rows of their own (pad tokens, every label ignored, each at most `fixed.max_length` long, so no
    kernel meets a row longer than the max length it is told), cu_seq_lens is extended with empty rows, and the max
    lengths are `fixed.max_length`. No real token attends to padding, and padding adds nothing to the loss."""

    def __init__(self, pad_token_id: int, fixed: FixedShape | None = None):
        super().__init__()
        self.pad = pad_token_id  # real tokens only are counted: an empty split piece is one ignored token
        self.fixed = fixed
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True, separator_id=IGNORE_INDEX)

    def __call__(self, batch: list[list[dict[str, list[int]]]]) -> dict[str, Any]:
        (rows,) = batch  # the DataLoader's batch size is 1: the item is already a whole micro-batch
        self.built(sum(len(r["input_ids"]) for r in rows))
        if self.fixed is not None:
            return self._fixed(rows)
        if not rows:  # an empty piece of a split pack: one ignored token keeps every DDP rank in step
            rows = [{"input_ids": [self.pad], "labels": [IGNORE_INDEX]}]
        return self.flatten(rows, return_tensors="pt")

    def _fixed(self, rows: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        shape = self.fixed
        free = shape.tokens - sum(len(r["input_ids"]) for r in rows)
        if free < 0 or len(rows) + math.ceil(free / shape.max_length) > shape.segments:
            raise ValueError(f"a micro-batch of {len(rows)} rows and {shape.tokens - free} tokens does not fit the "
                             f"fixed shape {shape}")
        pieces = [min(shape.max_length, free - start) for start in range(0, free, shape.max_length)]
        rows = rows + [{"input_ids": [self.pad] * n, "labels": [IGNORE_INDEX] * n} for n in pieces]
        out = self.flatten(rows, return_tensors="pt")
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            cu = out[key]
            out[key] = torch.cat([cu, cu[-1:].expand(shape.segments + 1 - len(cu))])
        out["max_length_q"] = out["max_length_k"] = shape.max_length
        return out


class PadCollator(TokenTally):
    """Right-pad a batch; padding never counts in the loss. Counts the real tokens the model has run on. Ours, not
    DataCollatorForSeq2Seq: the same tensors from a pad id alone, not through a tokenizer and its padding_side,
    and faster (benchmarks/results/collators-0xGPU-20261203-120725/NOTE.md)."""

    def __init__(self, pad_token_id: int):
        super().__init__()
        self.pad = pad_token_id

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        self.built(int(mask.sum()))
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
