"""finetune_flows: the engine the Prefect tasks call; importable without Prefect, never imports tasks or flows."""
