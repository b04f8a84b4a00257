"""Celery workers: claim runs and deployments, launch the engine CLI as child processes, record progress."""
