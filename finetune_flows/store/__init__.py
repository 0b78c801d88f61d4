"""The content-addressed store, cache-key fingerprints, run directories."""
