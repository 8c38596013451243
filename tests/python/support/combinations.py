"""The combination matrix of tests/python/test_combinations.py: one small block, run checkpointed
under a combination of a selection, offloaded inputs, autocast, nesting, dropout and a second
backward, and run unmodified from the same seed.

What each case must show: gradients bitwise those of the unmodified block; every call the rule
keeps or offloads served (the audit's hits are the count `expected_calls` reads off the policy for
this block, and nothing is held and never served); the bytes the regions hold, and those
`sac_plugin.report` counts, are those calls' outputs; and nothing is held once the backward is
done.

`KNOWN_DEFECTS` is the one place a case that fails for a defect outside the tests is marked.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import re
import warnings
from collections.abc import Callable

import torch
from torch import nn

import sac_plugin
import sac_plugin.memory
from sac_plugin import Policy
from sac_plugin._forwards import checkpoint_call
from support.toy_models import observed_regions

DIM, BATCH = 16, 4
KEEP, OFFLOAD = "kept", "offloaded"

# --- the block -------------------------------------------------------------------------------------
# An attention-like part in unit "attn" (a region that keeps, under torch_remat), dropout, an MLP
# part in unit "mlp" (a region that recomputes), and a last projection. The block's last save is
# the input the sin saves before it runs: torch's early stop ends the recompute there, so a kept
# sin is never held (nor is the residual add after it).


def _opened(regions: str, function, name: str, recompute: bool):
    """`function` run inside unit `name`: a sac_plugin recompute unit, or a torch_remat region
    with its recompute= flag."""
    if regions == "torch_remat":
        import torch_remat

        return torch_remat.region(function, name, recompute=recompute)

    def run(*args):
        with sac_plugin.recompute_unit(name):
            return function(*args)

    return run


class Attn(nn.Module):
    def __init__(self, regions: str):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM)
        self.regions = regions

    def core(self, x):
        return torch.tanh(self.wq(x))

    def forward(self, x):
        out = _opened(self.regions, self.core, "attn", recompute=False)(x)
        if self.regions == "torch_remat":
            import torch_remat

            torch_remat.recompute_needs_tensor(out)  # its consumer is bare code (torch_remat's rule)
        return out


class Mlp(nn.Module):
    def __init__(self, regions: str):
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.regions = regions
        # A load counter the forward adds to (NOTE: [The recompute writes nothing outside its
        # region] in csrc/dispatch/outside_writes.cpp): every case checks it counts each forward once.
        self.register_buffer("load", torch.zeros(2 * DIM))

    def core(self, x):
        return torch.relu(self.w1(x))

    def forward(self, x):
        out = _opened(self.regions, self.core, "mlp", recompute=True)(x)
        self.load.add_(out.detach()[0])  # a view and an in-place add: nothing a policy could keep
        return out


class Block(nn.Module):
    def __init__(self, regions: str = "units", dropout: bool = False):
        super().__init__()
        self.attn = Attn(regions)
        self.drop = nn.Dropout(0.1) if dropout else nn.Identity()
        self.mlp = Mlp(regions)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + torch.sin(self.w2(self.mlp(self.drop(self.attn(x)))))


@dataclasses.dataclass(frozen=True)
class Call:
    """A call of the block the rule can keep: op, innermost unit, the torch_remat region's flag
    (None for a plain unit or none), its output's elements, and whether it runs after the
    region's last tensor saved for backward (then kept but never held: NOTE: [Kept outputs the
    recompute never reaches] in csrc/dispatch/kept_outputs.cpp)."""

    op: str
    unit: str | None
    recompute_flag: bool | None
    elements: int
    after_last_save: bool = False


def region_calls(regions: str, autocast: bool, nested: bool) -> list[list[Call]]:
    """The keepable calls of each checkpointed region of one forward, in order; views, dropout's
    ops, parameter casts and the final add are left out (never selected here or never kept).

    Under autocast the attention's input, an activation, is cast inside unit "attn"; weights and
    biases are cast too, but a parameter cast is never kept."""
    attn_flag, mlp_flag = (False, True) if regions == "torch_remat" else (None, None)
    cast = [Call("aten::_to_copy", "attn", attn_flag, BATCH * DIM)] if autocast else []
    attn = [
        *cast,
        Call("aten::addmm", "attn", attn_flag, BATCH * DIM),
        Call("aten::tanh", "attn", attn_flag, BATCH * DIM),
    ]
    mlp = [Call("aten::addmm", "mlp", mlp_flag, BATCH * 2 * DIM), Call("aten::relu", "mlp", mlp_flag, BATCH * 2 * DIM)]
    # sin saves its input before it runs: the last save of the block (and of the outer region).
    outer = [Call("aten::addmm", None, None, BATCH * DIM), Call("aten::sin", None, None, BATCH * DIM, True)]
    return [attn, mlp, outer] if nested else [attn + mlp + outer]


# --- the rule, read off a policy for this block ----------------------------------------------------


def _named(op: str, names) -> bool:
    return op in names or f"{op}.default" in names


def _rule_of(op: str, rules: dict):
    return rules.get(op, rules.get(f"{op}.default"))


def _matches(unit: str | None, patterns) -> bool:
    """docs/semantics.md: each '*' matches any run of characters, everything else itself."""
    if unit is None:
        return False
    return any(re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), unit) for pattern in patterns)


def decide(policy: Policy, call: Call, index: int) -> str | None:
    """KEEP, OFFLOAD or None (recomputed) for `call`, the `index`-th call of its op in its region
    outside recomputed units, by the steps of docs/semantics.md that this block's calls reach."""
    if policy.keeps_nothing and policy.offloads_nothing:
        return None
    if _matches(call.unit, policy.recomputed_units):
        return None
    if _named(call.op, policy.kept_ops):
        return KEEP
    if _named(call.op, policy.offloaded_ops):
        return OFFLOAD
    n = _rule_of(call.op, policy.every_nth_op)
    if n is not None and index % n == 0:
        return KEEP
    if index in (_rule_of(call.op, policy.kept_calls) or ()):
        return KEEP
    if index in (_rule_of(call.op, policy.offloaded_calls) or ()):
        return OFFLOAD
    if _matches(call.unit, policy.kept_units):
        return KEEP
    if _matches(call.unit, policy.offloaded_units):
        return OFFLOAD
    if call.recompute_flag is False and not _matches(call.unit, policy.recomputed_units):
        return KEEP  # a torch_remat region no list names follows its flag
    return None


def expected_calls(policy: Policy, calls_per_region: list[list[Call]]) -> list[tuple[Call, str]]:
    """Every call the policy keeps or offloads in one forward and holds for the recompute, with
    its outcome."""
    held = []
    for calls in calls_per_region:
        seen: dict[str, int] = {}
        for call in calls:
            if _matches(call.unit, policy.recomputed_units):
                outcome = None  # a forced recompute uses up no keep slot
            else:
                index = seen.get(call.op, 0)
                seen[call.op] = index + 1
                outcome = decide(policy, call, index)
            if outcome is not None and not call.after_last_save:
                held.append((call, outcome))
    return held


# --- the axes --------------------------------------------------------------------------------------


_planned: dict[str, list[int]] = {}


def planned_calls() -> dict[str, list[int]]:
    """The kept calls of a memory-budget plan for the block at budget=0.5, as its policy's
    kept_calls (planned once per process). Planned on a batch of 256: at the cases' batch of 4 the
    RNG state the checkpoint saves outweighs the activations, and no plan keeps anything. Which
    calls it keeps depends on the times it measures; the cases read them off the policy."""
    if "calls" not in _planned:
        torch.manual_seed(0)
        x = torch.randn(256, DIM, requires_grad=True)
        kept: dict[str, list[int]] = {}
        for op, index in sorted(sac_plugin.plan(Block(), x.clone(), budget=0.5, runs=1).kept):
            kept.setdefault(op, []).append(index)
        _planned["calls"] = kept
    return _planned["calls"]


# name -> (the block's units: "units" or "torch_remat", the policy's arguments, or None for the plan)
SELECTIONS: dict[str, tuple[str, dict | None]] = {
    "kept_ops": ("units", dict(kept_ops=["aten::addmm", "aten::tanh"])),
    "every_nth": ("units", dict(every_nth_op={"aten::addmm": 2})),
    "kept_calls": ("units", dict(kept_calls={"aten::addmm.default": [0, 2]})),
    "kept_unit": ("units", dict(kept_units=["attn"])),
    "recomputed_unit": ("units", dict(kept_ops=["aten::addmm", "aten::relu"], recomputed_units=["mlp"])),
    "every_nth_recomputed_unit": ("units", dict(every_nth_op={"aten::addmm": 2}, recomputed_units=["attn"])),
    "offloaded_unit": ("units", dict(offloaded_units=["mlp"], offload_min_bytes=0)),
    "offloaded_ops": ("units", dict(offloaded_ops=["aten::addmm"], offload_min_bytes=0)),
    "remat_flags": ("torch_remat", dict(kept_ops=["aten::sin"])),
    "remat_lists": ("torch_remat", dict(kept_units=["mlp"], recomputed_units=["attn"])),
    "plan": ("units", None),
}
# Autocast around: nothing; the forward only; the forward and, in a context of its own, the
# backward (both backwards of a retained graph in one); one context around forward and backward.
AUTOCAST = ("none", "forward", "forward_and_backward", "one_context")


@dataclasses.dataclass(frozen=True)
class Case:
    selection: str
    offload_inputs: bool = False
    autocast: str = "none"
    nested: bool = False
    dropout: bool = False
    retain_graph: bool = False
    # A drawn policy's arguments (the wide run), in place of the named selection's.
    drawn: tuple | None = None

    @property
    def regions(self) -> str:
        return SELECTIONS[self.selection][0] if self.drawn is None else dict(self.drawn)["regions"]

    @property
    def id(self) -> str:
        return "-".join(
            [
                self.selection,
                "offload_inputs" if self.offload_inputs else "inputs_kept",
                f"autocast_{self.autocast}",
                "nested" if self.nested else "flat",
                "dropout" if self.dropout else "no_dropout",
                "retain_graph" if self.retain_graph else "one_backward",
            ]
        )

    def policy(self) -> Policy:
        if self.drawn is not None:
            arguments = {k: _thawed(k, v) for k, v in self.drawn if k != "regions"}
        else:
            arguments = SELECTIONS[self.selection][1]
            if arguments is None:
                arguments = dict(kept_calls=planned_calls())
        return Policy(**arguments, offload_inputs=self.offload_inputs)


def _thawed(name: str, value):
    if name in ("every_nth_op", "kept_calls"):
        return {op: list(rule) if isinstance(rule, tuple) else rule for op, rule in value}
    return list(value) if isinstance(value, tuple) else value


def all_cases() -> list[Case]:
    return [
        Case(*values)
        for values in itertools.product(
            SELECTIONS, (False, True), AUTOCAST, (False, True), (False, True), (False, True)
        )
    ]


# The default run. Every selection without autocast, with and without offloaded inputs, flat and
# nested, dropout and the second backward each on in half of them so that every pair of their
# values is met; and every selection under each kind of autocast once, the other axes turning with
# the selection. (bfloat16 matmuls on a CPU without bfloat16 instructions cost milliseconds each:
# autocast cases are the expensive ones.)
def default_cases() -> list[Case]:
    cases = []
    for selection, offload_inputs, nested in itertools.product(SELECTIONS, (False, True), (False, True)):
        cases.append(Case(selection, offload_inputs, "none", nested, offload_inputs == nested, offload_inputs))
    for (s, selection), (a, autocast) in itertools.product(enumerate(SELECTIONS), enumerate(AUTOCAST[1:])):
        turn = s + a
        cases.append(Case(selection, turn % 2 == 0, autocast, turn % 3 == 0, turn % 2 == 1, (turn // 2) % 2 == 0))
    return cases


def accelerator_cases() -> list[Case]:
    """The cases run on the test accelerator, where offloaded outputs and inputs leave the device:
    the selections that offload, and one that keeps, with and without offloaded inputs, flat and
    nested (autocast is the CPU's here)."""
    cases = []
    for selection in ("offloaded_unit", "offloaded_ops", "kept_ops", "plan"):
        for n, (offload_inputs, nested) in enumerate(itertools.product((False, True), (False, True))):
            cases.append(Case(selection, offload_inputs, "none", nested, dropout=n % 2 == 0, retain_graph=n in (1, 2)))
    return cases


# --- known defects ---------------------------------------------------------------------------------


def held_per_region(case: Case) -> list[int]:
    """How many calls each region of the case holds for its recompute (the attention's, the
    MLP's and the outer one when nested)."""
    policy = case.policy()
    regions = region_calls(case.regions, case.autocast != "none", case.nested)
    return [len(expected_calls(policy, [calls])) for calls in regions]


@dataclasses.dataclass(frozen=True)
class KnownDefect:
    """A defect outside the tests: the cases it fails, and how (docs/limits.md names it)."""

    applies: Callable[[Case, str, str], bool]  # (case, engine, device)
    reason: str


# Delete an entry when its fix lands: the strict xfail then fails every case it covered.
KNOWN_DEFECTS: dict[str, KnownDefect] = {}


def known_defect(case: Case, engine: str, device: str = "cpu") -> KnownDefect | None:
    return next((defect for defect in KNOWN_DEFECTS.values() if defect.applies(case, engine, device)), None)


# --- running a case --------------------------------------------------------------------------------


def _checkpointed(block: Block, policy: Policy, nested: bool) -> Block:
    if not nested:
        return sac_plugin.apply_selective_checkpointing(block, policy)
    for part in (block.attn, block.mlp):
        sac_plugin.apply_selective_checkpointing(part, policy)
    # The block around its checkpointed parts is checkpointed as torch's checkpoint nests them
    # (the plugin's apply refuses a module around checkpointed ones: NOTE: [A module is
    # checkpointed once]), with the same policy, its inputs held by its region where it says so.
    context_fn = sac_plugin.context_fn(policy)
    forward = type(block).forward.__get__(block)
    block.forward = lambda x: checkpoint_call(
        forward, (x,), {}, context_fn=context_fn, offload_inputs=policy.offload_inputs
    )
    return block


def _autocast(case: Case, device: str, phase: str):
    on = {"forward": ("forward",), "forward_and_backward": ("forward", "backward"), "one_context": ("step",)}
    if phase not in on.get(case.autocast, ()):
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def _step(model, x, case: Case, device: str):
    """One forward and backward (two with retain_graph) from seed 1; returns the loss and the
    gradients of the input and every parameter, and clears them."""
    leaf = x.detach().requires_grad_()
    torch.manual_seed(1)
    with _autocast(case, device, "step"):
        with _autocast(case, device, "forward"):
            out = model(leaf.clone())  # a non-leaf input, as a layer of a stack gets: offload_inputs holds it
        loss = out.float().square().sum()
        with _autocast(case, device, "backward"):
            if case.retain_graph:
                loss.backward(retain_graph=True)
            loss.backward()
    grads = [leaf.grad, *(p.grad for p in model.parameters())]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _differences(got, expected) -> list[str]:
    (loss, grads), (expected_loss, expected_grads) = got, expected
    found = [] if torch.equal(loss, expected_loss) else ["loss"]
    names = ["input"] + [f"param{i}" for i in range(len(grads) - 1)]
    for name, g, e in zip(names, grads, expected_grads):
        if (g is None) != (e is None) or (g is not None and not torch.equal(g, e)):
            found.append(name)
    return found


def observe(case: Case, device: str = "cpu") -> dict:
    """Runs `case` twice checkpointed (the first step audited, the second on the hot path the
    first step's site settles on) and once unmodified; returns what the checks compare, as plain
    values (a subprocess reports them as JSON)."""
    policy = case.policy()
    calls = region_calls(case.regions, case.autocast != "none", case.nested)
    expected = expected_calls(policy, calls)
    backwards = 2 if case.retain_graph else 1
    itemsize = 2 if case.autocast != "none" else 4
    torch.manual_seed(0)
    block = Block(case.regions, case.dropout)
    # Copied on the CPU: a deep copy of a buffer on the test accelerator is refused by its storage.
    reference = copy.deepcopy(block).to(device)
    block = block.to(device)
    model = _checkpointed(block, policy, case.nested)
    x = torch.randn(BATCH, DIM, device=device)
    want = _step(reference, x, case, device)
    gc.collect()  # regions an earlier test's failed backward left to the collector (docs/limits.md)
    live_before = sac_plugin._C.live_regions()
    native = sac_plugin.engine() == "native"
    held_after_forward = []

    def note_held(module, args, output):
        """What the regions hold when the block's forward returns (the native engine's regions
        hold the kept outputs; the dispatch-mode engine's are kept in torch's SAC cache)."""
        if native:
            held_after_forward.append(sum(r.kept_bytes for r in regions) + sum(r.offloaded_bytes for r in regions))

    hook = model.register_forward_hook(note_held)
    copied_before = sac_plugin.memory.offload_stats()["bytes_to_host"]
    with (
        warnings.catch_warnings(record=True) as caught,
        observed_regions() as regions,
        sac_plugin.audit() as audit,
        sac_plugin.report(model) as report,
    ):
        warnings.simplefilter("always")
        first = _step(model, x, case, device)
    hook.remove()
    bytes_to_host = sac_plugin.memory.offload_stats()["bytes_to_host"] - copied_before
    held_after_backward = [(r.kept_calls, r.kept_bytes, r.offloaded_bytes) for r in regions] if native else []
    # Emptied, not deleted: observed_regions's observer (a class, freed by the cycle collector
    # only) holds the list, and the regions in it would outlive the steps.
    regions.clear()
    with warnings.catch_warnings(record=True) as caught_later:
        warnings.simplefilter("always")
        second = _step(model, x, case, device)
    caught += caught_later
    hits = {op: audit.hits(op) for op in sorted({call.op for call, _ in expected} | {"aten::addmm"})}
    expected_hits = {op: 0 for op in hits}
    for call, _ in expected:
        expected_hits[call.op] += backwards
    return {
        # Two forwards of the checkpointed block, one of the unmodified one, on the same input and
        # weights: the counter must have counted exactly twice the unmodified one's.
        "load_counted": torch.equal(model.mlp.load, 2 * reference.mlp.load),
        "differs_first_step": _differences(first, want),
        "differs_second_step": _differences(second, want),
        "hits": hits,
        "expected_hits": expected_hits,
        "all_hits": sum(row.hits for row in audit.rows()),
        "expected_all_hits": backwards * len(expected),
        "never_served": [
            (row.op, row.never_served, row.never_served_bytes) for row in audit.rows() if row.never_served
        ],
        "never_served_warnings": [
            str(w.message) for w in caught if issubclass(w.category, sac_plugin.HeldNeverServedWarning)
        ],
        "held_after_forward": held_after_forward,
        "expected_held": [sum(call.elements * itemsize for call, _ in expected)] if native else [],
        # The report's per-layer count of the calls held and their bytes (the native engine's; a
        # nested block's inner layers are counted at each of their forwards, the outer recompute's too).
        "report_held": (
            [sum(layer.kept_calls for layer in report.layers.values())]
            + [sum(layer.kept_bytes + layer.offloaded_bytes for layer in report.layers.values())]
            if native and not case.nested
            else None
        ),
        "expected_report_held": (
            [len(expected), sum(call.elements * itemsize for call, _ in expected)]
            if native and not case.nested
            else None
        ),
        "held_after_backward": [entry for entry in held_after_backward if entry != (0, 0, 0)],
        "regions_left": sac_plugin._C.live_regions() - live_before,
        # Off the CPU, offloaded outputs and the flat block's input (offload_inputs) go to the host.
        "bytes_to_host": bytes_to_host if not case.nested else None,
        "expected_bytes_to_host": (
            sum(call.elements * itemsize for call, outcome in expected if outcome == OFFLOAD)
            + (BATCH * DIM * 4 if case.offload_inputs else 0)
            if device != "cpu" and not case.nested
            else 0
            if not case.nested
            else None
        ),
        "offload_pool_in_use": sac_plugin.memory.offload_stats()["pool_bytes_in_use"],
    }


def observe_many(cases: list[tuple], device: str, planned: dict[str, list[int]]) -> dict[str, dict]:
    """observe() for each case (given as dataclasses.astuple of a Case), by case id, with the plan
    the calling process made (`planned_calls()`: the cases it expects to fail were chosen by it); a
    case that raises reports {"raised": message}."""
    _planned["calls"] = planned
    observed = {}
    for values in cases:
        case = Case(*values)
        try:
            observed[case.id] = observe(case, device)
        except Exception as error:  # noqa: BLE001 - reported, and failed, by the test of the case
            observed[case.id] = {"raised": f"{type(error).__name__}: {error}"}
    return observed


def failures(observed: dict) -> list[str]:
    """What a case's observations break, one line each (empty: the case passes)."""
    if "raised" in observed:
        return [f"raised {observed['raised']}"]
    found = [] if observed["load_counted"] else ["the load counter did not count each forward once"]
    for step in ("first", "second"):
        if observed[f"differs_{step}_step"]:
            found.append(f"{step} step: not bitwise the unmodified block's: {observed[f'differs_{step}_step']}")
    if observed["hits"] != observed["expected_hits"]:
        found.append(f"hits {observed['hits']}, the rule keeps {observed['expected_hits']}")
    if observed["all_hits"] != observed["expected_all_hits"]:
        found.append(f"{observed['all_hits']} hits in all, the rule keeps {observed['expected_all_hits']}")
    if observed["never_served"] or observed["never_served_warnings"]:
        found.append(f"held and never served: {observed['never_served']} {observed['never_served_warnings']}")
    if observed["held_after_forward"] != observed["expected_held"]:
        found.append(
            f"held {observed['held_after_forward']} bytes after the forward, expected {observed['expected_held']}"
        )
    if observed["report_held"] != observed["expected_report_held"]:
        found.append(
            f"the report says {observed['report_held']} calls and bytes held, expected {observed['expected_report_held']}"
        )
    if observed["held_after_backward"]:
        found.append(f"held after the backward (calls, bytes, offloaded bytes): {observed['held_after_backward']}")
    if observed["regions_left"]:
        found.append(f"{observed['regions_left']} regions alive after the steps")
    if observed["bytes_to_host"] != observed["expected_bytes_to_host"]:
        found.append(
            f"{observed['bytes_to_host']} bytes copied to the host, expected {observed['expected_bytes_to_host']}"
        )
    if observed["offload_pool_in_use"]:
        found.append(f"{observed['offload_pool_in_use']} bytes of the offload pool in use after the steps")
    return found
