"""Fresh interpreters for the tests: a program of support/programs, or a few lines of code, run
with `support` importable and an environment of the test's choosing, started with torch imported
where they can be (support/warm_interpreters.py)."""

import os
import sys
from pathlib import Path

from support.warm_interpreters import run_python

# The programs the tests run in fresh interpreters, one a file.
PROGRAMS = Path(__file__).resolve().parent / "programs"
# The directory that holds the `support` package.
_TESTS = Path(__file__).resolve().parents[1]


def python_environment(env=None, drop=(), paths=()):
    """The environment for a fresh interpreter.

    Args:
        env: variables set on top of this process's environment.
        drop: names of variables of this process's environment the interpreter must not see.
        paths: directories put on PYTHONPATH before the directory that holds `support`.

    Returns:
        A dict for subprocess.run's `env`.
    """
    environment = {name: value for name, value in os.environ.items() if name not in drop}
    environment.update(env or {})
    entries = [*paths, str(_TESTS), environment.get("PYTHONPATH")]
    environment["PYTHONPATH"] = os.pathsep.join(entry for entry in entries if entry)
    return environment


def run_program(name, *arguments, env=None, drop=(), timeout=300):
    """Runs the program file `name` of support/programs in a fresh interpreter.

    Args:
        name: the program's file name, e.g. "coexisting_owner.py".
        *arguments: its command-line arguments (sys.argv[1:]).
        env: variables set on top of this process's environment.
        drop: names of variables of this process's environment the program must not see.
        timeout: seconds before the run is stopped (subprocess.TimeoutExpired).

    Returns:
        The subprocess.CompletedProcess, with stdout and stderr as text.
    """
    command = [sys.executable, PROGRAMS / name, *arguments]
    return run_python(command, env=python_environment(env, drop), timeout=timeout)


def run_ranks(main, args, nprocs, seconds, what):
    """Spawns `nprocs` processes running main(rank, *args) and waits for them; a rank still running
    after `seconds` (a hung collective) is killed and fails the calling test instead of stalling CI."""
    import time

    import pytest
    import torch.multiprocessing as mp

    context = mp.start_processes(main, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what} did not finish within {seconds} s")
