"""A long run of mixed traffic at saturation that checks the server ends where it started.

    python -m perf.load.soak --minutes 30 [--grpc-url 127.0.0.1:8001 --metrics-url ...] --out DIR

See __main__.py for the options and docs/develop/testing.md ("Soak") for what it sends and checks.
"""
