"""Padded rows: our PadCollator against transformers' DataCollatorForSeq2Seq, on the CPU (no model, no GPU).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/collators.py

Builds the generated tokenizer (finetune_flows/models/sources.py) set to right padding, collates the same random
rows with both collators, checks that the tensors are equal and prints the best of 3 passes in ms per batch.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoTokenizer, DataCollatorForSeq2Seq  # noqa: E402

from finetune_flows.data.dataset import IGNORE_INDEX  # noqa: E402
from finetune_flows.models.sources import build_generated_tokenizer  # noqa: E402
from finetune_flows.data.packing import PadCollator  # noqa: E402

SHAPES = ((8, 100, 600), (16, 200, 2000), (4, 1000, 4000))  # rows per batch, shortest and longest row


def random_rows(rng: random.Random, n: int, shortest: int, longest: int) -> list[dict[str, list[int]]]:
    rows = []
    for _ in range(n):
        length = rng.randint(shortest, longest)
        ids = [rng.randrange(1000) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (length // 3) + ids[length // 3:]})
    return rows


def best_ms(collate, batches, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for batch in batches:
            collate(batch)
        best = min(best, time.perf_counter() - started)
    return best / len(batches) * 1e3


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    build_generated_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "right"
    ours = PadCollator(tokenizer.pad_token_id)
    theirs = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True, return_tensors="pt")
    rng = random.Random(0)
    print("| rows | tokens a row | PadCollator ms | DataCollatorForSeq2Seq ms | ratio | same tensors |")
    print("|---|---|---|---|---|---|")
    for n, shortest, longest in SHAPES:
        batches = [random_rows(rng, n, shortest, longest) for _ in range(20)]
        a, b = ours(batches[0]), theirs(batches[0])
        same = set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
        mine, other = best_ms(ours, batches), best_ms(theirs, batches)
        print(f"| {n} | {shortest}-{longest} | {mine:.2f} | {other:.2f} | {other / mine:.1f}x | {same} |")


if __name__ == "__main__":
    main()
