"""Runs as their users drive them: workflows, submission and its inputs (initial checkpoint,
digests, signature), the public view, resume, pause and cancel.

May import service.workers, service.checkpoints and the foundation (service's top-level
modules); never service.reads or service.api.
"""
