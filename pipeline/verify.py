"""`python -m pipeline.verify <output.path>`: the documented command; the checks live in `pipeline/output/verify.py`."""

import sys

from pipeline.output.verify import exit_without_teardown, main

if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
