import sys

from launch.cluster.cli import main

sys.exit(main())
