"""torch_remat regions are recompute units (NOTE: [torch_remat regions are recompute units] in
sac_plugin/units.py): inside a sac_plugin-checkpointed layer a `torch_remat.region(fn, name,
recompute=...)` opens a unit named `name`; the policy's lists, names or patterns, decide for it,
and a region no list names follows its own flag."""

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sac_plugin
from sac_plugin import Policy, units

remat = pytest.importorskip("torch_remat")

DIM = 16


class AnnotatedBlock(torch.nn.Module):
    """A torchtitan-main-style block: regions in the model code."""

    def __init__(self, core_recomputes=False, mlp_recomputes=True):
        super().__init__()
        self.wq = torch.nn.Linear(DIM, DIM)
        self.w1 = torch.nn.Linear(DIM, 2 * DIM)
        self.w2 = torch.nn.Linear(2 * DIM, DIM)
        self.core_recomputes, self.mlp_recomputes = core_recomputes, mlp_recomputes

    def core(self, x):
        return torch.sin(torch.tanh(self.wq(x)))

    def mlp(self, h):
        return self.w2(torch.relu(self.w1(h)))

    def forward(self, x):
        core = remat.region(self.core, "attn.core", recompute=self.core_recomputes)(x)
        remat.recompute_needs_tensor(core)  # its consumer is bare code (torch_remat's rule)
        h = x + core
        return h + remat.region(self.mlp, "mlp.ffn", recompute=self.mlp_recomputes)(h)


def _pair(**flags):
    torch.manual_seed(0)
    model = AnnotatedBlock(**flags)
    reference = AnnotatedBlock(**flags)
    reference.load_state_dict(model.state_dict())
    return model, reference


def _step(model, x, policy=None):
    x = x.clone().requires_grad_()
    if policy is None:
        out = model(x)
    else:
        out = checkpoint(model, x, use_reentrant=False, context_fn=sac_plugin.context_fn(policy))
    out.square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def _audited(policy, **flags):
    model, reference = _pair(**flags)
    x = torch.randn(4, DIM)
    with sac_plugin.audit() as audit:
        got = _step(model, x, policy)
    for a, b in zip(got, _step(reference, x)):
        assert torch.equal(a, b)
    return audit


def test_a_region_is_a_unit_the_policy_can_keep():
    audit = _audited(Policy(kept_units=["attn.core"]))
    assert (audit.hits("aten::addmm"), audit.hits("aten::tanh"), audit.hits("aten::sin")) == (1, 1, 1)
    assert audit.hits("aten::relu") == 0


def test_a_region_no_list_names_follows_its_flag():
    # A selective policy that names no region: recompute=False keeps, recompute=True recomputes.
    audit = _audited(Policy(kept_ops=["aten::relu"]))
    assert (audit.hits("aten::tanh"), audit.hits("aten::sin")) == (1, 1)
    assert audit.hits("aten::relu") == 1  # kept by op inside the recompute=True region
    audit = _audited(Policy(kept_ops=["aten::relu"]), core_recomputes=True)
    assert (audit.hits("aten::tanh"), audit.hits("aten::sin")) == (0, 0)


def test_the_lists_override_the_flag():
    # recompute=True kept by kept_units, recompute=False recomputed by recomputed_units.
    audit = _audited(Policy(kept_units=["mlp.ffn"], recomputed_units=["attn.core"]))
    assert (audit.hits("aten::tanh"), audit.hits("aten::sin")) == (0, 0)
    # w1's addmm and the relu are served; w2's addmm, the block's last call, is kept but never
    # reached by torch's early stop (NOTE: [Kept outputs the recompute never reaches]).
    assert audit.hits("aten::relu") == 1 and audit.hits("aten::addmm") == 1


def test_unit_patterns_match_region_names_as_torchtitan():
    # torchtitan's "save everything but" config.
    audit = _audited(Policy(kept_units=["*"], recomputed_units=["*.ffn"]), core_recomputes=True)
    assert (audit.hits("aten::tanh"), audit.hits("aten::sin"), audit.hits("aten::relu")) == (1, 1, 0)
    assert Policy(kept_units=["*"], recomputed_units=["*.ffn"]).kept_units == frozenset({"*"})


def test_name_scope_prefixes_the_unit_name():
    model, reference = _pair()

    def scoped(x):
        with remat.name_scope("layers.0"):
            return model(x)

    x = torch.randn(4, DIM, requires_grad=True)
    with sac_plugin.audit() as audit:
        out = checkpoint(
            scoped,
            x,
            use_reentrant=False,
            context_fn=sac_plugin.context_fn(
                Policy(kept_units=["layers.0/attn.core"], recomputed_units=["layers.0/mlp.*"])
            ),
        )
        out.sum().backward()
    assert (audit.hits("aten::tanh"), audit.hits("aten::relu")) == (1, 0)


def test_nesting_follows_torch_remat():
    def inner(x):
        return torch.tanh(x)

    def outer(x):
        return remat.region(inner, "inner", recompute=True)(x) * 2

    x = torch.randn(4, DIM, requires_grad=True)
    with pytest.raises(
        RuntimeError,
        match=r"remat.region 'inner' was called with recompute=True while nested inside "
        r"a recompute=False \(SAVE\) region",
    ):
        checkpoint(
            lambda t: remat.region(outer, "outer", recompute=False)(t),
            x,
            use_reentrant=False,
            context_fn=sac_plugin.context_fn(Policy(kept_ops=["aten::relu"])),
        )
    assert units.open_units() == []


def test_inside_torch_remat_checkpoint_torch_remat_decides(monkeypatch):
    if not hasattr(torch._C, "_set_storage_data_ptr_access_error_msg"):
        # torch_remat 0.2.2 poisons the storage of a skipped region's placeholder with a message
        # through a function this torch lacks; without it a placeholder is just a null storage.
        monkeypatch.setattr(torch._C, "_set_storage_data_ptr_access_error_msg", lambda *args: None, raising=False)
    model, reference = _pair()
    x = torch.randn(4, DIM)
    xr = x.clone().requires_grad_()
    remat.checkpoint(region_name="layers.0")(model)(xr).square().sum().backward()
    for a, b in zip([xr.grad] + [p.grad for p in model.parameters()], _step(reference, x)):
        assert torch.equal(a, b)


def test_outside_any_checkpoint_a_region_is_a_plain_call_with_its_unit_open():
    seen = []
    out = remat.region(lambda t: seen.append(units.open_units()) or t + 1, "attn.core", recompute=False)(torch.ones(1))
    assert seen == [["attn.core"]] and out.item() == 2.0


def test_uninstall_puts_torch_remat_back():
    import torch_remat._api

    assert torch_remat.region is units._sac_region and torch_remat._api.region is units._sac_region
    units.uninstall_remat_regions()
    try:
        assert torch_remat.region is torch_remat._api.region
        assert torch_remat.region.__module__ == "torch_remat._api"
        seen = []
        remat.region(lambda t: seen.append(units.open_units()) or t, "attn.core", recompute=False)(torch.ones(1))
        assert seen == [[]]
    finally:
        assert units.install_remat_regions()
    assert units.install_remat_regions()  # a second install changes nothing
    units.uninstall_remat_regions()
    assert torch_remat.region.__module__ == "torch_remat._api"
    assert units.install_remat_regions() and torch_remat.region is units._sac_region


def test_the_unit_check_knows_region_names():
    model, _ = _pair()
    x = torch.randn(4, DIM, requires_grad=True)
    policy = Policy(kept_units=["attn.cor"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint(model, x, use_reentrant=False, context_fn=sac_plugin.context_fn(policy)).sum().backward()
    messages = [str(w.message) for w in caught if "attn.cor'" in str(w.message)]
    assert len(messages) == 1
    assert "Units opened there: attn.core, mlp.ffn; closest match: 'attn.core'" in messages[0]


def test_the_unit_check_matches_patterns():
    model, _ = _pair()
    x = torch.randn(4, DIM, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for policy in (Policy(kept_units=["attn.*"]), Policy(kept_units=["atn.*"])):
            checkpoint(model, x, use_reentrant=False, context_fn=sac_plugin.context_fn(policy)).sum().backward()
    messages = [str(w.message) for w in caught if "unit '" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith("sac_plugin: kept unit 'atn.*' is declared by no model and was not opened")


@pytest.mark.slow
def test_bench_remat_runs_every_row_bitwise():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_remat.py",
            "--layers",
            "1",
            "--dim",
            "32",
            "--tokens",
            "32",
            "--reps",
            "1",
            "--steps",
            "1",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gradients of every row bitwise equal to the unmodified model" in done.stdout
    table = done.stdout.split("x torch_remat\n", 1)[1].splitlines()
    assert [line[:28].strip() for line in table] == [
        "no checkpoint",
        "torch_remat",
        "sac_plugin, flags",
        "sac_plugin, patterns",
        "sac_plugin, no early stop",
        "sac_plugin, per-op",
        "sac_plugin, offload",
    ]


def test_a_config_file_names_regions_by_pattern():
    from sac_plugin import RecomputeConfig, RecomputeTargetMap
    from sac_plugin._config_policy import policy_for

    text = '{"kept_units": ["*"], "recomputed_units": ["*.ffn"], "pin_routing": false}'
    config = RecomputeConfig.from_json(text)
    assert RecomputeConfig.from_json(config.to_json()) == config
    policy = policy_for(config, RecomputeTargetMap("annotated", {}))
    assert (policy.kept_units, policy.recomputed_units, policy.pin_routing) == (
        frozenset({"*"}),
        frozenset({"*.ffn"}),
        False,
    )
    with pytest.raises(ValueError, match=r"^recompute config: kept_units\[0\]: a recompute unit needs a non-empty"):
        RecomputeConfig(kept_units=[""])
    with pytest.raises(ValueError, match=r"^recompute config: pin_routing must be True or False, got 'no' \(str\)$"):
        RecomputeConfig(pin_routing="no")

    model = torch.nn.Sequential(_pair(core_recomputes=True)[0], _pair(core_recomputes=True)[0])
    reference = torch.nn.Sequential(*[_pair(core_recomputes=True)[1] for _ in range(2)])
    reference.load_state_dict(model.state_dict())
    sac_plugin.apply_recompute_config(
        model,
        RecomputeConfig(kept_units=["*"], recomputed_units=["*.ffn"]),
        target_map=RecomputeTargetMap("annotated", {}),
        wrap_sites=list(model),
    )
    x = torch.randn(4, DIM)
    with sac_plugin.audit() as audit:
        got = _step(model, x)
    for a, b in zip(got, _step(reference, x)):
        assert torch.equal(a, b)
    assert (audit.hits("aten::tanh"), audit.hits("aten::sin"), audit.hits("aten::relu")) == (2, 2, 0)
