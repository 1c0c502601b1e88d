"""`python -m cluster.cli`: the same as the `vgrpo` command."""

import sys

from cluster.cli import main

sys.exit(main())
