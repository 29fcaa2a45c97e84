"""The control plane: a FastAPI app over SQLAlchemy that stores workflows, runs and their
attempts, and dispatches phases to workers by Celery task name.

Never imports torch, transformers, tokenizers or `worker`.
"""
