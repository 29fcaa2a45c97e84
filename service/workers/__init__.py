"""The service's side of its workers: leases and reports (the worker protocol), the fleet it
has heard from, jobs, the outbox dispatcher and the reaper.

May import service.checkpoints and the foundation (service's top-level modules); never
service.runs, service.reads or service.api.
"""
