"""Fresh interpreters that start with torch already imported: `python -c CODE ARGS...`, forked
from a waiting interpreter that has imported torch and nothing else.

A test that needs a process of its own (the test accelerator's tests: autograd counts the devices
at a process's first backward) pays for `import torch` each time, about a second of CPU, which
over the suite's hundreds of such runs is minutes of CI. A fork of an interpreter that has only
imported torch is that fresh process, minus the import: it has run no op, no backward and no
thread, so the child starts every device, thread and generator of its own, as a new interpreter
would. The child sees the environment the test asked for; what torch read at import is the
waiting interpreter's, so a run is forked only where the two environments differ in the
project's own variables (SAC_*), which torch never reads; any other difference, or a waiting
interpreter that could not be made single-threaded (a fork copies only the forking thread), runs
a new interpreter as before.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# The waiting interpreter: imports torch, says whether it can fork, then forks one child per
# request line (JSON: code, argv, env, stdout and stderr file paths) and answers each with the
# child's exit status. The child runs the code as __main__ with the request's sys.argv and leaves
# as an interpreter that ran it would: SystemExit's code, or a traceback and 1, then finalization.
_WAITING_INTERPRETER = r"""
import json, os, sys
import torch

threads = len(os.listdir("/proc/self/task"))
if threads != 1:
    print(json.dumps({"refused": f"{threads} threads after import torch"}), flush=True)
    sys.exit(0)
print(json.dumps({"ready": True}), flush=True)


def child(request):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    main = {"__name__": "__main__", "__builtins__": __builtins__}
    if request["path"] is not None:
        sys.path[0] = os.path.dirname(request["path"])
        main["__file__"] = request["path"]
    exec(compile(request["code"], request["path"] or "<string>", "exec"), main)
    sys.exit(0)


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""

# Variables the project defines: torch reads none of them, so a child may see other values of
# them than its waiting interpreter saw at import.
_OWN_PREFIX = "SAC_"


class _WaitingInterpreter:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WAITING_INTERPRETER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,  # its children with it: a timeout kills the group
        )
        answer = self._answer(timeout=120)
        self.ready = bool(answer and answer.get("ready"))

    def _answer(self, timeout):
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not readable:
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def serves(self, env: dict[str, str]) -> bool:
        if not self.ready or self.process.poll() is not None:
            return False
        names = set(env) | set(self.env)
        return all(name.startswith(_OWN_PREFIX) for name in names if env.get(name) != self.env.get(name))

    def run(self, command: list[str], code: str, path: str | None, argv: list[str], env: dict[str, str], timeout):
        with tempfile.TemporaryDirectory() as directory:
            out, err = Path(directory, "stdout"), Path(directory, "stderr")
            request = {"code": code, "path": path, "argv": argv, "env": env, "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            answer = self._answer(timeout)
            if answer is None:
                self.close()
                raise subprocess.TimeoutExpired(command, timeout)
            return subprocess.CompletedProcess(command, answer["returncode"], out.read_text(), err.read_text())

    def close(self):
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


_waiting: _WaitingInterpreter | None = None
_refused = False  # a waiting interpreter said it cannot fork: every run starts a new interpreter


def _close_waiting():
    if _waiting is not None:
        _waiting.close()


atexit.register(_close_waiting)


def run_python(command: list, env: dict[str, str] | None = None, timeout: float = 300):
    """Runs `command`, `[sys.executable, "-c", CODE, *ARGS]` or `[sys.executable, PATH, *ARGS]`,
    with environment `env` (the whole environment, as subprocess.run's; default this process's),
    forked from a waiting interpreter that has imported torch where the module docstring's
    conditions hold, else as subprocess.run runs it.

    Returns:
        The subprocess.CompletedProcess, with stdout and stderr as text.
    """
    global _waiting, _refused
    command = [str(part) for part in command]
    env = dict(os.environ if env is None else env)
    if command[0] != sys.executable:
        raise ValueError(f"run_python runs this interpreter ({sys.executable}), got {command[0]!r}")
    # sys.argv as Python sets it: ["-c", *ARGS] for code, [PATH, *ARGS] for a file.
    if command[1] == "-c":
        code, path, argv = command[2], None, ["-c", *command[3:]]
    else:
        path = str(Path(command[1]).resolve())
        code, argv = Path(path).read_text(), command[1:]
    if not _refused and (_waiting is None or not _waiting.serves(env)):
        _close_waiting()
        _waiting = _WaitingInterpreter(env)
        _refused = not _waiting.ready
    if _waiting is not None and _waiting.serves(env):
        return _waiting.run(command, code, path, argv, env, timeout)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
