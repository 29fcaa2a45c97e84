"""The control plane: a FastAPI app over SQLAlchemy that stores workflows, runs and their
attempts, and dispatches phases to workers by Celery task name.

Its top-level modules are the foundation and import none of its subpackages, which import
downward only: checkpoints; workers; runs; reads (on runs); api (on all). Never imports torch,
transformers, tokenizers, `worker` or `migrations` (tests/unit/test_import_walls.py).
"""
