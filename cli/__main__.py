"""`python -m cli <command>`: the `dapo` command without the console script (the launcher starts services so)."""

import sys

from services.startup import die_with_launcher

die_with_launcher()  # a learner rank under torchrun (`-m cli learner`): armed before the seconds of imports below

from cli.main import main  # noqa: E402

sys.exit(main())
