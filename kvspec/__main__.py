"""``python -m kvspec``: the ``kvspec`` command (``kvspec.cli``)."""

import sys

from kvspec.cli import main

if __name__ == "__main__":  # only when run: importing every module of the package (the test suite does) runs nothing
    sys.exit(main())
