"""torchtitan: its selective activation checkpointing (SAC), run by the plugin.

    from sac_plugin.integrations import torchtitan as titan_sac
    titan_sac.apply_ac(model, SelectiveAC.Config())      # torchtitan's own config object
    # or hand torchtitan a config whose build() runs the plugin:
    parallelize_llama(model, ..., ac_config=titan_sac.PluginSelectiveAC.Config())

torchtitan's `SelectiveAC` (torchtitan/distributed/activation_checkpoint.py, 0.3.0) wraps each
`model.layers` block with torch's SAC and a policy function that, per op call:

| torchtitan's rule | the plugin's terms |
|---|---|
| save torch's compute-intensive ops (partitioner's list: mm, addmm, bmm, SDPA flash/efficient, ...), SDPA math/cudnn/overrideable, `aten.max.default`, `aten.linear`, `aten.topk` | `Policy(kept_ops=save_ops())`, built from the same partitioner list at run time |
| ... except every second `mm`/`linear` (calls 2, 4, ... of the block's forward) | `every_nth_op={"aten::mm.default": 2}` (calls 0, 2, ... kept); `linear` is composite and reaches neither policy as itself on CPU or CUDA |
| force recompute of matmuls whose right operand has the shape of a Linear whose FQN contains `moe.router.gate` (`force_recompute_mm_shapes_by_fqns`); they do not count towards "every second" | every `nn.Linear` of the block with such a weight shape runs in a recomputed unit; its calls take no every-nth index |
| keep CUDA->CPU `_to_copy` (the expert-parallel dispatcher's split sizes, a device sync) | the dispatcher's `_sync_token_count_exchange` runs in a kept unit |
| keep `_c10d_functional.reduce_scatter_tensor`, `all_to_all_single` | refused: the plugin never keeps a collective; one warning says so |
| keep the flex_attention and inductor_compiled_code higher-order ops | not dispatcher ops: the plugin sees the aten ops inside them (or none, for compiled code) |

The plugin checkpoints each block in place (state_dict keys unchanged; torchtitan's wrapper adds
`_checkpoint_wrapped_module.`). torchtitan is imported only by what needs it.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from .._forwards import run_in_unit
from ..checkpointing import apply_selective_checkpointing
from .._validation import bounded_repr, describe_value
from ..policy import Policy, resolve_kept_ops

# PluginSelectiveAC is public too, but it subclasses torchtitan's SelectiveAC and is built on first
# use (the module's __getattr__): listing it here would make `import *` import torchtitan.
__all__ = ["apply_ac", "cpu_debug_model", "forced_recompute_shapes", "policy_for_block", "save_ops", "save_ops_of"]

FORCED_RECOMPUTE_UNIT = "torchtitan_forced_recompute"
CPU_OFFLOAD_UNIT = "torchtitan_cpu_offload"

# torchtitan's additions to the partitioner's compute-intensive list, as plugin names; spellings
# this build lacks are skipped (resolve_kept_ops).
_TORCHTITAN_COMPUTE_OPS = (
    "aten::_scaled_dot_product_cudnn_attention.default",
    "aten::_scaled_dot_product_attention_math.default",
    "aten::_scaled_dot_product_fused_attention_overrideable.default",
    "aten::max.default",  # the absolute maximum behind a low-precision scale
    "aten::linear.default",  # for backends that register linear as a leaf op
    "aten::topk.default",  # MoE expert choice, which may not be deterministic
    "torch_attn::_varlen_attn.default",
    "deepep::dispatch.default",
    "deepep::combine.default",
    "hybridep::dispatch.default",
    "hybridep::combine.default",
)
# torchtitan keeps these; the plugin refuses every collective (README: "What is kept").
TORCHTITAN_KEPT_COLLECTIVES = (
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_to_all_single",
)
COLLECTIVES_WARNING = (
    "sac_plugin: torchtitan's selective AC keeps the outputs of the collectives "
    + " and ".join(TORCHTITAN_KEPT_COLLECTIVES)
    + "; sac_plugin never keeps a collective, so under tensor or expert parallelism they run again in "
    "the recompute (README: 'torchtitan')"
)
# torchtitan 0.3.0's default force_recompute_mm_shapes_by_fqns.
DEFAULT_FORCE_RECOMPUTE_FQNS = ("moe.router.gate",)
MM = "aten::mm.default"


def save_ops() -> list[str]:
    """torchtitan's save list in plugin names, collectives left out: the `.default` overload of
    each op in torch's partitioner list of compute-intensive ops, plus torchtitan's own additions
    that this installation registers. `aten::mm.default` is among them: it gets its every-second
    rule instead of a kept-op entry (policy_for_block).

    Returns:
        The op names, sorted.
    """
    from torch._functorch.partitioners import get_default_op_list

    names = {f"{op._qualified_op_name}.default" for op in get_default_op_list().compute_intensive_ops}
    return sorted(names | resolve_kept_ops([*_TORCHTITAN_COMPUTE_OPS, *names]))


def forced_recompute_shapes(block: nn.Module, fqns, base_fqn: str | None = None) -> set[tuple[int, int]]:
    """torchtitan's rule: the (out, in) weight shapes of the block's nn.Linear modules whose FQN
    (base_fqn.module_path) contains any of `fqns`. A match that is not an nn.Linear is refused.

    Args:
        block: The block (a layer of model.layers).
        fqns: Substrings of module names, torchtitan's force_recompute_mm_shapes_by_fqns.
        base_fqn: The block's own name in the model, prefixed to its modules' paths.

    Returns:
        The weight shapes, as (out_features, in_features).

    Raises:
        ValueError: A module that matches is not an nn.Linear.
    """
    shapes = set()
    for path, module in block.named_modules():
        fqn = f"{base_fqn}.{path}" if base_fqn else path
        if not any(f in fqn for f in fqns):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"sac_plugin: torchtitan: force_recompute_mm_shapes_by_fqns matches '{fqn}', a "
                f"{type(module).__name__}; it must name nn.Linear modules (as in torchtitan)"
            )
        shapes.add(tuple(module.weight.shape))
    return shapes


def _owner_and_name(block: nn.Module, path: str):
    parent, _, name = path.rpartition(".")
    return (block.get_submodule(parent) if parent else block), name


def _offloaded_names(offload: dict) -> frozenset[str]:
    """The overloads `offload["offloaded_ops"]` names, as Policy names them ("aten::addmm");
    refuses mm, which torchtitan's every-other-matmul rule keeps."""
    names = Policy(**offload).offloaded_ops if offload.get("offloaded_ops") else frozenset()
    if "aten::mm" in names:
        raise ValueError(
            "sac_plugin: torchtitan: offloaded_ops names aten::mm, which torchtitan's selective AC keeps "
            "every other call of (every_nth_op); offload the other ops of its save list (save_ops())"
        )
    return names


def save_ops_of(ops) -> list[str]:
    """A torchtitan save set (what `SelectiveAC.get_save_ops()` returns: op overloads, and
    higher-order ops) in plugin names, such as "aten::mm.default". Higher-order ops (flex
    attention, inductor's compiled code) are left out: they are not dispatcher ops, and the
    plugin sees the aten ops inside them. Collectives stay in; policy_for_block leaves them out.

    Args:
        ops: The save set: OpOverload, OpOverloadPacket and HigherOrderOperator objects.

    Returns:
        The op names, sorted.

    Raises:
        TypeError: `ops` is not a collection of ops.
    """
    if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
        raise TypeError(
            f"sac_plugin: torchtitan: get_save_ops() must return a set of ops such as "
            f"{{torch.ops.aten.mm.default}}, got {describe_value(ops)}"
        )
    names = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverload):
            names.add(f"{op._schema.name}.{op._overloadname}")
        elif isinstance(op, torch._ops.OpOverloadPacket):
            names.add(f"{op._qualified_op_name}.default")
        elif not isinstance(op, torch._ops.HigherOrderOperator):
            raise TypeError(
                f"sac_plugin: torchtitan: get_save_ops() must return ops such as "
                f"torch.ops.aten.mm.default, got an element {describe_value(op)}"
            )
    return sorted(names)


def _is_collective(name: str) -> bool:
    return name.startswith(("_c10d_functional::", "c10d::", "c10d_functional::"))


def policy_for_block(
    block: nn.Module,
    *,
    force_recompute_fqns=DEFAULT_FORCE_RECOMPUTE_FQNS,
    base_fqn: str | None = None,
    offload: dict | None = None,
    saved: list[str] | None = None,
):
    """(Policy, [(owner, attribute, unit)]): torchtitan's selective AC for one block, and where its
    units go. Every nn.Linear whose weight has a forced shape is recomputed, as torchtitan's
    shape match recomputes any matmul with that right operand; the expert-parallel dispatcher's
    token-count exchange (its CUDA->CPU copies) is kept. `offload`: Policy's offload keywords
    (offloaded_ops, offload_min_bytes, host_memory_limit); the ops of the save list it names are
    offloaded instead of kept. `saved`: the save set in plugin names (save_ops_of), None for
    torchtitan's default (save_ops()); `aten::mm.default` in it gets the every-second rule, and
    without it no matmul is kept, as torchtitan's policy does.

    Args:
        block: The block (a layer of model.layers).
        force_recompute_fqns: torchtitan's force_recompute_mm_shapes_by_fqns.
        base_fqn: The block's own name in the model (forced_recompute_shapes).
        offload: Policy's offload keywords, or None to offload nothing.
        saved: The save set in plugin names, or None for torchtitan's default.

    Returns:
        `(policy, in_units)`: the Policy, and `(owner, attribute, unit)` for each callable that
            runs in a unit of it.

    Raises:
        TypeError: `force_recompute_fqns` is not a list of non-empty names.
        ValueError: A forced name matches a module that is not an nn.Linear, or `offload` names aten::mm.
    """
    offload = dict(offload or {})
    saved = save_ops() if saved is None else [name for name in saved if not _is_collective(name)]
    _check_fqns(force_recompute_fqns)
    shapes = forced_recompute_shapes(block, force_recompute_fqns, base_fqn) if force_recompute_fqns else set()
    in_units = []
    for path, module in block.named_modules():
        if path and isinstance(module, nn.Linear) and tuple(module.weight.shape) in shapes:
            in_units.append((*_owner_and_name(block, path), FORCED_RECOMPUTE_UNIT))
        dispatcher = getattr(module, "token_dispatcher", None)
        if callable(getattr(dispatcher, "_sync_token_count_exchange", None)):
            in_units.append((dispatcher, "_sync_token_count_exchange", CPU_OFFLOAD_UNIT))
    # Units only where the block has them: a unit no forward opens would be reported as a typo.
    units = {unit for _, _, unit in in_units}
    offloaded = _offloaded_names(offload)
    policy = Policy(
        kept_ops=[op for op in saved if op != MM and op.removesuffix(".default") not in offloaded],
        kept_units=[CPU_OFFLOAD_UNIT] if CPU_OFFLOAD_UNIT in units else [],
        every_nth_op={MM: 2} if MM in saved else {},
        recomputed_units=[FORCED_RECOMPUTE_UNIT] if FORCED_RECOMPUTE_UNIT in units else [],
        **offload,
    )
    return policy, in_units


def _check_fqns(fqns) -> None:
    if isinstance(fqns, str) or not all(isinstance(f, str) and f for f in fqns):
        raise TypeError(
            "sac_plugin: torchtitan: force_recompute_mm_shapes_by_fqns must be a list of non-empty "
            f"module names, e.g. ['moe.router.gate'], got {describe_value(fqns)}"
        )


def _checkpoint_block(
    block: nn.Module,
    *,
    force_recompute_fqns,
    base_fqn,
    preserve_rng_state: bool,
    early_stop: bool,
    offload: dict,
    saved: list[str] | None,
) -> nn.Module:
    policy, in_units = policy_for_block(
        block, force_recompute_fqns=force_recompute_fqns, base_fqn=base_fqn, offload=offload, saved=saved
    )
    for owner, name, unit in in_units:
        run_in_unit(owner, name, unit)
    return apply_selective_checkpointing(block, policy, preserve_rng_state=preserve_rng_state, early_stop=early_stop)


def _layers(model: nn.Module) -> nn.Module:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Module):
        raise ValueError(
            f"sac_plugin: torchtitan.apply_ac: {type(model).__name__} has no `layers` module; torchtitan "
            "checkpoints the blocks of model.layers (a ModuleDict or ModuleList)"
        )
    return layers


def _check_ac_config(config) -> None:
    """The fields the plugin does not implement must be at their defaults."""
    if getattr(config, "debug", False):
        raise ValueError(
            "sac_plugin: torchtitan: debug=True (torch's checkpoint debug capture) is not supported by "
            "the plugin; set debug=False"
        )
    if getattr(config, "determinism_check", "default") != "default":
        raise ValueError(
            f"sac_plugin: torchtitan: determinism_check={bounded_repr(config.determinism_check)} is not supported; "
            "the plugin runs torch's default check, so leave it 'default'"
        )


def _overridden_save_ops(ac_config, ac=None) -> list[str] | None:
    """The save set of a SelectiveAC subclass that overrides get_save_ops (torchtitan's documented
    way to tune it), in plugin names; None where the class keeps torchtitan's default. `ac` is the
    built policy object where there is one (PluginSelectiveAC.apply); otherwise the config's
    owning class (what config.build() constructs) is asked."""
    owner = type(ac) if ac is not None else getattr(type(ac_config), "_owner", None)
    if owner is None:
        return None
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    if not issubclass(owner, SelectiveAC) or owner.get_save_ops is SelectiveAC.get_save_ops:
        return None
    ac = ac_config.build() if ac is None else ac
    return save_ops_of(ac.get_save_ops())


def apply_ac(
    model: nn.Module,
    ac_config,
    *,
    offloaded_ops=(),
    offload_min_bytes: int = 1 << 20,
    host_memory_limit: int | None = None,
) -> nn.Module:
    """Drop-in for torchtitan's `ac_config.build().apply(model)` on the plugin: checkpoints every
    block of model.layers in place and returns the model.

    ac_config: torchtitan's SelectiveAC.Config (torchtitan's selective AC: see this module's
    table), FullAC.Config (plain full recompute) or None (nothing). Its preserve_rng_state and
    early_stop (False where the config has none, as torchtitan runs) are honoured; debug and
    determinism_check must be at their defaults. Warns once that the collectives torchtitan keeps
    are recomputed.

    offloaded_ops, offload_min_bytes, host_memory_limit: as sac_plugin.Policy takes them; with a
    selective config, the ops of torchtitan's save list named here are held in pinned host memory
    instead of on the device (not aten::mm, which keeps its every-other-call rule).

    A SelectiveAC subclass (the config's owning class) that overrides get_save_ops saves what
    that returns, as torchtitan's policy does: its ops are kept, aten::mm every second call where
    it is among them, and none where it is not.

    Args:
        model: The torchtitan model, whose `layers` are checkpointed.
        ac_config: torchtitan's SelectiveAC.Config, FullAC.Config, or None.
        offloaded_ops: Ops of the save list to hold in pinned host memory instead.
        offload_min_bytes: Outputs smaller than this stay on the device.
        host_memory_limit: Bytes of host memory offloaded outputs may hold at once; None: no limit.

    Returns:
        `model`, its blocks checkpointed.

    Raises:
        TypeError: `model` is not an nn.Module, or `ac_config` is not one of torchtitan's configs.
        ValueError: The model has no `layers`, or the config sets what the plugin does not implement.
    """
    return _apply_ac(
        model,
        ac_config,
        None,
        offloaded_ops=offloaded_ops,
        offload_min_bytes=offload_min_bytes,
        host_memory_limit=host_memory_limit,
    )


def _apply_ac(
    model: nn.Module,
    ac_config,
    ac,
    *,
    offloaded_ops=(),
    offload_min_bytes: int = 1 << 20,
    host_memory_limit: int | None = None,
) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"sac_plugin: torchtitan.apply_ac: model must be a torch.nn.Module, got {describe_value(model)}"
        )
    offload = {
        "offloaded_ops": offloaded_ops,
        "offload_min_bytes": offload_min_bytes,
        "host_memory_limit": host_memory_limit,
    }
    _offloaded_names(offload)  # bad offload arguments are refused before anything changes
    if ac_config is None:
        return model
    kind = _config_kind(ac_config)
    _check_ac_config(ac_config)
    layers = _layers(model)
    preserve = bool(getattr(ac_config, "preserve_rng_state", True))
    early_stop = _early_stop(ac_config)
    if kind == "full" and offloaded_ops:
        raise ValueError(
            "sac_plugin: torchtitan.apply_ac: offloaded_ops needs torchtitan's SelectiveAC.Config; "
            "FullAC.Config recomputes every op, so there is nothing to offload"
        )
    if kind == "full":
        for _, block in layers.named_children():
            apply_selective_checkpointing(block, None, preserve_rng_state=preserve, early_stop=early_stop)
        return model
    fqns = tuple(getattr(ac_config, "force_recompute_mm_shapes_by_fqns", DEFAULT_FORCE_RECOMPUTE_FQNS))
    _check_fqns(fqns)
    saved = _overridden_save_ops(ac_config, ac)
    # Every block is checked before any changes: a refused config leaves the model as it was.
    for layer_id, block in layers.named_children():
        policy_for_block(block, force_recompute_fqns=fqns, base_fqn=f"layers.{layer_id}", offload=offload, saved=saved)
    if saved is None or any(_is_collective(name) for name in saved):
        warnings.warn(COLLECTIVES_WARNING, stacklevel=3)
    for layer_id, block in layers.named_children():
        _checkpoint_block(
            block,
            force_recompute_fqns=fqns,
            base_fqn=f"layers.{layer_id}",
            preserve_rng_state=preserve,
            early_stop=early_stop,
            offload=offload,
            saved=saved,
        )
    return model


def _early_stop(ac_config) -> bool:
    """torchtitan's early stop: its config's `early_stop` where the config has one, else False,
    which torchtitan's wrappers pass to torch's checkpoint (0.3.0 has no such field). The whole
    recompute then runs, so a block's last matmuls run again in backward, as torchtitan's FLOP
    counts expect."""
    return bool(getattr(ac_config, "early_stop", False))


def _config_kind(ac_config) -> str:
    names = [cls.__qualname__ for cls in type(ac_config).__mro__]
    if "SelectiveAC.Config" in names or "PluginSelectiveAC.Config" in names:
        return "selective"
    if "FullAC.Config" in names:
        return "full"
    raise TypeError(
        "sac_plugin: torchtitan.apply_ac: ac_config must be torchtitan's SelectiveAC.Config, FullAC.Config or None "
        f"(MemoryBudgetAC is torch.compile's partitioner, not a per-op policy), got {describe_value(ac_config)}"
    )


def __getattr__(name: str):
    # PluginSelectiveAC subclasses torchtitan's SelectiveAC, so it is built on first use: this
    # module imports without torchtitan.
    if name == "PluginSelectiveAC":
        cls = _plugin_selective_ac()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _plugin_selective_ac():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    class PluginSelectiveAC(SelectiveAC):
        """torchtitan's SelectiveAC, each block checkpointed by the plugin: pass
        PluginSelectiveAC.Config(...) wherever torchtitan takes an activation-checkpoint config
        (its parallelize functions call config.build(...).apply(model))."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(SelectiveAC.Config):
            pass

        def apply(self, model: nn.Module) -> None:
            _apply_ac(model, self.config, self)

        def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
            _check_ac_config(self.config)
            return _checkpoint_block(
                module,
                force_recompute_fqns=tuple(self.config.force_recompute_mm_shapes_by_fqns),
                base_fqn=base_fqn,
                preserve_rng_state=self.config.preserve_rng_state,
                early_stop=_early_stop(self.config),
                offload={},
                saved=_overridden_save_ops(self.config, self),
            )

    PluginSelectiveAC.__module__ = __name__
    return PluginSelectiveAC


def cpu_debug_model(name: str = "llama3", *, n_layers: int | None = None, seed: int = 0) -> nn.Module:
    """torchtitan's debug model `name` ("llama3", "deepseek_v3" or "qwen3_moe"), with SDPA as the
    inner attention, initialised from `seed`.

    torchtitan's language models accept only flex and varlen attention: flex is compiled
    (max-autotune) and varlen needs CUDA, so on CPU each block's inner attention is swapped for
    torchtitan's own ScaledDotProductAttention (causal, as a model called without masks asks).
    n_layers keeps the first n blocks (deepseek_v3: block 0 is dense, the rest MoE).

    Args:
        name: The model: "llama3", "deepseek_v3" or "qwen3_moe".
        n_layers: How many blocks to keep; None keeps them all.
        seed: The seed of the initial weights.

    Returns:
        The model, initialised, on the CPU.

    Raises:
        ValueError: `name` is not one of these models, or `n_layers` is out of range.
    """
    import importlib

    registries = {
        "llama3": ("llama3", "debugmodel"),
        "deepseek_v3": ("deepseek_v3", "debugmodel"),
        "qwen3_moe": ("qwen3", "debugmodel_moe"),
    }
    if name not in registries:
        raise ValueError(
            f"sac_plugin: torchtitan.cpu_debug_model: unknown model {bounded_repr(name)}; "
            f"choose one of {sorted(registries)}"
        )
    package, flavor = registries[name]
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = importlib.import_module(f"torchtitan.models.{package}").model_registry(flavor, attn_backend="flex").model
    if n_layers is not None:
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or not 1 <= n_layers <= len(config.layers):
            raise ValueError(
                f"sac_plugin: torchtitan.cpu_debug_model: n_layers must be an int from 1 to "
                f"{len(config.layers)}, got {describe_value(n_layers)}"
            )
        config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = config.build()
        # torchtitan builds parameters and buffers uninitialised (it builds on the meta device and
        # initialises after sharding), then its trainer calls init_weights: without that call
        # some of them hold whatever memory was there, NaN now and then.
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        return model
