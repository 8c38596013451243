"""Declaration checks: every shipped unit resolves to at least one registered op or callable, so a
renamed op or method cannot silently make a unit keep nothing; a target map answers `in` for any
key."""

import pytest
from sac_plugin import ConfigError
from sac_plugin._config_policy import check_target_map
from sac_plugin.models import Llama, MoEModel
from sac_plugin.models import SHIPPED_TARGET_MAPS
from sac_plugin.targets import KeptCallables, KeptOps, RecomputeTargetMap, RecomputeUnit

MODELS = {"Llama": Llama, "MoEModel": MoEModel}


def _cases():
    for target_map in SHIPPED_TARGET_MAPS:
        for unit, target in target_map.items():
            yield pytest.param(target_map, unit, target, id=f"{target_map.model_name}-{unit.value}")


def test_every_model_has_a_shipped_map():
    assert sorted(t.model_name for t in SHIPPED_TARGET_MAPS) == sorted(MODELS)


@pytest.mark.parametrize("target_map,unit,target", list(_cases()))
def test_unit_resolves_to_something(target_map, unit, target):
    site = MODELS[target_map.model_name]().recompute_wrap_sites()[0]
    if isinstance(target, KeptOps):
        assert target.resolve(), f"{unit} names no registered op: {target.ops}"
    else:
        found = target.find(site)
        assert found, f"{unit} matches no callable: {target.paths}"
        assert all(callable(getattr(owner, name)) for owner, name in found)


@pytest.mark.parametrize("target_map", SHIPPED_TARGET_MAPS, ids=lambda t: t.model_name)
def test_whole_map_passes_the_check(target_map):
    check_target_map(target_map, MODELS[target_map.model_name]().recompute_wrap_sites()[0])


def test_a_renamed_method_fails_the_check():
    renamed = RecomputeTargetMap("Llama", {RecomputeUnit.MLP: KeptCallables(["feedforward"])})
    with pytest.raises(ConfigError) as error:
        check_target_map(renamed, Llama().recompute_wrap_sites()[0])
    assert str(error.value) == "target map of Llama: unit 'mlp': ['feedforward'] match nothing in LlamaBlock"


def test_a_renamed_op_fails_the_check():
    renamed = RecomputeTargetMap("Llama", {RecomputeUnit.ATTN: KeptOps(["aten::_flash_attention_v9"])})
    with pytest.raises(ConfigError, match=r"^target map of Llama: unit 'attn': none of the op names resolves"):
        check_target_map(renamed)


def test_a_target_map_answers_in_for_any_key():
    targets = RecomputeTargetMap("M", {"attn": KeptOps(["aten::mm"])})
    assert "attn" in targets and "mlp" not in targets and "nonsense" not in targets
