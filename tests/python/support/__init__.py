"""Helpers the test modules share: the test accelerator's runner and its programs, toy models,
thread-state checks, and the models and strategies several test modules drive.

Test modules import from here, never from each other. pytest puts tests/python on sys.path (the
rootdir conftest.py lives there, and the directory has no __init__.py), so `support` is importable
as a top-level package from every test module and from the subprocesses the tests start.
"""
