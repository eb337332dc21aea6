"""soak.png: RSS (server + stubs) and the pool's pages over the run; skipped without matplotlib."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence


def plot(rows: Sequence[dict[str, Any]], out: Path, *, warmup_end_s: float, load_end_s: float,
         title: str) -> Optional[str]:
    """Writes out and returns None, or returns why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    minutes = [r["elapsed_s"] / 60 for r in rows]
    fig, (ax_rss, ax_pages) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    # tritonserver's own RSS is ~2% of the stubs': it gets its own axis so both stay readable.
    ax_server = ax_rss.twinx()
    for ax, key, label, color in ((ax_rss, "rss_total_mb", "server + stubs (left)", "tab:blue"),
                                  (ax_server, "rss_server_mb", "tritonserver (right)", "tab:green")):
        pts = [(m, r[key]) for m, r in zip(minutes, rows) if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label, lw=1, color=color)
    ax_rss.set_ylabel("RSS, server + stubs (MiB)")
    ax_server.set_ylabel("RSS, tritonserver (MiB)")
    lines = ax_rss.get_lines() + ax_server.get_lines()
    ax_rss.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize=8)
    for key in ("kv_pages_active", "kv_pages_cached", "kv_pages_free"):
        pts = [(m, r[key]) for m, r in zip(minutes, rows) if r.get(key) is not None]
        if pts:
            ax_pages.plot(*zip(*pts), label=key.removeprefix("kv_pages_"), lw=0.8)
    ax_pages.set_ylabel("KV pages")
    ax_pages.set_xlabel("minutes")
    ax_pages.legend(loc="upper right", fontsize=8)
    for ax in (ax_rss, ax_pages):
        ax.axvline(warmup_end_s / 60, color="grey", ls=":", lw=1)
        ax.axvline(load_end_s / 60, color="grey", ls="--", lw=1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return None
