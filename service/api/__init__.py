"""The HTTP API: the app factory, dependencies, one router per resource, error answers and
middleware, Prometheus metrics, and the dashboard's static files.

May import every other package of service; nothing in service imports it.
"""
