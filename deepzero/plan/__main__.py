"""``python -m deepzero.plan``: runs the planner's command line (``deepzero.plan.cli``)."""

import sys

from deepzero.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
