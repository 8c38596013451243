"""Helpers for tests of state that belongs to one thread: the dispatch key set and scopes entered
on it."""

import threading

import torch


def sac_key_included() -> bool:
    return "Fake" in repr(torch._C._dispatch_tls_local_include_set())


def on_another_thread(fn):
    """Runs fn on a new thread; returns the exception it raised (or None)."""
    raised = []

    def run():
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - handed back to the test
            raised.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None
