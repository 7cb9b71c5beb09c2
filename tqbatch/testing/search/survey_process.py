"""One process of ``shards.run_in_processes``, from its first line.

It takes its scheduling and its CPU (``scheduling``) before it imports
anything that starts threads. numpy's BLAS sizes its thread pool from the
CPUs the process may run on when it loads: a pool of two put on one CPU
afterwards spins against the process's own work. A first campaign took
8.9 ms an op that way, 4.3 ms unpinned and 3.3 ms pinned from the start
(docs/search-speed.md, "One CPU for each survey process"). Then it runs its
share (``shards.process_main``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Only the standard library and this module's package before the CPU is taken
# (tests/unit/test_scheduling.py checks that numpy and MLX are not loaded by then).
from tqbatch.testing.search.scheduling import batch_scheduling, one_cpu


def main(directory: str, process: int, examples: int, parent: int) -> None:
    """Survey process ``process`` of those ``directory``'s configuration starts."""
    cfg = json.loads((Path(directory) / "config.json").read_text())
    batch_scheduling()  # shares the runner's cores with the other survey processes
    one_cpu(process, of=cfg["processes"])  # MLX's hand-overs stay on one CPU

    from tqbatch.testing.search.shards import process_main  # after the CPU is taken

    process_main(cfg, directory, process, examples, parent)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
