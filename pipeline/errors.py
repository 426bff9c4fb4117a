"""The exception types that end a run with a clear one-line message instead of a traceback."""


class JobError(Exception):
    """A job-level problem the user must fix (bad config, unreadable input, missing model).

    `python -m pipeline` prints the message on one line and exits with status 2 (73 for `LeaseHeld`). Row-level
    problems never raise: they become error rows in the output.
    """


class LeaseHeld(JobError):
    """Another live job owns this output (or an overlapping shard of it), or took it over from this one."""
