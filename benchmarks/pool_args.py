"""Command-line arguments of the benchmarks that re-validate certification on the recorded pools (no model run)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def parse_pool_args(description: str, min_n_help: str = "skip pools with fewer labelled requests"
                    ) -> argparse.Namespace:
    """``--results`` (the records folder), ``--alpha``, ``--splits``, ``--min-n`` and ``--out``, parsed; logging set
    to warnings."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("docs/results/transfer"))
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--splits", type=int, default=500)
    ap.add_argument("--min-n", type=int, default=30, help=min_n_help)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    return args
