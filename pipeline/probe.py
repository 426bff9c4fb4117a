"""`python -m pipeline.probe`: the documented command; the measurements live in `pipeline/perf/probe.py`."""

from pipeline.perf.probe import main

if __name__ == "__main__":
    main()
