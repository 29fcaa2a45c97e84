"""Shared contracts between the service and the worker: pure pydantic and the standard library.

This package imports neither side nor their frameworks (torch, FastAPI, SQLAlchemy, Celery,
kombu) nor `runtime`; tests/unit/test_import_walls.py holds it to that.
"""
