"""The ``tmac`` command's entry point: Ctrl-C while the command line is still importing exits quietly (130)."""

import gc
import signal
import sys


def _interrupted(signum, frame):
    print("interrupted", file=sys.stderr)
    raise SystemExit(130)


def main() -> int:
    gc.disable()  # until the imports are done: tmac.apps.process.freeze_imports
    signal.signal(signal.SIGINT, _interrupted)  # until the CLI's own handling takes over
    from tmac.apps import cli

    signal.signal(signal.SIGINT, signal.default_int_handler)
    return cli.main()
