"""RecomputeConfig's deprecated field names, read for one more release: as keywords (and so as
keys of a config file) and as attributes, each with a FutureWarning naming the current name. The
config holds, compares, copies and writes only the current names."""

from __future__ import annotations

import functools
import warnings

__all__ = ["GIVEN_UNDER_OLD_NAMES", "RENAMED_FIELDS", "install"]

# Each deprecated name and the field it names now; its values join that field's, after them.
RENAMED_FIELDS = {
    "units": "kept_units",
    "ops": "kept_ops",
    "regions": "kept_units",
    "recomputed_regions": "recomputed_units",
    "offloaded_regions": "offloaded_units",
}
# The instance attribute that hands {field: [(old name, values), ...]} to __post_init__, which
# removes it.
GIVEN_UNDER_OLD_NAMES = "_given_under_old_names"


def install(config_class) -> None:
    """Makes `config_class` (a dataclass) take the deprecated names as keywords and attributes."""
    config_class.__init__ = _read_renamed_fields(config_class.__init__)
    for old in RENAMED_FIELDS:
        setattr(config_class, old, _renamed_attribute(old))


def _read_renamed_fields(init):
    """The dataclass's __init__, also taking the old names (RENAMED_FIELDS) as keywords: each warns
    and hands its values to __post_init__, which joins them to the field's own, after them. Kept
    out of the dataclass's fields, so that a config holds, compares, copies and writes only the
    current names."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        renamed = {}
        for old, new in RENAMED_FIELDS.items():
            if old in kwargs:
                warnings.warn(
                    f"recompute config: {old!r} is deprecated and will be removed in a later release; write "
                    f"{new!r}, the name Policy gives the same values",
                    FutureWarning,
                    stacklevel=2,
                )
                renamed.setdefault(new, []).append((old, kwargs.pop(old)))
        if renamed:
            object.__setattr__(self, GIVEN_UNDER_OLD_NAMES, renamed)
        init(self, *args, **kwargs)

    return __init__


def _renamed_attribute(old: str) -> property:
    new = RENAMED_FIELDS[old]

    def read(self):
        warnings.warn(
            f"recompute config: {old!r} is deprecated and will be removed in a later release; read {new!r}",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(self, new)

    return property(read, doc=f"Deprecated: `{new}`, read with a FutureWarning.")
