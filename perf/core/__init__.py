"""Scheduler and page bookkeeping replayed on workload traces, without a model (CPU)."""
