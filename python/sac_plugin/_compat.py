"""Differences between the torch versions sac_plugin supports (2.11 to 2.15), each in one place.

Every function here says which torch versions behave which way and why it matters to the plugin;
the rest of the package calls these instead of branching on torch.__version__ itself.
"""

from __future__ import annotations

import functools

import torch


def is_compiling() -> bool:
    """True while torch.compile (Dynamo or AOTAutograd) or export traces the calling code.

    NOTE: [context_fn under AOTAutograd on torch 2.11]
    Dynamo does not call a checkpoint's `context_fn`; it stores it on the checkpointed subgraph,
    and AOTAutograd calls it later while it traces the joint graph (under a PROXY dispatch mode),
    where torch.utils.checkpoint asserts that it returned two TorchDispatchModes. torch 2.13 holds
    torch.compiler.is_compiling() True for the whole compilation (convert_frame); torch 2.11 does
    not, so there the check is False at exactly that call, and the plugin handed back its eager
    contexts (nullcontexts, region scopes) and tripped the assertion. The PROXY mode is the test
    torch's own checkpoint makes (torch.utils.checkpoint._is_compiling), so it is asked too.
    """
    if torch.compiler.is_compiling():
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


@functools.cache
def python_handlers_run_below_the_plugin() -> bool:
    """True where torch's `Python` dispatch key sits below `Fake`, the plugin's key (torch 2.11).

    NOTE: [What the plugin sees of Python handlers]
    There the plugin sees a call on a tensor subclass or under a TorchDispatchMode before the
    subclass's __torch_dispatch__ or the mode does, and none of the ops the handler runs (torch
    excludes every key above `Python` while a handler runs); the fallback counts such calls and
    never keeps them (NOTE: [Python below our key (torch 2.11)] in csrc/dispatch/fallback.cpp).
    What an audit shows differs accordingly, and only that: torch's own SAC mode serves calls
    from its cache after the audit counted them, and the wait_tensor an AsyncCollectiveTensor
    runs inside its handler is not counted. From torch 2.13 `Python` is above `Fake`. Read from
    the dispatcher's own key order (DispatchKeySet lists keys from lowest to highest), not from
    the version number.
    """
    text = repr(torch._C._dispatch_keyset_full())
    keys = text[text.index("(") + 1 : text.rindex(")")].split(", ")
    return keys.index("Python") < keys.index("Fake")
