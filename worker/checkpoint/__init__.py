"""Checkpoints on disk: what one is and when it is complete (layout, manifest), saving one in
the background and putting it in place (writer), a sharded phase's shards (shards), and loading
and choosing the one an attempt resumes from (resume). Imports worker.model, worker.data (the
tokenizer's special tokens) and worker's shared modules; never train, link or process."""
