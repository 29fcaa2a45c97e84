"""Artifacts on an object store: checkpoints committed by manifest, and this worker's local cache
of what it downloads and stages. Imports runtime.store and worker modules below it."""
