"""The run configuration (typed model) and the checks of a run before anything loads."""
