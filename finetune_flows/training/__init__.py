"""Training: the step's launch and attempts, the rank worker, planner, distributed and Ray launchers."""
