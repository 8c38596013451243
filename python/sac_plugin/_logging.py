"""The package's logger, "sac_plugin".

INFO: one line per model the package checkpoints (which wrap sites, which policy). DEBUG: the
decisions behind it (layers skipped, what each unit runs, ops dropped from a foreign save list).
Nothing is logged per op: the hot path stays free of logging. Configure it as any other logger,
e.g. logging.getLogger("sac_plugin").setLevel(logging.INFO).
"""

import logging

logger = logging.getLogger("sac_plugin")


def describe_layers(indices, count: int) -> str:
    """ "2 of 4 (0, 2)": which of `count` wrap sites are checkpointed, for log lines."""
    shown = ", ".join(map(str, indices[:16])) + (", ..." if len(indices) > 16 else "")
    return f"{len(indices)} of {count} ({shown})"
