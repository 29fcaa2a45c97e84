"""The data plane: claims an attempt, trains one phase, checkpoints, evaluates and reports back
to the service over HTTP. Imports `contracts` and `runtime`, never the service or its database.
Inside, arrows run one way: process -> train -> checkpoint -> model, data; link under train and
process; the shared modules here (settings, error, files, failpoint, metrics) import none."""
