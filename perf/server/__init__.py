"""The engine behind the real Triton server: the CPU server benchmark and the full stack on the GPU."""
