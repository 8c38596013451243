"""Offloaded inputs (NOTE: [Offloading a layer's inputs] in csrc/dispatch/offload.cpp): on the test
accelerator, a checkpointed stack's layer inputs leave the device between forward and backward,
measured by its allocator, and come back for the recompute with gradients bitwise equal to the
unmodified model; the region that holds them releases them with its outputs."""

import pickle
import warnings

import pytest
import torch

import sac_plugin
import sac_plugin.memory
from sac_plugin import Policy, RecomputeConfig
from sac_plugin._config_policy import policy_for
from sac_plugin.targets import KeptOps, RecomputeTargetMap, RecomputeUnit
from support.accelerator import SKIP_REASON, runner_with_models

# Four layers; each layer's input is 256 x 512 float32 (512 KiB), the activation the stack carries.
_on_accelerator = runner_with_models("offloaded_inputs")


def accelerator(test):
    return pytest.mark.slow(pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")(test))


engines = pytest.mark.parametrize("engine", ["native", "dispatch_mode"])


# (the policy, what it keeps or offloads besides the inputs): full recompute, selective, offloaded calls.
POLICIES = [
    ("", "Policy()"),
    ("kept_ops=['aten::addmm']", "kept"),
    ("offloaded_ops=['aten::addmm'], offload_min_bytes=0", "offloaded"),
]


@accelerator
@pytest.mark.parametrize("rules", [rules for rules, _ in POLICIES], ids=[name for _, name in POLICIES])
@engines
def test_the_inputs_leave_the_device_and_gradients_are_bitwise(engine, rules):
    comma = ", " if rules else ""
    values = _on_accelerator(
        f"""
reference, rx = model_and_input()
forward(reference, rx).backward()
plain, px = checkpointed(Policy({rules}))
plain_held = step(plain, px)
offloading, ox = checkpointed(Policy({rules}{comma}offload_inputs=True))
before = stats()
held = step(offloading, ox)
after = stats()
plain_before = stats()
step(plain, px)
plain_after = stats()
report(
    engine=sac_plugin.engine(),
    drop=plain_held - held,
    same_as_reference=same(gradients(reference, rx), gradients(offloading, ox)),
    bytes_to_host=(after["bytes_to_host"] - before["bytes_to_host"])
                  - (plain_after["bytes_to_host"] - plain_before["bytes_to_host"]),
    copies=[(after[k] - before[k]) - (plain_after[k] - plain_before[k]) for k in ("copies_to_host", "copies_to_device")],
    pool_in_use=after["pool_bytes_in_use"],
)
""",
        engine,
    )
    inputs = 4 * 256 * 512 * 4
    assert values == {
        "engine": engine,
        "drop": inputs,
        "same_as_reference": True,
        "bytes_to_host": inputs,
        "copies": [4, 4],
        "pool_in_use": 0,
    }


# Each selection, with the inputs offloaded: the recompute runs on the inputs brought back, which
# are named as the forward's (NOTE: [A copy the region makes is named as its original] in
# csrc/dispatch/data_flow.cpp), so every call the selection holds is served as without offload.
SELECTIONS = {
    "kept op": "kept_ops=['aten::addmm']",
    "offloaded op": "offloaded_ops=['aten::addmm'], offload_min_bytes=0",
    "every nth call": "every_nth_op={'aten::addmm': 2}",
    "kept call": "kept_calls={'aten::addmm': [1]}",
}


@accelerator
@pytest.mark.parametrize("selection", list(SELECTIONS.values()), ids=list(SELECTIONS))
@engines
def test_every_selection_is_served_with_the_inputs_offloaded_as_without(engine, selection):
    values = _on_accelerator(
        f"""
reference, rx = model_and_input()
forward(reference, rx).backward()
served = {{}}
for offload in (False, True):
    model, x = checkpointed(Policy({selection}, offload_inputs=offload))
    with sac_plugin.audit() as audit:
        step(model, x)
    served[str(offload)] = [audit.hits("aten::addmm"), same(gradients(reference, rx), gradients(model, x))]
report(engine=sac_plugin.engine(), served=served)
""",
        engine,
    )
    without = values["served"]["False"]
    assert without[0] > 0, "the selection holds nothing: the comparison proves nothing"
    assert values == {"engine": engine, "served": {"False": without, "True": without}}
    assert without[1] is True


@accelerator
@engines
def test_the_recompute_fetches_the_next_layers_input_ahead(engine):
    # Copies back the recompute of each layer has started when it begins: its own input and the
    # next layer's (the one the backward reaches next), so the last layer's finds two.
    values = _on_accelerator(
        """
seen = []
class Watched(Layer):
    def forward(self, x, scale=None):
        seen.append(stats()["copies_to_device"])
        return super().forward(x, scale)

torch.manual_seed(0)
model = torch.nn.Sequential(*[Watched() for _ in range(4)]).to("sac_accel")
x = torch.randn(256, 512, device="sac_accel", requires_grad=True)
for layer in model:
    sac_plugin.apply_selective_checkpointing(layer, Policy(offload_inputs=True))
start = stats()["copies_to_device"]
step(model, x)
report(recompute=[n - start for n in seen[4:]])
""",
        engine,
    )
    assert values == {"recompute": [2, 3, 4, 4]}


@accelerator
@engines
def test_retain_graph_keeps_the_host_copies_for_a_second_backward(engine):
    values = _on_accelerator(
        """
plain, px = checkpointed(Policy())
loss = forward(plain, px)
loss.backward(retain_graph=True)
loss.backward()
offloading, ox = checkpointed(Policy(offload_inputs=True))
before = stats()
loss = forward(offloading, ox)
loss.backward(retain_graph=True)
between = stats()
loss.backward()
after = stats()
report(same=same(gradients(plain, px), gradients(offloading, ox)),
       copies_back=[between["copies_to_device"] - before["copies_to_device"],
                    after["copies_to_device"] - between["copies_to_device"]],
       in_use=[between["pool_bytes_in_use"], after["pool_bytes_in_use"]])
""",
        engine,
    )
    # Held after the first backward, consumed by the second.
    assert values == {"same": True, "copies_back": [4, 4], "in_use": [4 * 256 * 512 * 4, 0]}


@accelerator
@engines
def test_a_dropped_forward_and_a_failed_backward_release_the_pinned_buffers(engine):
    values = _on_accelerator(
        """
# The copies out are still queued when the forward is dropped: what they read must not keep the
# graph, and with it the regions, alive.
sac_test_accelerator.set_copy_delay(0.05)
model, x = checkpointed(Policy(offload_inputs=True))
loss = forward(model, x)
held = stats()["pool_bytes_in_use"]
del loss
after_drop = stats()["pool_bytes_in_use"]
sac_test_accelerator.set_copy_delay(0)
torch.accelerator.synchronize()

class FailsInRecompute(Layer):
    fail = False
    def forward(self, x, scale=None):
        if self.fail:
            raise RuntimeError("the recompute failed")
        return super().forward(x, scale)

torch.manual_seed(0)
model = torch.nn.Sequential(*[FailsInRecompute() for _ in range(4)]).to("sac_accel")
for layer in model:
    sac_plugin.apply_selective_checkpointing(layer, Policy(offload_inputs=True))
loss = forward(model, x)
model[1].fail = True
try:
    loss.backward()
    message = None
except RuntimeError as error:
    message = str(error)
del loss
# The failed graph task is torn down on the accelerator's autograd thread: wait for it (bounded).
import time
for _ in range(500):
    if stats()["pool_bytes_in_use"] == 0:
        break
    time.sleep(0.01)
report(held=held, after_drop=after_drop, message=message, after_failure=stats()["pool_bytes_in_use"])
""",
        engine,
    )
    assert values == {"held": 4 * 256 * 512 * 4, "after_drop": 0, "message": "the recompute failed", "after_failure": 0}


@accelerator
@engines
def test_an_input_written_after_the_forward_is_named(engine):
    values = _on_accelerator(
        """
model, x = checkpointed(Policy(offload_inputs=True))
h = x * 2
loss = model(h).square().mean()
with torch.no_grad():
    h.add_(1)
try:
    loss.backward()
    message = None
except RuntimeError as error:
    message = str(error).splitlines()[0]
del loss
report(message=message, in_use=stats()["pool_bytes_in_use"])
""",
        engine,
    )
    assert values == {
        "message": "sac: an input of a checkpointed region was mutated after its forward: positional argument 0 of "
        "Layer.forward (offloaded for the recompute) changed version from 0 to 1. The recompute would "
        "read the mutated value; clone it before mutating it in place",
        "in_use": 0,
    }


@accelerator
def test_past_the_host_memory_limit_the_inputs_stay_on_the_device():
    values = _on_accelerator("""
import warnings
plain, px = checkpointed(Policy())
plain_held = step(plain, px)
# Room for two of the four inputs (512 KiB each, a size class of its own).
offloading, ox = checkpointed(Policy(offload_inputs=True, host_memory_limit=2 * INPUT_BYTES))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    held = step(offloading, ox)
report(drop=plain_held - held, same=same(gradients(plain, px), gradients(offloading, ox)),
       warnings=[str(w.message).split(":")[1].strip() for w in caught if "host_memory_limit" in str(w.message)],
       pool=stats()["pool_bytes"])
""")
    assert values == {
        "drop": 2 * 256 * 512 * 4,
        "same": True,
        "pool": 2 * 256 * 512 * 4,
        # said once per checkpoint site: by the two layers whose inputs did not fit
        "warnings": ["the policy's host_memory_limit of 1048576 bytes is reached"] * 2,
    }


@accelerator
@engines
def test_an_input_that_is_not_dense_is_named_and_a_row_slice_is_offloaded(engine):
    # An expanded view cannot be offloaded: it is named once per checkpoint site, and stays on the
    # device. A slice of rows (a storage offset, dense) is offloaded. Gradients are the model's.
    values = _on_accelerator(
        """
import warnings
expanded = lambda x: (x[:1] * 2).expand(256, 512)
rows = lambda x: (x * 2)[128:]
def run(model, x, make):
    torch.manual_seed(1)
    model(make(x)).square().mean().backward()
    torch.accelerator.synchronize()
result = {}
for what, make in (("expanded", expanded), ("rows", rows)):
    reference, rx = model_and_input(layers=1)
    run(reference, rx, make)
    model, x = checkpointed(Policy(offload_inputs=True), layers=1)
    before = stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, x, make)
        same_gradients = same(gradients(reference, rx), gradients(model, x))
        run(model, x, make)
    result[what] = dict(
        same=same_gradients,
        bytes_to_host=stats()["bytes_to_host"] - before["bytes_to_host"],
        warnings=[str(w.message) for w in caught if "offload_inputs" in str(w.message)],
    )
report(**result)
""",
        engine,
    )
    assert values == {
        "expanded": {
            "same": True,
            "bytes_to_host": 0,
            "warnings": [
                "sac_plugin: Policy(offload_inputs=True) cannot offload positional argument 0 of Layer.forward, of "
                "shape (256, 512) and strides (0, 1): it is not dense (an expanded or overlapping view, or one with "
                "gaps between its elements), and the offload copies only dense tensors; it stays on the device, as "
                "torch's checkpoint holds it: pass x.contiguous() to offload it (said once per checkpoint site)"
            ],
        },
        "rows": {"same": True, "bytes_to_host": 2 * 128 * 512 * 4, "warnings": []},
    }


def test_on_the_cpu_an_input_that_is_not_dense_is_not_named():
    # On the CPU offload_inputs does nothing, whatever the input: nothing to name.
    layer = sac_plugin.apply_selective_checkpointing(_Layer(), Policy(offload_inputs=True))
    x = torch.randn(1, 16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer((x * 2).expand(8, 16)).sum().backward()


@accelerator
@engines
def test_nested_checkpoints_offload_their_inputs_with_gradients_bitwise(engine):
    # A checkpoint called around checkpointed layers, offload_inputs on either or both: the block's
    # recompute runs the layers' checkpoints again on the inputs the block held, which they hold as
    # in the forward. The block calls the checkpoint itself, as torch nests checkpoints (sac_plugin
    # refuses to checkpoint a module around checkpointed ones: NOTE: [A module is checkpointed once]).
    values = _on_accelerator(
        """
from sac_plugin._forwards import checkpoint_call

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(Layer(), Layer())
        self.policy = None

    def forward(self, x):
        if self.policy is None:
            return self.inner(x)
        return checkpoint_call(
            self.inner, (x,), {}, context_fn=self.context_fn, offload_inputs=self.policy.offload_inputs
        )

def build(block_policy, layer_policy):
    torch.manual_seed(0)
    block = Block().to("sac_accel")
    if layer_policy is not None:
        for layer in block.inner:
            sac_plugin.apply_selective_checkpointing(layer, layer_policy)
    if block_policy is not None:
        block.policy, block.context_fn = block_policy, sac_plugin.context_fn(block_policy)
    return block, torch.randn(256, 512, device="sac_accel", requires_grad=True)

reference, rx = build(None, None)
forward(reference, rx).backward()
offload, plain = Policy(offload_inputs=True), Policy()
result = []
for block_policy, layer_policy in ((offload, offload), (offload, plain), (plain, offload),
                                   (Policy(kept_ops=["aten::addmm"], offload_inputs=True), offload)):
    block, x = build(block_policy, layer_policy)
    forward(block, x).backward()
    torch.accelerator.synchronize()
    result.append(same(gradients(reference, rx), gradients(block, x)))
report(same=result, pool_in_use=stats()["pool_bytes_in_use"])
""",
        engine,
    )
    assert values == {"same": [True] * 4, "pool_in_use": 0}


# --- the option itself, and where it is a no-op ----------------------------------------------------


def test_a_bad_offload_inputs_value_is_refused():
    with pytest.raises(TypeError) as error:
        Policy(offload_inputs="yes")
    assert str(error.value) == "sac_plugin: offload_inputs must be True or False, got 'yes' (str)"


def test_offload_inputs_is_part_of_the_policy_value():
    policy = Policy(kept_ops=["aten::mm"], offload_inputs=True)
    assert policy.offload_inputs and not Policy().offload_inputs
    assert repr(policy) == "Policy(kept_ops=['aten::mm'], kept_units=[], offload_inputs=True)"
    assert policy != Policy(kept_ops=["aten::mm"]) and hash(policy) != hash(Policy(kept_ops=["aten::mm"]))
    assert pickle.loads(pickle.dumps(policy)) == policy and pickle.loads(pickle.dumps(policy)).offload_inputs


def test_a_config_file_round_trips_offload_inputs(tmp_path):
    config = RecomputeConfig(kept_units=["attn"], offload_inputs=True)
    for suffix in (".json", ".yaml"):
        path = tmp_path / f"config{suffix}"
        config.save(path)
        assert ("offload_inputs: true" if suffix == ".yaml" else '"offload_inputs": true') in path.read_text()
        assert RecomputeConfig.load(path) == config
    target_map = RecomputeTargetMap("toy", {RecomputeUnit.ATTN: KeptOps(["aten::bmm"])})
    assert policy_for(config, target_map).offload_inputs
    assert not policy_for(RecomputeConfig(kept_units=["attn"]), target_map).offload_inputs


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _cpu_gradients(policy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Layer() for _ in range(3)])
    if policy is not None:
        for layer in model:
            sac_plugin.apply_selective_checkpointing(layer, policy)
    x = torch.randn(8, 16, requires_grad=True)
    model(x * 2).square().mean().backward()
    return [p.grad for p in model.parameters()] + [x.grad]


@pytest.mark.parametrize("policy", [Policy(offload_inputs=True), Policy(kept_ops=["aten::addmm"], offload_inputs=True)])
def test_on_the_cpu_offloading_inputs_is_a_no_op(policy):
    reference = _cpu_gradients(None)
    before = sac_plugin.memory.offload_stats()
    gradients = _cpu_gradients(policy)
    after = sac_plugin.memory.offload_stats()
    assert all(torch.equal(a, b) for a, b in zip(reference, gradients))
    assert after["copies_to_host"] == before["copies_to_host"]


def test_torch_compile_is_refused():
    torch.manual_seed(0)
    layer = sac_plugin.apply_selective_checkpointing(_Layer(), Policy(offload_inputs=True))
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(Exception) as error:
        compiled(x * 2)
    assert "sac_plugin: Policy(offload_inputs=True) does not work under torch.compile" in str(error.value)
