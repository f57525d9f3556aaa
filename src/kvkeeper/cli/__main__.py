"""``python -m kvkeeper.cli``: the command-line interface."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
