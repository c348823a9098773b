"""Scheduling and KV-cache bookkeeping: scheduler, KV cache manager, block pool."""
