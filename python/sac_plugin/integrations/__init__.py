"""Adapters for the frameworks users already train with.

- `huggingface`: target maps for transformers' decoder layers, chosen from `config.model_type`,
  and `apply_recompute_config(hf_model, config)` that finds the layers itself.
- `torchtitan`: torchtitan's selective AC (save list, every second mm, forced recompute of the
  MoE router gate) as a plugin policy, and a drop-in for its activation-checkpointing policies.

Neither imports its framework at import time: transformers and torchtitan are optional.
"""

__all__ = ["huggingface", "torchtitan"]
