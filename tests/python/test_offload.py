"""Offloaded calls (NOTE: [Offloading kept outputs] in csrc/dispatch/offload.cpp): on the test
accelerator, their outputs leave the device between forward and backward, measured by its
allocator, and come back for the recompute with gradients bitwise equal to keeping them; writes
are caught as for kept outputs; on the CPU offloading is keeping, said once."""

import pickle
import warnings

import pytest
import torch

import sac_plugin
from sac_plugin import Policy, RecomputeConfig
from sac_plugin.config import ConfigError
from support.accelerator import SKIP_REASON, accelerator_environment, runner_with_models

# Two layers whose first projection makes 1 MiB (offloaded) and second 512 KiB (under the floor).
_on_accelerator = runner_with_models("offloaded_outputs")


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
@pytest.mark.parametrize("engine", ["native", "dispatch_mode"])
@pytest.mark.parametrize("copy_delay", [0.0, 0.02])
def test_offloaded_bytes_leave_the_device_and_gradients_are_bitwise(engine, copy_delay):
    values = _on_accelerator(
        f"""
sac_test_accelerator.set_copy_delay({copy_delay})
reference, rx = model_and_input()
reference(rx).square().mean().backward()

kept, kx = checkpointed(Policy(kept_ops=["aten::addmm"]))
with sac_plugin.audit() as kept_audit:
    kept_held = step(kept, kx)
offloaded, ox = checkpointed(Policy(offloaded_ops=["aten::addmm"]))
before = stats()
with sac_plugin.audit() as offload_audit:
    offload_held = step(offloaded, ox)
after = stats()
report(
    engine=sac_plugin.engine(),
    drop=kept_held - offload_held,
    bytes_to_host=after["bytes_to_host"] - before["bytes_to_host"],
    copies_to_host=after["copies_to_host"] - before["copies_to_host"],
    copies_to_device=after["copies_to_device"] - before["copies_to_device"],
    pool_in_use=after["pool_bytes_in_use"],
    same_as_kept=all(torch.equal(a, b) for a, b in zip(gradients(kept, kx), gradients(offloaded, ox))),
    same_as_reference=all(torch.equal(a, b) for a, b in zip(gradients(reference, rx), gradients(offloaded, ox))),
    hits=[kept_audit.hits("aten::addmm"), offload_audit.hits("aten::addmm")],
    recomputed=[kept_audit.count("aten::addmm", phase="recompute"),
                offload_audit.count("aten::addmm", phase="recompute")],
)
""",
        engine,
    )
    one_output = 256 * 1024 * 4  # each layer's up projection; the down projection (512 KiB) stays kept
    assert values == {
        "engine": engine,
        "drop": 2 * one_output,
        "bytes_to_host": 2 * one_output,
        "copies_to_host": 2,
        "copies_to_device": 2,
        "pool_in_use": 0,
        "same_as_kept": True,
        "same_as_reference": True,
        "hits": [4, 4],
        "recomputed": [0, 0],
    }


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_steps_reuse_the_pinned_pool_and_every_offloaded_output_comes_back_once():
    values = _on_accelerator("""
model, x = checkpointed(Policy(offloaded_ops=["aten::addmm"]))
step(model, x)
first = stats()
for _ in range(3):
    x.grad = None
    step(model, x)
last = stats()
report(new_allocations=last["pool_allocations"] - first["pool_allocations"],
       copies=[last["copies_to_host"] - first["copies_to_host"], last["copies_to_device"] - first["copies_to_device"]],
       pool_in_use=last["pool_bytes_in_use"], pinned_pool=last["pool_bytes"] >= 2 * 256 * 1024 * 4)
""")
    assert values == {"new_allocations": 0, "copies": [6, 6], "pool_in_use": 0, "pinned_pool": True}


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_a_write_after_the_forward_raises_naming_the_op():
    values = _on_accelerator("""
class Exposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(512, 1024)

    def forward(self, x):
        h = self.up(x)
        return h, torch.tanh(h)

torch.manual_seed(0)
layer = Exposed().to("sac_accel")
sac_plugin.apply_selective_checkpointing(layer, Policy(offloaded_ops=["aten::addmm"]))
x = torch.randn(256, 512, device="sac_accel", requires_grad=True)
h, y = layer(x)
with torch.no_grad():
    h.mul_(2)
try:
    y.sum().backward()
    message = None
except RuntimeError as error:
    message = str(error).splitlines()[0]
report(message=message, pool_in_use=stats()["pool_bytes_in_use"])
""")
    assert values["message"] == (
        "sac: a tensor kept for backward was mutated after it was saved: the output of aten::addmm (offloaded by the "
        "op list), call 1 of this region, changed version from 0 to 1. The recompute would read the mutated value; "
        "clone it before mutating in place, or do not keep aten::addmm"
    )


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_a_write_in_the_forward_waits_for_the_copy_out_and_the_value_before_it_is_served():
    # The copy out is slowed: a write that did not wait for it would reach the host copy, and the
    # recompute, applying the write again, would double it.
    values = _on_accelerator("""
sac_test_accelerator.set_copy_delay(0.02)

class Writes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(512, 1024)

    def forward(self, x):
        h = self.up(x)
        h.mul_(2)
        return torch.tanh(h)

def run(policy, backwards):
    torch.manual_seed(0)
    layer = Writes().to("sac_accel")
    if policy is not None:
        sac_plugin.apply_selective_checkpointing(layer, policy)
    x = torch.randn(256, 512, device="sac_accel", requires_grad=True)
    with sac_plugin.audit() as audit:
        loss = layer(x).sum()
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
    torch.accelerator.synchronize()
    return [p.grad.cpu() for p in layer.parameters()] + [x.grad.cpu()], audit

reference, _ = run(None, 1)
offloaded, audit = run(Policy(offloaded_ops=["aten::addmm"]), 1)
twice, twice_audit = run(Policy(offloaded_ops=["aten::addmm"]), 2)
report(same=all(torch.equal(a, b) for a, b in zip(reference, offloaded)), hits=audit.hits("aten::addmm"),
       recomputed=audit.count("aten::addmm", phase="recompute"),
       same_twice=all(torch.equal(2 * a, b) for a, b in zip(reference, twice)),
       hits_twice=twice_audit.hits("aten::addmm"), pool_in_use=stats()["pool_bytes_in_use"])
""")
    assert values == {"same": True, "hits": 1, "recomputed": 0, "same_twice": True, "hits_twice": 2, "pool_in_use": 0}


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_a_routing_call_an_offload_rule_names_is_offloaded_and_served():
    # Routing is held whatever the policy (NOTE: [Routing is served from the forward]); an offload
    # rule that names the call says where: on the host.
    values = _on_accelerator("""
class Sorting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(512, 1024)

    def forward(self, x):
        values, order = torch.sort(self.up(x), dim=-1)
        return values[:, :512] * 2 + x

def run(policy):
    torch.manual_seed(0)
    layer = Sorting().to("sac_accel")
    x = torch.randn(256, 512, device="sac_accel", requires_grad=True)
    if policy is not None:
        sac_plugin.apply_selective_checkpointing(layer, policy)
    before = stats()
    with sac_plugin.audit() as audit:
        step(layer, x)
    after = stats()
    return [p.grad.cpu() for p in layer.parameters()] + [x.grad.cpu()], audit.hits("aten::sort"), (
        after["copies_to_host"] - before["copies_to_host"])

reference, _, _ = run(None)
by_op, hits_by_op, copies_by_op = run(Policy(offloaded_ops=["aten::sort"]))
kept, hits_kept, copies_kept = run(Policy(kept_ops=["aten::addmm"]))
report(bitwise=[all(torch.equal(a, b) for a, b in zip(got, reference)) for got in (by_op, kept)],
       hits=[hits_by_op, hits_kept], copies=[copies_by_op, copies_kept])
""")
    # sort's values (1 MiB) and indices (2 MiB) go to the host; kept by routing alone, they stay.
    assert values == {"bitwise": [True, True], "hits": [1, 1], "copies": [2, 0]}


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_the_floor_and_the_host_limit_keep_on_the_device():
    values = _on_accelerator("""
import warnings
warnings.simplefilter("always")
one_output = 256 * 1024 * 4
model, x = checkpointed(Policy(offloaded_ops=["aten::addmm"], host_memory_limit=one_output))
with warnings.catch_warnings(record=True) as caught:
    before = stats()
    step(model, x)
    after = stats()
floor_model, fx = checkpointed(Policy(offloaded_ops=["aten::addmm"], offload_min_bytes=one_output + 1))
floor_before = stats()
step(floor_model, fx)
floor_after = stats()
report(copies=after["copies_to_host"] - before["copies_to_host"],
       floor_copies=floor_after["copies_to_host"] - floor_before["copies_to_host"],
       messages=[str(w.message) for w in caught if "host_memory_limit" in str(w.message)])
""")
    assert values == {
        "copies": 1,
        "floor_copies": 0,
        "messages": [
            "sac: the policy's host_memory_limit of 1048576 bytes is reached: the offload pool cannot hold the outputs of "
            "aten::addmm as well, so they and later offloaded outputs that do not fit are kept on the device (said once "
            "per checkpoint site)"
        ],
    }


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_retain_graph_serves_the_offloaded_outputs_to_a_second_backward():
    values = _on_accelerator("""
model, x = checkpointed(Policy(offloaded_ops=["aten::addmm"]))
loss = model(x).square().mean()
loss.backward(retain_graph=True)
first = gradients(model, x)
for p in list(model.parameters()) + [x]:
    p.grad = None
loss.backward()
torch.accelerator.synchronize()
report(same=all(torch.equal(a, b) for a, b in zip(first, gradients(model, x))),
       pool_in_use=stats()["pool_bytes_in_use"])
""")
    assert values == {"same": True, "pool_in_use": 0}


def _cpu_layer():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))


def test_on_the_cpu_offloading_is_keeping_said_once():
    reference = _cpu_layer()
    x = torch.randn(8, 64, requires_grad=True)
    reference(x).sum().backward()
    expected = [p.grad for p in reference.parameters()] + [x.grad]

    model = _cpu_layer()
    policy = Policy(offloaded_ops=["aten::addmm"], offload_min_bytes=0)
    sac_plugin.apply_selective_checkpointing(model, policy)
    x.grad = None
    with warnings.catch_warnings(record=True) as caught, sac_plugin.audit() as audit:
        warnings.simplefilter("always")
        for _ in range(2):
            model(x).sum().backward()
    messages = [str(w.message) for w in caught if "offloaded by the policy" in str(w.message)]
    assert messages == [
        "sac: aten::addmm is offloaded by the policy but runs on the CPU, so its outputs are kept "
        "where they are, in host memory already; offloading moves outputs off an accelerator (said "
        "once per checkpoint site)"
    ]
    # The second projection runs after the last save, where the recompute stops: one hit per step.
    assert audit.hits("aten::addmm") == 2
    assert all(torch.equal(a.grad / 2, b) for a, b in zip(list(model.parameters()) + [x], expected))


def test_policy_offload_fields_round_trip():
    policy = Policy(
        kept_calls={"aten::mm.default": [0]},
        offloaded_calls={"aten::mm.default": [1, 1, 3]},
        offloaded_ops=["aten::bmm.default"],
        offloaded_units=["attn"],
        offload_min_bytes=4096,
        host_memory_limit=1 << 30,
    )
    assert policy.offloaded_calls == {"aten::mm": (1, 3)}
    assert policy.offloaded_ops == frozenset({"aten::bmm"})
    assert policy.offloaded_units == frozenset({"attn"})
    assert (policy.offload_min_bytes, policy.host_memory_limit) == (4096, 1 << 30)
    assert not policy.keeps_nothing and not policy.offloads_nothing
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert policy != Policy(
        kept_calls={"aten::mm.default": [0]},
        offloaded_calls={"aten::mm.default": [1, 3]},
        offloaded_ops=["aten::bmm.default"],
        offloaded_units=["attn"],
        offload_min_bytes=4096,
    )
    assert repr(policy) == (
        "Policy(kept_ops=[], kept_units=[], kept_calls={'aten::mm.default': [0]}, "
        "offloaded_ops=['aten::bmm.default'], offloaded_units=['attn'], "
        "offloaded_calls={'aten::mm.default': [1, 3]}, offload_min_bytes=4096, "
        "host_memory_limit=1073741824)"
    )


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (
            {"offload_min_bytes": "1MiB"},
            TypeError,
            "sac_plugin: offload_min_bytes is a byte count, an int from 0 to 2**63 - 1; got '1MiB' (str)",
        ),
        (
            {"host_memory_limit": -1},
            ValueError,
            "sac_plugin: host_memory_limit is a byte count, an int from 0 to 2**63 - 1, or None for no limit; got -1 (int)",
        ),
        (
            {"offloaded_ops": "aten::mm"},
            TypeError,
            "sac_plugin: offloaded_ops must be a collection of names, not a single str: 'aten::mm'; write ['aten::mm']",
        ),
        (
            {"offloaded_calls": {"aten::mm": [-1]}},
            ValueError,
            "sac_plugin: offloaded_calls['aten::mm']: a call index is an int from 0 to 2**63 - 1 (0 is the op's first call "
            "in the region), got -1 (int)",
        ),
        (
            {"offloaded_ops": ["aten::add_.Tensor"]},
            ValueError,
            "sac: offloaded_ops: 'aten::add_.Tensor' names aten::add_.Tensor, which mutates an input; only functional (or "
            "out=) ops can be kept, because the recompute must apply the mutation again",
        ),
    ],
)
def test_bad_offload_arguments_are_named(arguments, error, message):
    with pytest.raises(error) as raised:
        Policy(**arguments)
    assert str(raised.value).splitlines()[0] == message


def test_recompute_config_offloads_units_and_ops():
    from sac_plugin._config_policy import policy_for
    from sac_plugin.models import LLAMA_TARGETS

    config = RecomputeConfig.from_dict(
        {
            "kept_units": ["mlp"],
            "offloaded_units": ["attn"],
            "offloaded_ops": ["aten::bmm"],
            "host_memory_limit": 1 << 20,
        }
    )
    assert RecomputeConfig.from_json(config.to_json()) == config
    policy = policy_for(config, LLAMA_TARGETS)
    assert "aten::bmm" in policy.offloaded_ops
    assert policy.host_memory_limit == 1 << 20
    assert (policy.offloaded_units | policy.kept_units | policy.offloaded_ops) != frozenset()
    with pytest.raises(ConfigError) as raised:
        RecomputeConfig(kept_units=["attn"], offloaded_units=["attn"])
    assert str(raised.value) == (
        "recompute config: kept_units and offloaded_units both list ['attn']; a unit is kept or offloaded, not both"
    )
    with pytest.raises(ConfigError) as raised:
        RecomputeConfig(budget=0.5, offloaded_ops=["aten::mm"])
    assert str(raised.value) == (
        "recompute config: budget chooses what to keep by measurement; leave offloaded_ops "
        "unset (or drop budget to choose by hand)"
    )


def test_torch_policy_fn_tags_offloaded_calls_must_save_outside_an_offloading_compiler(caplog, monkeypatch):
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from sac_plugin import checkpointing

    monkeypatch.setattr(checkpointing, "_told_offload_is_keep", False)
    policy = Policy(offloaded_ops=["aten::addmm"])
    reference = _cpu_layer()
    x = torch.randn(8, 64, requires_grad=True)
    reference(x).sum().backward()
    model = _cpu_layer()
    with caplog.at_level("WARNING", logger="sac_plugin"):
        for _ in range(2):
            checkpoint(
                model,
                x,
                use_reentrant=False,
                context_fn=lambda: create_selective_checkpoint_contexts(sac_plugin.torch_policy_fn(policy)),
            ).sum().backward()
        decide = sac_plugin.torch_policy_fn(policy)
        ctx = type("Ctx", (), {"is_recompute": False})()
        tag = decide(ctx, torch.ops.aten.addmm.default, torch.zeros(4), torch.zeros(2, 3), torch.zeros(3, 4))
    assert tag == CheckpointPolicy.MUST_SAVE
    assert all(torch.equal(a.grad, 2 * b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    assert [r.getMessage() for r in caplog.records if "offloaded calls are kept" in r.getMessage()] == [
        "sac_plugin: offloaded calls are kept on the device here (MUST_SAVE): torch's eager checkpoint does not offload"
    ]


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_the_report_splits_held_bytes_by_place_and_counts_copies():
    values = _on_accelerator("""
model, x = checkpointed(Policy(kept_ops=["aten::tanh"], offloaded_ops=["aten::addmm"]))
step(model, x)
with sac_plugin.report(model) as layer_report:
    for _ in range(2):
        x.grad = None
        step(model, x)
layers = layer_report.to_dict()["layers"]
copies = layer_report.to_dict()["offload_copies"]
waited = copies.pop("exposed_copy_us")
report(layers=[(l["name"], l["calls"], l["kept_calls"], l["kept_bytes"], l["offloaded_calls"], l["offloaded_bytes"])
               for l in layers],
       copies=copies, waited=waited >= 0,
       line=[line.replace(f"{waited / 1e3:.1f} ms", "W ms") for line in layer_report.table().splitlines()
             if line.startswith("offloaded")])
""")
    one_output = 256 * 1024 * 4
    # Per layer and step: tanh (1 MiB) kept on the device, the up projection (1 MiB) offloaded, the
    # down projection (512 KiB, under the floor) kept on the device.
    assert values == {
        "layers": [[name, 2, 6, 2 * (one_output + one_output // 2), 2, 2 * one_output] for name in ("0", "1")],
        "copies": {
            "copies_to_host": 4,
            "bytes_to_host": 4 * one_output,
            "copies_to_device": 4,
            "bytes_to_device": 4 * one_output,
        },
        "waited": True,
        "line": [
            "offloaded over 2 steps: 4 calls holding 4.00 MiB of pinned host memory (not in kept bytes); 4 copies "
            "to the host (4.00 MiB), 4 back (4.00 MiB); compute waited W ms for copies back"
        ],
    }


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_the_compute_stream_waiting_for_a_copy_back_is_exposed_copy_time():
    values = _on_accelerator("""
model, x = checkpointed(Policy(offloaded_ops=["aten::addmm"]))
step(model, x)
exposed = []
for delay in (0.0, 0.05):
    sac_test_accelerator.set_copy_delay(delay, from_wait=True)
    before = stats()["exposed_copy_us"]
    x.grad = None
    step(model, x)
    exposed.append(stats()["exposed_copy_us"] - before)
report(at_least_one_delay=exposed[1] >= 50_000, more_with_delay=exposed[1] > exposed[0])
""")
    # Each copy back is held until the compute stream waits for it, then takes 50 ms more, and the
    # compute stream's event is stamped when the stream reached it (NOTE: [An event's time is when
    # its stream reached it]): the first layer served waits at least 50 ms however loaded the
    # machine. The second may wait less: its copy was released by the first wait, and ran while
    # the first layer's backward did.
    assert values == {"at_least_one_delay": True, "more_with_delay": True}


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_the_offload_benchmark_runs_on_the_test_accelerator():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = accelerator_environment()
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_offload.py",
            "--device",
            "sac_accel",
            "--dim",
            "64",
            "--heads",
            "4",
            "--seq",
            "64",
            "--steps",
            "1",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {
        line[:36].strip(): line[36:].split()
        for line in done.stdout.splitlines()
        if line[:36].strip() in ("no checkpointing", "keep attention + matmuls", "offload attention + matmuls")
    }
    assert set(rows) == {"no checkpointing", "keep attention + matmuls", "offload attention + matmuls"}
    assert all(row[-1] == "True" for row in rows.values()), done.stdout  # bitwise gradients
    held = {name: float(row[0]) for name, row in rows.items()}
    assert held["offload attention + matmuls"] < held["keep attention + matmuls"] < held["no checkpointing"]


@pytest.mark.slow
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
@pytest.mark.parametrize("engine", ["native", "dispatch_mode"])
def test_a_recompute_fetches_its_outputs_and_the_next_regions_on_the_device_thread(engine):
    values = _on_accelerator(
        """
model, x = checkpointed(Policy(offloaded_ops=["aten::addmm"]))
seen = []

def note(module, args):
    # In the recompute, the forward pre-hook runs once the region's recompute has begun.
    if torch._C._current_graph_task_id() >= 0:
        seen.append((threading.get_ident() != main_thread, stats()["copies_to_device"] - start))

main_thread = threading.get_ident()
for layer in model:
    layer.up.register_forward_pre_hook(note)
start = stats()["copies_to_device"]
with sac_plugin.audit() as audit:
    step(model, x)
report(seen=seen, hits=audit.hits("aten::addmm"), units_left=sac_plugin.open_units())
""",
        engine,
    )
    # The last layer's recompute runs first: its own output and the first layer's are on their way
    # back before either recompute reaches the call.
    assert values == {"seen": [[True, 2], [True, 2]], "hits": 4, "units_left": []}
