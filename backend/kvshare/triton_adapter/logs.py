"""One logging setup for every model's stub process (each is its own interpreter): the level comes
from KVSHARE_LOG_LEVEL (default INFO). At DEBUG every request's arrival and final response are
logged with its id, so a request that never ended can be followed through the models."""
from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("KVSHARE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
