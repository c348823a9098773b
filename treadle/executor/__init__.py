"""Executors: how workers are run (one in this process, for now)."""
