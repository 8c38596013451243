"""Hugging Face transformers models in the tests: enabling transformers' own checkpointing under
either of its names, and the reference a checkpointed model must equal bitwise."""

import copy


def enable_transformers_checkpointing(model, kwargs):
    """transformers 5 renamed gradient_checkpointing_enable (deprecated until v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def reference_for(model_type, model):
    """What the checkpointed model must equal bitwise. GPT-2's gradients differ in the last bits
    under any checkpointing (transformers' own included: up to 6e-8, measured), so its reference is
    transformers' own gradient checkpointing; every other model's is the unmodified model."""
    reference = copy.deepcopy(model)
    if model_type == "gpt2":
        enable_transformers_checkpointing(reference, {"use_reentrant": False})
    return reference
