"""`python -m bench`: the benchmark's command line (bench/cli.py)."""

import sys

from bench.cli import main

sys.exit(main())
