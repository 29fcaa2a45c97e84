"""What a phase trains: the model (built, its weights loaded, its device), its optimizers and
its private random streams. Imports worker's shared modules only (error), no other worker
subpackage."""
