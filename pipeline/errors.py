"""The one exception type that ends a run with a clear message instead of a traceback."""


class JobError(Exception):
    """A job-level problem the user must fix (bad config, unreadable input, missing model).

    `python -m pipeline` prints the message on one line and exits with status 2 (73 for `LeaseHeld`, an output
    leased by another live job). Row-level problems never raise: they become error rows in the output.
    """
