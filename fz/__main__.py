"""`python -m fz`: the `fz` command (fz/cli.py)."""
import sys

from fz.cli import main

sys.exit(main())
