"""`python -m memfit ...`: the same as the `memfit` command."""

import sys

from memfit.cli import main

if __name__ == "__main__":
    sys.exit(main())
