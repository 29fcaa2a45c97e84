"""Read models: metric series (thinned in the database), evaluation summaries, comparisons of
runs, and CSV exports.

May import service.runs (a run's tags) and the foundation (service's top-level modules); never
service.workers or service.api.
"""
