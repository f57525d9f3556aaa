"""``python -m kvkeeper.model.build_kernels [--check]``: compile the C++ CPU kernels (what ``make setup`` runs).

A module of its own so that running it does not re-execute :mod:`kvkeeper.model.cpu_kernels`, which the
package has already imported.
"""

import sys

from .cpu_kernels import main

if __name__ == "__main__":
    sys.exit(main())
