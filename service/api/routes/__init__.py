"""One router per resource; each route parses, authorises, calls a plain function, returns.

May import any package of service (its dependencies from service.api.deps); only
service.api.app imports the routers.
"""
