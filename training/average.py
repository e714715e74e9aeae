"""`python -m ballast.training.average DIR --last 3 --out model.pt`: the export CLI, in training.checkpoint.average."""

from __future__ import annotations

import sys

from ballast.training.checkpoint.average import main

if __name__ == "__main__":
    sys.exit(main())
