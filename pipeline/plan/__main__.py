"""`python -m pipeline.plan`: the documented command; the arithmetic lives in `pipeline/perf/plan_cli.py`."""

import sys

from pipeline.perf.plan_cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
