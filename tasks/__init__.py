"""The Prefect tasks of the pipeline, one module per step: its declaration and its call into the engine
(finetune_flows)."""
