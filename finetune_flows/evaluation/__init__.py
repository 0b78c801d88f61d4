"""Evaluation: the evaluation worker, generation engines, metrics, existing adapters to score."""
