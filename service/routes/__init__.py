"""One router per resource; each route parses, authorises, calls a plain function, returns."""
