"""`python -m cli <command>`: the `dapo` command without the console script (the launcher starts services so)."""

import sys

from cli.main import main

sys.exit(main())
