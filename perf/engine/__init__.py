"""The engine in one process: offline throughput against HF transformers, step profiles, GPU checks."""
