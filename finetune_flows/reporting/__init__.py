"""What a run reports: summary, comparison, plots, progress, experiment tracking."""
