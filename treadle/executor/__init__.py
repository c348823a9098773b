"""Executors: how the engine drives its workers (base.py states the contract). `uni` runs one
worker in this process; `mp` runs one process per rank on this host; `ray` (across hosts,
issue 46) comes next, as a subclass of base.Executor registered in registry.py."""
