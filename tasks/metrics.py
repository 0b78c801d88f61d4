"""Generation metrics: how a greedy answer is scored against its reference."""

from __future__ import annotations


def score_answer(prediction: str, reference: str, metric: str) -> bool:
    p, r = prediction.strip().lower(), reference.strip().lower()
    return p == r if metric == "exact_match" else r in p
