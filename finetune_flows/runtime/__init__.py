"""Processes: launching workers, their lifetime, the fork server, the host policy, GPUs, the environment."""
