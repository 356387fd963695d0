"""``outbox consume`` under the CPU-time profiler, for ``bench.steady --profile``.

    python bench/steady_profile.py OUT.pickle --log-level WARNING consume bench.steady_app:app

Runs the CLI as its console script does, with ``bench/cpuprofile.py`` sampling from SIGUSR1
to SIGUSR2 (the benchmark sends them when the stream starts and once its last event was
handled, so start-up and shutdown are left out), then writes the samples and the CPU they
stand for to ``OUT.pickle`` for the benchmark to report per event. Started as a script
file, not a module, so that another checkout's consumer (``PYTHONPATH``) can run under it.
"""

from __future__ import annotations

import pickle
import signal
import sys
from pathlib import Path
from types import FrameType

# The script's directory (bench/) first on the path would make bench/relay.py the
# top-level `relay` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

from bench.cpuprofile import CpuProfile  # noqa: E402
from cli.app import main  # noqa: E402


def run() -> None:
    out = Path(sys.argv.pop(1))
    prof = CpuProfile()

    def start(signum: int, frame: FrameType | None) -> None:
        prof.__enter__()

    def stop(signum: int, frame: FrameType | None) -> None:
        prof.__exit__(None, None, None)
        out.write_bytes(pickle.dumps({"stacks": prof.stacks, "cpu_seconds": prof.cpu_seconds}))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    main()


if __name__ == "__main__":
    run()
