"""Shared contracts between the service and the worker: pure pydantic and hashlib.

This package imports neither side nor their frameworks (torch, FastAPI, SQLAlchemy, Celery).
"""
