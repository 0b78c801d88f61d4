"""Datasets: reading, validating, tokenizing, splitting, the built-in demo data, packed batches."""
