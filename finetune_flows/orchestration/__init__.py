"""The glue to Prefect: step declaration, step runs, device concurrency slots."""
