"""The GPU-machine driver: `python -m perf.gpu <suite>` (suites in perf/gpu/suites.py)."""
