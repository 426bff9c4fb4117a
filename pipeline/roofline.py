"""`python -m pipeline.roofline`: the documented command; the arithmetic lives in `pipeline/perf/roofline_cli.py`."""

import sys

from pipeline.perf.roofline_cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
