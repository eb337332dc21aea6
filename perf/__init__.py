"""kvshare's benchmarks, grouped by what they measure (perf/README.md); `python -m perf.gpu` runs them on the GPU machine."""
