"""benchmarks.md's workloads as data files (text prompts + token ids), made with the served model's tokenizer."""
