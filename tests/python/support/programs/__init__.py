"""Programs the tests run in fresh interpreters, one a file (support.subprocesses)."""
