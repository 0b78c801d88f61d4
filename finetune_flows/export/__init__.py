"""Export: the adapter merged into its base as a standalone checkpoint, with its model card."""
