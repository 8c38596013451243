"""The layers a caller checkpoints or plans: the ones it was given, or the model's declared wrap
sites (`recompute_wrap_sites()`), each checked to be a distinct module. apply_recompute_config
(_layers.py) and plan_step (planner/_step.py) both take their layers so; each names them in its
own words (wrap sites, layers) and refuses a model that declares none with its own error."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ._validation import describe_value

__all__ = ["given_or_declared"]


def given_or_declared(
    model: nn.Module,
    given,
    *,
    caller: str,
    argument: str,
    noun: str,
    elements: str,
    containers: type | tuple[type, ...] = Iterable,
    undeclared: type[Exception] = ValueError,
    prefix: str = "",
) -> tuple[list[nn.Module], str]:
    """`given` (`caller`'s `argument`), or `model.recompute_wrap_sites()` where it is None, as a
    list of distinct modules, and the name messages give it ("plan_step: layers").

    `noun` is what the caller calls the layers ("wrap sites"); `elements` what it takes ("nn.Module");
    `containers` the types it accepts a list as; a model that declares none is `undeclared`, its
    message after `prefix`. An empty list is the caller's to refuse.

    Raises:
        TypeError: The list is not one of `containers` (or is a str, bytes or module), or an entry
            is not a module.
        ValueError: An entry stands twice in it.
    """
    if given is None:
        declared = getattr(model, "recompute_wrap_sites", None)
        if not callable(declared):
            raise undeclared(
                f"{prefix}{type(model).__name__} declares no {noun} (no recompute_wrap_sites() method); pass "
                f"{argument}=[the layers to checkpoint]"
            )
        given, where = declared(), f"{type(model).__name__}.recompute_wrap_sites()"
    else:
        where = f"{caller}: {argument}"
    if isinstance(given, (str, bytes, nn.Module)) or not isinstance(given, containers):
        raise TypeError(f"sac_plugin: {where} must be a list of {elements}, got {describe_value(given)}")
    sites = list(given)
    seen = {}
    for i, site in enumerate(sites):
        if not isinstance(site, nn.Module):
            raise TypeError(f"sac_plugin: {where}[{i}] must be an nn.Module, got {describe_value(site)}")
        if id(site) in seen:
            raise ValueError(f"sac_plugin: {where} lists one {type(site).__name__} twice (at {seen[id(site)]} and {i})")
        seen[id(site)] = i
    return sites, where
