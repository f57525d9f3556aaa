"""``python -m kvkeeper``: the command-line interface (see :mod:`kvkeeper.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
