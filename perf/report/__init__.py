"""Benchmark reports: Markdown + matplotlib plots from Locust, perf_analyzer and benchmark outputs.

    python -m perf.report RUN_DIR_OR_FILES... -o docs/reports/NAME
"""
