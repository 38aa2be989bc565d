"""`python -m memfit ...`: the same as the `memfit` command."""

from memfit.cli import entry

if __name__ == "__main__":
    entry()
