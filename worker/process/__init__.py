"""The worker process: the Celery app and its tasks, the runner of one attempt (claim, train,
finish), jobs, and starting and supervising rank processes. The top: imports worker.train,
worker.checkpoint, worker.model, worker.data, worker.link and worker's shared modules."""
