"""torchtitan's selective AC on the plugin, against torchtitan's own SAC.

On torchtitan's debug Llama3 and DeepSeek-V3 (MoE) models, with SDPA attention on CPU: the calls
the plugin serves from what it kept are exactly the calls torchtitan's own policy function
(recorded as it runs, not reproduced) decides to save, op by op, and every gradient is bitwise
equal to torchtitan's SAC and to the model without checkpointing.
"""

import collections
import copy
import dataclasses
import warnings

import pytest
import sac_plugin
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

tac = pytest.importorskip(
    "torchtitan.distributed.activation_checkpoint",
    reason="torchtitan is not importable: tools/setup.sh installs torchtitan 0.3.0, which needs torch >= 2.13",
)
from sac_plugin.integrations import torchtitan as titan_sac  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_thread():
    # torchtitan's MoE is not bitwise reproducible run to run with several intra-op threads (two
    # unmodified runs differed in the last bits, measured): the comparisons run on one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _loss(model, tokens):
    return model(tokens).float().pow(2).mean()


def _torchtitan_saves(model, tokens, monkeypatch, config=None):
    """torchtitan's SelectiveAC (or the one whose config is given) on `model`; returns {op: forward
    calls its policy saved}."""
    saved = collections.Counter()
    make_contexts = tac.create_selective_checkpoint_contexts

    def recording(policy_fn, *args, **kwargs):
        def record(ctx, func, *a, **k):
            decision = policy_fn(ctx, func, *a, **k)
            if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                saved[func._name] += 1  # "aten::mm"
            return decision

        return make_contexts(record, *args, **kwargs)

    monkeypatch.setattr(tac, "create_selective_checkpoint_contexts", recording)
    (tac.SelectiveAC.Config() if config is None else config).build().apply(model)
    _loss(model, tokens).backward()
    return saved


def _grads(model):
    return {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}


# DeepSeek-V3: MLA runs SDPA's math path, two bmm per layer, and torchtitan saves both. The math
# path then adds the causal mask in place into the first bmm's output: torch's SAC (torchtitan)
# serves the written tensor and adds the mask again, harmless only because the mask is 0 / -inf;
# both engines hold the value from before the write and serve that (NOTE: [Kept outputs written
# in the forward]). README, "torchtitan".
@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_same_kept_calls_and_bitwise_gradients_as_torchtitan(name, monkeypatch):
    base = titan_sac.cpu_debug_model(name, n_layers=2)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    tokens = torch.randint(2048, (2, 32), generator=torch.Generator().manual_seed(0))
    _loss(base, tokens).backward()
    saved = _torchtitan_saves(theirs, tokens, monkeypatch)
    with pytest.warns(UserWarning, match="never keeps a collective"):
        titan_sac.apply_ac(ours, tac.SelectiveAC.Config())
    # torchtitan runs the whole recompute (early_stop=False), so every kept call is reached.
    with sac_plugin.audit() as audit, set_checkpoint_early_stop(False):
        _loss(ours, tokens).backward()
    served = {row.op: row.hits for row in audit.rows() if row.hits}
    expected = dict(saved)
    if name == "deepseek_v3":
        # The MoE's token sort (argsort of the expert choices) is routing, served from the forward
        # (docs/semantics.md, "Routing is served from the forward"); torchtitan 0.3.0 recomputes it.
        expected["aten::sort.stable"] = 1
    if name == "deepseek_v3" and sac_plugin.engine() == "native":
        # The write into a kept bmm's output: the mask added in place, once per block.
        assert audit.count("aten::add_.Tensor", phase="forward") >= 2
    assert served == expected
    if name == "llama3":
        assert saved == {"aten::mm": 6}  # calls 1, 3, 5 of the 5 matmuls in each of 2 blocks
    else:  # the router gate's mm is forced to recompute and does not count towards "every second"
        assert saved == {"aten::mm": 8, "aten::bmm": 4, "aten::topk": 1}
    reference, theirs_grads, ours_grads = _grads(base), _grads(theirs), _grads(ours)
    # A NaN would make torch.equal fail for the wrong reason (and hide a real difference).
    assert all(torch.isfinite(grad).all() for grad in reference.values() if grad is not None)
    assert reference.keys() == ours_grads.keys() == theirs_grads.keys()
    for key, grad in reference.items():
        assert torch.equal(ours_grads[key], grad), key
        assert torch.equal(ours_grads[key], theirs_grads[key]), key


def test_plugin_config_is_a_drop_in_for_torchtitans_config():
    model = titan_sac.cpu_debug_model("llama3", n_layers=1)
    config = titan_sac.PluginSelectiveAC.Config()
    assert isinstance(config, tac.SelectiveAC.Config)
    with pytest.warns(UserWarning, match="never keeps a collective"):
        config.build(dump_folder="").apply(model)  # what torchtitan's parallelize functions call
    assert "_sac_policy" in vars(model.layers["0"])
    assert [n for n, _ in model.named_parameters()] == [
        n for n, _ in titan_sac.cpu_debug_model("llama3", n_layers=1).named_parameters()
    ]


def test_collectives_warning_text():
    model = titan_sac.cpu_debug_model("llama3", n_layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        titan_sac.apply_ac(model, tac.SelectiveAC.Config())
    assert [str(w.message) for w in caught] == [
        "sac_plugin: torchtitan's selective AC keeps the outputs of the collectives "
        "_c10d_functional::reduce_scatter_tensor and _c10d_functional::all_to_all_single; sac_plugin never keeps a "
        "collective, so under tensor or expert parallelism they run again in the recompute (README: 'torchtitan')"
    ]


def test_full_ac_and_none():
    model = titan_sac.cpu_debug_model("llama3", n_layers=1)
    assert titan_sac.apply_ac(model, None) is model and "_sac_policy" not in vars(model.layers["0"])
    titan_sac.apply_ac(model, tac.FullAC.Config())
    tokens = torch.randint(2048, (1, 8))
    with sac_plugin.audit() as audit:
        _loss(model, tokens).backward()
    assert sum(row.hits for row in audit.rows()) == 0
    # torchtitan's wrappers pass early_stop=False: the whole block runs again, w2 included.
    assert audit.count("aten::mm", phase="recompute") == 5


def _full_ac_config_with_early_stop(early_stop: bool):
    """FullAC's config with an `early_stop` field, as torchtitan's configs have had."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(tac.FullAC.Config):
        early_stop: bool = False

    return Config(early_stop=early_stop)


@pytest.mark.parametrize("early_stop", [None, False, True], ids=["no field", "False", "True"])
def test_early_stop_is_torchtitans(early_stop):
    config = tac.FullAC.Config() if early_stop is None else _full_ac_config_with_early_stop(early_stop)
    model = titan_sac.apply_ac(titan_sac.cpu_debug_model("llama3", n_layers=1), config)
    with sac_plugin.audit() as audit:
        _loss(model, torch.randint(2048, (1, 8))).backward()
    # The block's five matmuls, or all but w2 where the recompute stops after the last tensor the
    # backward needs.
    assert audit.count("aten::mm", phase="recompute") == (4 if early_stop else 5)


# torchtitan's own unit tests of its activation checkpointing (tests/unit_tests/
# test_activation_checkpoint.py: test_flops, test_force_recompute_mm_fqns), on the plugin's drop-in:
# a block of three matmuls, gate -> wq -> output, the last twice as wide.
class _ToyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from torchtitan.models.common.linear import Linear

        self.moe = torch.nn.Module()
        self.moe.router = torch.nn.Module()
        self.moe.router.gate = Linear.Config(in_features=512, out_features=512, bias=False).build()
        self.attention = torch.nn.Module()
        self.attention.wq = Linear.Config(in_features=512, out_features=512, bias=False).build()
        self.output = Linear.Config(in_features=512, out_features=1024, bias=False).build()

    def forward(self, x):
        return self.output(self.attention.wq(self.moe.router.gate(x))).sum()


class _ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": _ToyBlock()})

    def forward(self, x):
        return self.layers["0"](x)


def _toy_with(config):
    model = _ToyModel()
    if isinstance(config, tac.FullAC.Config):
        titan_sac.apply_ac(model, config)
    elif config is not None:
        with pytest.warns(UserWarning, match="never keeps a collective"):
            config.build().apply(model)
    return model


def _selective(fqns):
    return titan_sac.PluginSelectiveAC.Config(force_recompute_mm_shapes_by_fqns=fqns)


def test_flops_are_torchtitans():
    """A FlopCounterMode around backward counts the matmuls that ran, in units of one 512^3 matmul:
    torchtitan's expectations for its own SAC."""

    def backward_flops(model):
        model(torch.randn(512, 512, requires_grad=True)).backward()
        out = model(torch.randn(512, 512, requires_grad=True))
        with FlopCounterMode(display=False) as counter:
            out.backward()
        return counter.get_total_flops() / (512**3 * 2)

    configs = {
        "no AC": None,
        "selective": _selective([]),
        "gate forced": _selective(["moe.router.gate"]),
        "output forced": _selective(["output"]),
        "full": tac.FullAC.Config(),
    }
    flops = {name: backward_flops(_toy_with(config)) for name, config in configs.items()}
    assert flops == {"no AC": 8.0, "selective": 9.0, "gate forced": 10.0, "output forced": 11.0, "full": 12.0}


class _MatmulsByWeight(TorchDispatchMode):
    """Counts the mm calls that reach it, by the Linear whose weight they read."""

    def __init__(self, names_by_pointer):
        super().__init__()
        self._names = names_by_pointer
        self.counts = {name: 0 for name in names_by_pointer.values()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops.aten.mm.default:
            for arg in args:
                name = self._names.get(arg.data_ptr())
                if name is not None:
                    self.counts[name] += 1
                    break
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("fqns", "recomputed"),
    [
        ([], {"wq"}),  # every second matmul
        (["moe.router.gate"], {"gate", "wq"}),  # wq has gate's shape; output is then the first
        (["output"], {"wq", "output"}),  # gate and wq still alternate
    ],
)
def test_force_recompute_mm_fqns_recompute_torchtitans_matmuls(fqns, recomputed):
    """A mode around backward sees two matmuls reading a recomputed weight (the recompute's and the
    gradient's) and one reading a kept one."""
    model = _toy_with(_selective(fqns))
    names = {
        module.weight.data_ptr(): path.rsplit(".", 1)[-1]
        for path, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    out = model(torch.randn(64, 512, requires_grad=True))
    tracker = _MatmulsByWeight(names)
    with tracker:
        out.backward()
    assert {name for name, count in tracker.counts.items() if count == 2} == recomputed
    assert all(count in (1, 2) for count in tracker.counts.values())


def test_bad_configs_are_refused_with_what_to_do():
    model = titan_sac.cpu_debug_model("deepseek_v3", n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before the warning: nothing changed
        with pytest.raises(
            ValueError,
            match=r"force_recompute_mm_shapes_by_fqns matches 'layers.1.moe.router', a "
            r"TokenChoiceTopKRouter; it must name nn.Linear modules",
        ):
            titan_sac.apply_ac(model, tac.SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=["moe.router"]))
    assert not any("_sac_policy" in vars(block) for block in model.layers.values())
    with pytest.raises(ValueError, match="determinism_check='none' is not supported"):
        titan_sac.apply_ac(model, tac.SelectiveAC.Config(determinism_check="none"))
    with pytest.raises(TypeError, match="ac_config must be torchtitan's SelectiveAC.Config, FullAC.Config or None"):
        titan_sac.apply_ac(model, {"mode": "selective"})
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        titan_sac.cpu_debug_model("gpt")


def test_offloaded_ops_of_the_save_list_serve_what_keeping_serves():
    # On the CPU offloading is keeping, so offloading topk (torchtitan keeps it) serves the same
    # calls; the policy names it as offloaded instead of kept, and aten::mm cannot be offloaded.
    served, policies = {}, {}
    for offloaded in ((), ("aten::topk.default",)):
        model = titan_sac.cpu_debug_model("deepseek_v3", n_layers=2)
        tokens = torch.randint(2048, (2, 32), generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            titan_sac.apply_ac(model, tac.SelectiveAC.Config(), offloaded_ops=offloaded, offload_min_bytes=0)
            with sac_plugin.audit() as audit:
                _loss(model, tokens).backward()
        served[offloaded] = {row.op: row.hits for row in audit.rows() if row.hits}
        policies[offloaded] = vars(model.layers["1"])["_sac_policy"]
    assert served[()] == served[("aten::topk.default",)] and served[()]["aten::topk"] == 1
    assert "aten::topk" in policies[()].kept_ops and "aten::topk" not in policies[("aten::topk.default",)].kept_ops
    assert policies[("aten::topk.default",)].offloaded_ops == frozenset({"aten::topk"})
    with pytest.raises(
        ValueError, match="offloaded_ops names aten::mm, which torchtitan's selective AC keeps every other call of"
    ):
        titan_sac.apply_ac(
            titan_sac.cpu_debug_model("llama3", n_layers=1), tac.SelectiveAC.Config(), offloaded_ops=["aten::mm"]
        )


# torchtitan's documented way to tune its save set: subclass SelectiveAC, override get_save_ops.
_SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class _SavesNothing(tac.SelectiveAC):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(tac.SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return set()


class _SavesAttention(tac.SelectiveAC):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(tac.SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return {_SDPA_CPU, torch._higher_order_ops.flex_attention}


def _plugin_subclass(save_ops):
    """A PluginSelectiveAC subclass overriding get_save_ops, as a user of the drop-in writes it."""

    class Tuned(titan_sac.PluginSelectiveAC):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(titan_sac.PluginSelectiveAC.Config):
            pass

        def get_save_ops(self) -> set:
            return set(save_ops)

    return Tuned


@pytest.mark.parametrize("front_door", ["apply_ac", "build().apply()"])
@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (_SavesNothing, {}),
        (_SavesAttention, {"aten::_scaled_dot_product_flash_attention_for_cpu": 2}),  # one call in each of 2 blocks
    ],
    ids=["nothing", "attention"],
)
def test_get_save_ops_override_is_honoured(cls, expected, front_door, monkeypatch):
    base = titan_sac.cpu_debug_model("llama3", n_layers=2)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    tokens = torch.randint(2048, (2, 32), generator=torch.Generator().manual_seed(0))
    _loss(base, tokens).backward()
    saved = _torchtitan_saves(theirs, tokens, monkeypatch, cls.Config())
    assert dict(saved) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the save set has no collective: nothing to warn about
        if front_door == "apply_ac":
            titan_sac.apply_ac(ours, cls.Config())
        else:
            _plugin_subclass(cls.get_save_ops(None)).Config().build().apply(ours)
    with sac_plugin.audit() as audit, set_checkpoint_early_stop(False):
        _loss(ours, tokens).backward()
    assert {row.op: row.hits for row in audit.rows() if row.hits} == expected
    reference, ours_grads = _grads(base), _grads(ours)
    assert reference.keys() == ours_grads.keys()
    for key, grad in reference.items():
        assert torch.equal(ours_grads[key], grad), key


def test_save_ops_of_names_overloads_and_refuses_other_things():
    assert titan_sac.save_ops_of(
        {torch.ops.aten.mm.default, torch.ops.aten.topk, _SDPA_CPU, torch._higher_order_ops.flex_attention}
    ) == ["aten::_scaled_dot_product_flash_attention_for_cpu.default", "aten::mm.default", "aten::topk.default"]
    with pytest.raises(
        TypeError,
        match=r"get_save_ops\(\) must return ops such as torch.ops.aten.mm.default, got an "
        r"element 'aten::mm'",
    ):
        titan_sac.save_ops_of({"aten::mm"})
