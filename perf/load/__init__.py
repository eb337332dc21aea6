"""Load generators against a running server: Locust and perf_analyzer."""
