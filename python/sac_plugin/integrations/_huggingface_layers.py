"""The structure of a transformers model that the Hugging Face integration reads: the model inside
a PEFT model, its model type, the layers transformers checkpoints, and each unit's paths in a
layer, found from its children's classes and names (huggingface.py's module docstring says how)."""

from __future__ import annotations

from torch import nn

from ..targets import KeptCallables, KeptOps, RecomputeTargetMap
from ..units import RecomputeUnit

_NORMS = KeptCallables(["input_layernorm", "post_attention_layernorm"])
# Routing: the experts implementations sort tokens by expert and count them (grouped_mm path), or
# pick the experts hit and their tokens with nonzero (the eager loop).
_ROUTING = KeptOps(["aten::sort", "aten::histc", "aten::nonzero"])
# The config fields by which transformers models declare how many routed experts they have.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")


def _dense(name: str) -> RecomputeTargetMap:
    return RecomputeTargetMap(
        name,
        {
            RecomputeUnit.ATTN: KeptCallables(["self_attn"]),
            RecomputeUnit.MLP: KeptCallables(["mlp"]),
            RecomputeUnit.NORM: _NORMS,
        },
    )


def _unwrapped(model):
    """The transformers model inside a PEFT model (peft's get_base_model(): the model its adapters
    were injected into, so that its layers hold them), told without importing peft; any other
    object as given."""
    if isinstance(model, nn.Module) and type(model).__module__.startswith("peft."):
        get_base_model = getattr(type(model), "get_base_model", None)
        if callable(get_base_model):
            base = get_base_model(model)
            if isinstance(base, nn.Module) and base is not model:
                return base
    return model


def _model_type(model: nn.Module):
    return getattr(getattr(model, "config", None), "model_type", None)


def _class_says(module: nn.Module, *words: str) -> bool:
    name = type(module).__name__.lower()
    return any(word in name for word in words)


def _is_gate(name: str, module: nn.Module) -> bool:
    """A MoE block's router, or the gate that weighs its shared expert."""
    name = name.lower()
    return name in ("gate", "router") or name.endswith("_gate") or _class_says(module, "router", "gate")


def _declares_experts(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    counts = [getattr(config, field, None) for field in _EXPERT_COUNTS]
    return any(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts)


def _is_mlp(module: nn.Module) -> bool:
    """An MLP or feed-forward module by its class name (T5's T5LayerFF, DistilBERT's FFN included)."""
    name = type(module).__name__.lower()
    return _class_says(module, "mlp", "feedforward", "feed_forward", "ffn") or name.endswith("ff")


def _is_moe_block(module: nn.Module) -> bool:
    """A MoE block: it holds an `experts` module, or a router beside modules with parameters
    (JetMoE's mlp: router, input_linear, output_linear)."""
    if isinstance(getattr(module, "experts", None), nn.Module):
        return True
    children = list(module.named_children())
    return any(_is_gate(name, child) for name, child in children) and any(
        not _is_gate(name, child) and next(child.parameters(), None) is not None for name, child in children
    )


def _sublayers(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layer's children, a ModuleList or ModuleDict among them replaced by its items ("layer.0",
    "layer.1": T5's sublayers). A container's own forward never runs, so it can be no unit."""
    found = []
    for name, child in layer.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found.extend((f"{name}.{item_name}", item) for item_name, item in child.named_children())
        else:
            found.append((name, child))
    return found


def _layer_paths(layer: nn.Module, moe: bool) -> dict[RecomputeUnit, list[str]]:
    """Each unit's paths in one layer, from its children's classes and names; a unit the layer
    lacks is absent."""
    children = _sublayers(layer)
    attention = [name for name, child in children if _class_says(child, "attention")]
    norms = [name for name, child in children if name not in attention and _class_says(child, "norm")]
    # An attention module can hold experts of its own (JetMoE's mixture of attention heads): it is
    # the attention, never the MoE block.
    moe_blocks = [(name, child) for name, child in children if moe and name not in attention and _is_moe_block(child)]
    gates = []
    if moe_blocks:
        mlp = []
        for block_name, block in moe_blocks:
            for name, child in block.named_children():
                if _is_gate(name, child):
                    gates.append(f"{block_name}.{name}")
                elif next(child.parameters(), None) is not None:
                    mlp.append(f"{block_name}.{name}")
        # An MLP beside the MoE block runs on every token (Granite's shared_mlp): it is MLP too.
        blocks = {name for name, _ in moe_blocks}
        mlp.extend(name for name, child in children if name not in attention and name not in blocks and _is_mlp(child))
    else:
        mlp = [name for name, child in children if name not in attention and _is_mlp(child)]
        if not mlp:
            # No module says it is the MLP (BERT: intermediate, output): the layer's other
            # children with parameters are.
            mlp = [
                name
                for name, child in children
                if name not in attention and name not in norms and next(child.parameters(), None) is not None
            ]
    paths = {
        RecomputeUnit.ATTN: attention,
        RecomputeUnit.MLP: mlp,
        RecomputeUnit.MOE_GATE: gates,
        RecomputeUnit.NORM: norms,
    }
    return {unit: found for unit, found in paths.items() if found}


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)
