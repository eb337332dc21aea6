"""Locust load test of kvshare over gRPC streaming.

    locust -f perf/load/locustfile.py --host 127.0.0.1:8001 --headless -u 8 -r 8 -t 60s \
        --kvshare-model ensemble --kvshare-workload perf/load/workloads/chat_prompts.jsonl

or use perf/load/run_locust.sh (CSV + HTML + SLO gates). Options: see kvshare_client.locust_user.
"""

from kvshare_client.locust_user import KvshareGrpcUser


class StreamingUser(KvshareGrpcUser):
    """Streams completions from --kvshare-model, one request at a time, no think time."""
