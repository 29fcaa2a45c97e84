"""Training one phase: the loop, its objective and schedule, evaluation, and the ranks it runs
over. Imports worker.checkpoint, worker.model, worker.data, worker.link and worker's shared
modules; never worker.process."""
