"""The warning classes the plugin issues for what it cannot honour, so that a user (or a test
suite) can filter, log or raise exactly these."""

from __future__ import annotations

__all__ = ["HeldNeverServedWarning"]


class HeldNeverServedWarning(UserWarning):
    """A checkpointed layer held kept (or offloaded) outputs from its forward to its backward that
    its recompute never asked for: memory paid for compute that was not saved (NOTE: [Served, or
    named] in csrc/dispatch/kept_outputs.cpp). The message names the layer, each call, its unit and the
    bytes; issued once per checkpoint site. `sac_plugin.audit()` counts such calls per op
    (`AuditRow.never_served`, `never_served_bytes`)."""
