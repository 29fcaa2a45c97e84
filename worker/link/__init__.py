"""The worker's link to the service: the HTTP client of its internal API, the lease keeper, the
spool of reports the service could not take yet, and the reporter the loop speaks through.
Imports worker's shared modules only (settings, files, metrics), no other worker subpackage."""
