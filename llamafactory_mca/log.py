"""Our log lines look like LLaMA-Factory's and come from rank 0 only (warnings from every rank)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging() -> logging.Logger:
    logger = logging.getLogger("llamafactory_mca")
    if not any(getattr(h, "_llamafactory_mca", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(levelname)s|%(asctime)s] %(name)s:%(lineno)s >> %(message)s",
                                               datefmt="%Y-%m-%d %H:%M:%S"))
        handler._llamafactory_mca = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    rank = os.environ.get("RANK", "0")
    logger.setLevel(logging.INFO if rank == "0" else logging.WARNING)
    return logger
