"""The `trainctl` command: an HTTP client of the API, launchers and local tools.

Each command imports a side (service or worker) only inside its own body, so `trainctl runs
list` works on a machine with neither installed.
"""
