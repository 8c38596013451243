"""support/warm_interpreters.py: a run forked from the waiting interpreter behaves as the same
command in a new interpreter: its output, exit status, traceback, sys.argv and environment, and a
process of its own (a fresh autograd engine, nothing run before it)."""

import os
import subprocess
import sys

import pytest

from support import warm_interpreters


PROGRAM = """
import json, os, sys, threading
import torch
x = torch.ones(2, requires_grad=True)
(x * 3).sum().backward()
print(json.dumps({"argv": sys.argv, "mode": os.environ.get("SAC_WARM_TEST"), "grad": x.grad.tolist(),
                  "threads": threading.active_count()}))
code = sys.argv[1]
if code == "raise":
    raise RuntimeError("raised in the program")
sys.exit(int(code))
"""


def both_ways(command, env):
    """The command's result run by run_python and by subprocess.run, as comparable tuples."""
    warm = warm_interpreters.run_python(command, env=env)
    fresh = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return [
        (done.returncode, done.stdout, done.stderr.splitlines()[-1:] if done.stderr else []) for done in (warm, fresh)
    ]


@pytest.fixture
def single_threaded(monkeypatch):
    # The waiting interpreter forks only where torch's import leaves one thread (tools/test.sh's workers).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    warm_interpreters._close_waiting()
    monkeypatch.setattr(warm_interpreters, "_waiting", None)
    monkeypatch.setattr(warm_interpreters, "_refused", False)
    yield
    warm_interpreters._close_waiting()


@pytest.mark.parametrize("ending", ["0", "3", "raise"])
def test_a_forked_run_ends_as_a_new_interpreter_does(single_threaded, ending):
    env = dict(os.environ, SAC_WARM_TEST=f"ending {ending}")
    warm, fresh = both_ways([sys.executable, "-c", PROGRAM, ending], env)
    assert warm == fresh
    assert warm_interpreters._waiting is not None and warm_interpreters._waiting.ready, "the run was not forked"
    assert warm[0] == {"0": 0, "3": 3, "raise": 1}[ending]
    if ending == "raise":
        assert warm[2] == ["RuntimeError: raised in the program"]


def test_a_program_file_runs_as_its_path_with_its_arguments(single_threaded, tmp_path):
    program = tmp_path / "program.py"
    program.write_text("import json, sys\nprint(json.dumps([sys.argv, __file__, sys.path[0], __name__]))\n")
    warm, fresh = both_ways([sys.executable, program, "an argument"], dict(os.environ))
    assert warm == fresh
    assert warm[1] == f'[["{program}", "an argument"], "{program}", "{tmp_path}", "__main__"]\n'


def test_another_value_of_a_variable_torch_may_read_starts_a_new_interpreter(single_threaded):
    warm_interpreters.run_python([sys.executable, "-c", "pass"], env=dict(os.environ))
    first = warm_interpreters._waiting
    done = warm_interpreters.run_python(
        [sys.executable, "-c", "import os; print(os.environ['TORCH_WARM_TEST'])"],
        env=dict(os.environ, TORCH_WARM_TEST="seen at import"),
    )
    assert (done.returncode, done.stdout) == (0, "seen at import\n")
    assert warm_interpreters._waiting is not first
    assert warm_interpreters._waiting.env["TORCH_WARM_TEST"] == "seen at import"
