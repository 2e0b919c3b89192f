"""python -m launch.sweep (see the package docstring)."""

import sys

from launch.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
