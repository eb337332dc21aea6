"""One logging setup for every model's stub process (each is its own interpreter): the level comes
from KVSHARE_LOG_LEVEL (default INFO). At DEBUG every request's arrival and final response are
logged with its id, so a request that never ended can be followed through the models.

A stub that crashes in native code writes every Python thread's stack to the server log, and
`kill -USR1 <stub pid>` writes them from a stub that seems stuck, without stopping it (py-spy
cannot attach to a Triton stub)."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys


def configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("KVSHARE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The stub embeds its interpreter without reading PYTHONFAULTHANDLER: a crash in native code
    # would otherwise leave nothing in the log.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
