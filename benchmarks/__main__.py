"""``python -m benchmarks [--quick] [--output-dir DIR]``: see :mod:`benchmarks.runner`."""

import sys

from benchmarks.runner import main

if __name__ == "__main__":
    sys.exit(main())
