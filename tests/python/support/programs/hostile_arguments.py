"""Calls every op in torch.ops.sac with hostile values, one argument at a time, and every function
and method of sac_plugin._C with hostile values in every position, and prints how many calls it
made and what each raised. A crash ends the interpreter before the last line."""

import collections

import torch

import sac_plugin
from sac_plugin import Policy

CANDIDATES = {
    "int": [64, -1, 0, 2**62],
    "float": [0.5, float("nan")],
    "bool": [True, False],
    "str": ["", "no::such_op", "x" * 300],
    "Tensor": [torch.zeros(2), torch.empty(0)],
    "Tensor[]": [[], [torch.zeros(2)]],
    "Tensor?[]": [[], [None], [torch.zeros(2)]],
    "int[]": [[], [64, -1]],
    "str[]": [[], ["", "x"]],
    "bool[]": [[], [True]],
    "Any[]": [[], [64]],
}
# What a function of the extension module may be handed in any position.
HOSTILE = [
    None,
    64,
    -1,
    2**62,
    2**70,
    0.5,
    True,
    "",
    "no::such_op",
    [],
    [64],
    ("x",),
    {"x": 1},
    object(),
    torch.zeros(2),
]
# Calls that would make the rest of the program meaningless, not unsafe: what the runtime's
# messages and recomputes call back into.
SETTERS = {"set_info_logger", "set_never_served_warning", "set_recompute_above_modes"}


def candidates(type_text: str) -> list:
    if type_text in CANDIDATES:
        return CANDIDATES[type_text]
    if type_text.endswith("?"):
        return [None, *candidates(type_text[:-1])]
    return [None]


def attempt(function, arguments: list, raised: collections.Counter) -> None:
    """Calls `function`; counts the Python exception it raises by type (any is an answer)."""
    try:
        function(*arguments)
    except Exception as error:  # noqa: BLE001 - any Python exception is an answer
        raised[type(error).__name__] += 1


def call_every_op(raised: collections.Counter) -> tuple[int, int]:
    names = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("sac::"))
    calls = 0
    for name in names:
        packet = getattr(torch.ops.sac, name.split("::", 1)[1])
        for overload in packet.overloads():
            op = getattr(packet, overload)
            options = [candidates(str(argument.type)) for argument in op._schema.arguments]
            base = [values[0] for values in options]
            variants = [base] + [
                base[:i] + [value] + base[i + 1 :] for i, values in enumerate(options) for value in values[1:]
            ]
            for arguments in variants:
                calls += 1
                attempt(op, arguments, raised)
    return calls, len(names)


def call_hostile(function, raised: collections.Counter) -> int:
    """`function` with no argument, then one to three arguments, each hostile value in each position."""
    argument_lists = [[]]
    for arity in range(1, 4):
        for position in range(arity):
            for value in HOSTILE:
                argument_lists.append([value if i == position else 64 for i in range(arity)])
    for arguments in argument_lists:
        attempt(function, arguments, raised)
    return len(argument_lists)


def call_every_function(raised: collections.Counter) -> tuple[int, int]:
    module = sac_plugin._C
    policy = Policy(kept_ops=["aten::mm"])._handle
    site = module.Site(policy)
    forward, recompute = site.new_region_scopes()
    instances = [
        policy,
        site,
        forward.region,
        site.new_region(),
        module.op_entry("aten::mm.default"),
        module.CallDecider(policy),
        module.CallProfile(),
        module.Audit(),
        module.Counts(),
        module.CallTrace(),
    ]
    functions = [getattr(module, name) for name in dir(module) if not name.startswith("_") and name not in SETTERS]
    functions = [f for f in functions if callable(f)]  # the types too: their constructors
    for instance in instances:
        functions += [getattr(instance, name) for name in dir(type(instance)) if not name.startswith("__")]
    functions = [f for f in functions if callable(f)]
    calls = sum(call_hostile(function, raised) for function in functions)
    return calls, len(functions)


def main() -> None:
    raised = collections.Counter()
    op_calls, ops = call_every_op(raised)
    function_calls, functions = call_every_function(raised)
    print("raised", dict(sorted(raised.items())))
    print("calls", op_calls + function_calls, "ops", ops, "functions", functions)


if __name__ == "__main__":
    main()
