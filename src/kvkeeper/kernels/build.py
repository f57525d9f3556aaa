"""``python -m kvkeeper.kernels.build [--check]``: compile the C++ CPU kernels (what ``make setup`` runs).

A module of its own so that running it does not re-execute :mod:`kvkeeper.kernels.cpu`, which the
package has already imported.
"""

import sys

from .cpu import main

if __name__ == "__main__":
    sys.exit(main())
