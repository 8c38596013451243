"""Calls every op in torch.ops.sac with hostile values, one argument at a time, and prints how many
calls it made and what each raised. A crash ends the interpreter before the last line."""

import collections

import torch

import sac_plugin  # noqa: F401 - loads the library and its ops

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


def candidates(type_text: str) -> list:
    if type_text in CANDIDATES:
        return CANDIDATES[type_text]
    if type_text.endswith("?"):
        return [None, *candidates(type_text[:-1])]
    return [None]


def main() -> None:
    names = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("sac::"))
    raised = collections.Counter()
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
                try:
                    op(*arguments)
                except Exception as error:  # noqa: BLE001 - any Python exception is an answer
                    raised[type(error).__name__] += 1
    print("raised", dict(sorted(raised.items())))
    print("calls", calls, "ops", len(names))


if __name__ == "__main__":
    main()
