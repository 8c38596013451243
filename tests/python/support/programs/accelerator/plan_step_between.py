"""A four-layer Llama on the test accelerator, planned for a peak between full recompute's and no
checkpointing's: reports the peaks, the plan, the gradients, the plan file's round trip, a budget
below full recompute, a config with peak_bytes and the plan command."""

import contextlib
import gc
import io
import tempfile
import warnings

import sac_test_accelerator  # noqa: F401 - registers the device before any backward
import torch
from support.programs.report import report

warnings.simplefilter("ignore")
import sac_plugin  # noqa: E402 - its warnings are ignored too
from sac_plugin import PlanError, RecomputeConfig, StepPlan  # noqa: E402
from sac_plugin.__main__ import main  # noqa: E402
from sac_plugin.models import Llama  # noqa: E402

DEVICE = "sac_accel"


def build():
    torch.manual_seed(0)
    return Llama(vocab=128, dim=64, heads=4, layers=4, seq=64).to(DEVICE)


torch.manual_seed(1)
tokens = torch.randint(0, 128, (4, 64), device=DEVICE)
targets = torch.randint(0, 128, (4, 64), device=DEVICE)
model, reference = build(), build()


def step_of(m):
    return lambda: m.loss(tokens, targets).backward()


def peak_of(m, checkpointed, policy=None):
    if checkpointed:
        for layer in m.layers:
            sac_plugin.apply_selective_checkpointing(layer, policy)
    torch.accelerator.synchronize()
    torch.accelerator.reset_peak_memory_stats()
    step_of(m)()
    torch.accelerator.synchronize()
    peak = torch.accelerator.max_memory_allocated()
    m.zero_grad(set_to_none=True)
    if checkpointed:
        for layer in m.layers:
            sac_plugin.remove_checkpointing(layer)
    return peak


def unchanged(m):
    return not any("forward" in x.__dict__ or "_sac_policy" in x.__dict__ for x in m.modules())


full_recompute, none = peak_of(model, True), peak_of(model, False)
values = {"engine": sac_plugin.engine(), "full_recompute": full_recompute, "none": none}

budget = (full_recompute + none) // 2
plan = sac_plugin.plan_step(model, step_of(model), peak_bytes=budget, runs=1)
step_of(model)()
step_of(reference)()
pairs = list(zip(model.named_parameters(), reference.named_parameters()))
values["unequal_grads"] = [n for (n, a), (_, b) in pairs if not torch.equal(a.grad.cpu(), b.grad.cpu())]
model.zero_grad(set_to_none=True)
reference.zero_grad(set_to_none=True)
values.update(
    budget=budget,
    predicted=plan.predicted_peak,
    measured=plan.measured_peak,
    profiled=plan.full_recompute_peak,
    remeasured=peak_of(model, False),
    kept_calls=[len(c.plan.kept) for c in plan.layers],
    names=[c.name for c in plan.layers],
    checkpointed=[layer._sac_policy == plan.policies[f"layers.{i}"] for i, layer in enumerate(model.layers)],
    first_line=plan.table().splitlines()[0],
)
loaded = StepPlan.load(plan.save(tempfile.mkdtemp() + "/step.json"))
fresh = build()
loaded.apply(fresh)
values["loaded_same"] = loaded.to_dict() == plan.to_dict()
values["fresh_policies"] = [layer._sac_policy == plan.policies[f"layers.{i}"] for i, layer in enumerate(fresh.layers)]
del fresh  # every step below runs beside the same models as the budget was measured beside
gc.collect()  # a checkpointed layer and its forward refer to each other
for layer in model.layers:
    sac_plugin.remove_checkpointing(layer)

try:
    sac_plugin.plan_step(model, step_of(model), peak_bytes=full_recompute - 1, runs=1)
except PlanError as error:
    values["below"] = str(error)
values["unchanged_after_error"] = unchanged(model)

sac_plugin.apply_recompute_config(model, RecomputeConfig(peak_bytes=budget), step=step_of(model))
values["config_policies"] = ["_sac_policy" in layer.__dict__ for layer in model.layers]
values["config_kept"] = sum(bool(layer._sac_policy.kept_calls) for layer in model.layers)
values["config_peak"] = peak_of(model, False)

out = io.StringIO()
with contextlib.redirect_stdout(out):
    saved = tempfile.mkdtemp() + "/cli.json"
    main(
        [
            "plan",
            "--model",
            "llama",
            "--peak",
            "1GiB",
            "--device",
            DEVICE,
            "--layers",
            "2",
            "--dim",
            "32",
            "--seq",
            "16",
            "--runs",
            "1",
            "--save",
            saved,
        ]
    )
values["cli"] = out.getvalue().splitlines()[:2]
values["cli_saved"] = [c.name for c in StepPlan.load(saved).layers]
report(**values)
