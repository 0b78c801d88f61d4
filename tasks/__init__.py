"""The Prefect tasks of the pipeline, one module per step: its declaration, its cache key (`CACHE_KEY`, for a
step that writes a store entry) and its call into the engine (finetune_flows)."""
