"""The test accelerator (tests/support/test_accelerator), a PrivateUse1 backend over host memory,
and the fresh interpreters its tests run in.

Each program runs in a fresh interpreter: autograd starts its per-device threads once per process,
counting the devices registered at that moment, so the backend must be loaded before the first
backward of the process, and the pytest process has run many backwards by then. The interpreters
start with torch imported where they can (support/warm_interpreters.py).
"""

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

from support.subprocesses import PROGRAMS, python_environment
from support.warm_interpreters import run_python

# The programs run on the accelerator, and the models their bodies import.
ACCELERATOR_PROGRAMS = PROGRAMS / "accelerator"


def _package_directory():
    """The directory to put on sys.path for `import sac_test_accelerator`, or None where the
    installed package serves (tools/build_test_accelerator.sh), or a skip reason."""
    build = os.environ.get("SAC_TEST_BUILD_DIR")
    if build:
        directory = Path(build) / "test_accelerator"
        if (directory / "sac_test_accelerator" / "libsac_test_accelerator.so").is_file():
            return str(directory), None
    if importlib.util.find_spec("sac_test_accelerator") is not None:
        return None, None
    return None, (
        "the test accelerator is not built: no sac_test_accelerator/libsac_test_accelerator.so under "
        f"SAC_TEST_BUILD_DIR/test_accelerator (SAC_TEST_BUILD_DIR={build!r}; tools/test.sh sets it to the build "
        "tree tools/build.sh makes) and no installed sac_test_accelerator (bash tools/build_test_accelerator.sh)"
    )


PACKAGE_DIRECTORY, SKIP_REASON = _package_directory()


def accelerator_environment(env=None):
    """The environment for an interpreter that imports the accelerator: os.environ with `env` on
    top, and PYTHONPATH entries for the accelerator package (where it is not installed) and for
    `support`."""
    return python_environment(env, paths=[PACKAGE_DIRECTORY] if PACKAGE_DIRECTORY else [])


def _last_report(result):
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_on_accelerator(body, env=None):
    """Runs `body` in a fresh interpreter that has loaded the accelerator first; returns the JSON
    object the body prints last (`report(...)`).

    Args:
        body: Python source, run after `import sac_test_accelerator`; `torch`, `json`, `os`, `sys`,
            `threading` and `report(**values)` are in scope.
        env: environment variables set for the interpreter, on top of this process's.

    Returns:
        The object the last `report(...)` printed.

    The interpreter leaves with os._exit once the body has reported: autograd's device threads may
    still be releasing the last backward's objects, and one that reaches for the GIL while the
    interpreter finalizes aborts the process ("terminate called without an active exception", a
    race in torch's exit path that any accelerator with device threads has).
    """
    prelude = textwrap.dedent(
        """
        import json, os, sys, threading
        import torch
        def report(**values):
            print(json.dumps(values))
        import sac_test_accelerator
        """
    )
    epilogue = "\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"
    result = run_python(
        [sys.executable, "-c", prelude + textwrap.dedent(body) + epilogue], env=accelerator_environment(env)
    )
    return _last_report(result)


def run_accelerator_program(name, *arguments, env=None):
    """Runs the program file `name` of support/programs/accelerator in a fresh interpreter, as
    run_on_accelerator runs a body, and returns the JSON object it reports last.

    Args:
        name: the program's file name, e.g. "plan_step_between.py".
        *arguments: the program's command-line arguments (sys.argv[1:]).
        env: environment variables set for the interpreter, on top of this process's.

    Returns:
        The object the program's last `report(...)` printed.
    """
    # run_path, then os._exit: the same way out as run_on_accelerator's, for the same race.
    launcher = (
        "import os, runpy, sys\n"
        "path = sys.argv.pop(1)\n"
        "runpy.run_path(path, run_name='__main__')\n"
        "sys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"
    )
    command = [sys.executable, "-c", launcher, ACCELERATOR_PROGRAMS / name, *arguments]
    result = run_python(command, env=accelerator_environment(env))
    return _last_report(result)


def runner_with_models(models):
    """A runner for bodies written against the models and steps of programs/accelerator/<models>.py.

    Args:
        models: the module's name, e.g. "offloaded_outputs".

    Returns:
        run(body, engine="native"): runs `body` as run_on_accelerator does, after importing every
        name the module exports, with the plugin's engine chosen by SAC_PLUGIN_ENGINE; returns what
        the body reports last.
    """

    def run(body, engine="native"):
        source = f"from support.programs.accelerator.{models} import *\n" + textwrap.dedent(body)
        return run_on_accelerator(source, env={"SAC_PLUGIN_ENGINE": engine})

    return run
