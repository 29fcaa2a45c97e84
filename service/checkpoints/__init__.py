"""Checkpoints as the service knows them: the registry and its pins, another run's checkpoint
as a source, and what a checkpoint file must be (read without torch).

May import the foundation (service's top-level modules), contracts and runtime; nothing else of
service.
"""
