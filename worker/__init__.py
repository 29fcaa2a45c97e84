"""The data plane: claims an attempt, trains one phase, checkpoints, evaluates and reports back
to the service over HTTP. Imports `contracts`, never the service or its database."""
