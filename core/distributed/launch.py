"""``python -m pagebatch.distributed.launch SUBCOMMAND [ARGS]``: one command line for every rank
under torchrun (which starts the same program on each local rank). Rank 0 runs
``pagebatch SUBCOMMAND ARGS``; ranks > 0 run a worker (core/distributed/worker.py) with the
engine keys of ARGS. Without the torchrun environment it is plain ``pagebatch``."""

from __future__ import annotations

import sys

from .parallel_state import torchrun_env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = torchrun_env()
    if env is not None and env[0] > 0:
        from .worker import main as worker_main

        return worker_main(argv)
    from ..cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
