"""A preloaded parent that forks job processes: crash tests pay the torch/Hydra import once, not per run.

Protocol (one JSON object per line): {"cmd": "run", "args": [...], "env": {...}, "log": path} -> {"pid": n};
{"cmd": "wait", "pid": n} -> {"rc": exit code, negative for a signal}. Each child is a real process running
`python -m pipeline <args>`'s entry point, so signals, exit codes and SIGKILL behave as in production.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _child(request: dict) -> None:
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for key, value in request["env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        from pipeline.__main__ import main

        sys.argv = ["pipeline", *request["args"]]
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    import torch  # noqa: F401  (the expensive imports, done once before any fork)

    import pipeline.__main__  # noqa: F401
    import pipeline.engine.engine  # noqa: F401
    import pipeline.job  # noqa: F401
    import pipeline.parallel.runner  # noqa: F401

    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "run":
            pid = os.fork()
            if pid == 0:
                _child(request)
            reply = {"pid": pid}
        else:
            _, status = os.waitpid(request["pid"], 0)
            reply = {"rc": os.waitstatus_to_exitcode(status)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
