"""`python -m ballast`: the command line (`ballast.dev.cli`)."""

import sys

from ballast.dev.cli import main

sys.exit(main())
