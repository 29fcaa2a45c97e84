"""What both sides run on and neither owns: the embedded broker's transport, the log set-up,
the resolution of user-given paths and the cache of input digests.

`service`, `worker` and `cli` may import it; it imports `contracts`, the standard library and
the libraries both sides already carry (kombu, through Celery), never a side, torch or
SQLAlchemy (tests/unit/test_import_walls.py).
"""
