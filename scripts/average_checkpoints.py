"""Average checkpoints: the ``mt-average`` command (``mt/average.py``), kept under this name for
the commands written before it was installed (docs/benchmarks.md).

    python scripts/average_checkpoints.py runs/RUN/checkpoints --last 5 -o averaged.pt
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt.average import main  # noqa: E402

if __name__ == "__main__":
    main()
