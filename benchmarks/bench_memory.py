"""Activation memory: what each policy holds between forward and backward, plugin beside torch's SAC.

    .venv/bin/python benchmarks/bench_memory.py [--dims 256 1024] [--seqs 256 2048]

A GPT-style block (sac_plugin.models.GPTBlock: LayerNorm, qkv + causal SDPA in unit "attn",
GELU MLP in unit "mlp"), checkpointed, batch 1. Bytes are counted the way
sac_plugin.memory.track_activation_memory counts them: the unique storages reachable from
tensors autograd saves outside the checkpointed region (the block's input included), plus the
outputs the region keeps (the plugin's store, or torch's SAC cache), each storage once, whole;
parameters excluded. The plugin must hold no more than torch's SAC with the same policy: the same
bytes, or fewer where torch holds a kept output its recompute never reaches (NOTE: [Kept outputs
the recompute never reaches]).
"""

from __future__ import annotations

import argparse
import json

import sac_plugin
import torch
from sac_plugin.memory import track_activation_memory
from sac_plugin.models import GPTBlock
from sac_plugin.targets import ATTENTION_OPS
from torch.utils.checkpoint import checkpoint

from _common import cached_tensors, torch_sac

MATMULS = ["aten::addmm", "aten::mm"]


def policies():
    attention = ATTENTION_OPS.resolve()
    return {
        "no checkpointing": None,
        "full recompute": sac_plugin.Policy(),
        "attention kept": sac_plugin.Policy(kept_ops=attention),
        "attention + every other matmul": sac_plugin.Policy(kept_ops=attention, every_nth_op={op: 2 for op in MATMULS}),
        "attention + matmuls kept": sac_plugin.Policy(kept_ops=attention | set(MATMULS)),
        "attn unit kept": sac_plugin.Policy(kept_units=["attn"]),
    }


def measure_one(block, x, policy, engine):
    """Bytes held after the forward, and ops recomputed, for one forward+backward."""
    caches = []
    with sac_plugin.audit() as audit, track_activation_memory(block.parameters()) as memory:
        if policy is None:
            out = block(x)
        elif engine == "plugin":
            out = checkpoint(block, x, use_reentrant=False, context_fn=sac_plugin.context_fn(policy))
        else:
            out = checkpoint(block, x, use_reentrant=False, context_fn=torch_sac(policy, caches))
        memory.add_source(lambda: cached_tensors(caches))
        held = memory.bytes()
        out.backward(torch.ones_like(out))
    return held, sum(row.recompute for row in audit.rows())


def run(dims, seqs, heads, device):
    rows = []
    for dim in dims:
        for seq in seqs:
            torch.manual_seed(0)
            block = GPTBlock(dim, heads).to(device)
            x = torch.randn(1, seq, dim, device=device, requires_grad=True)
            baseline = None
            for name, policy in policies().items():
                plugin_bytes, recomputed = measure_one(block, x, policy, "plugin")
                if policy is None:
                    torch_bytes = plugin_bytes
                elif policy.kept_units:
                    torch_bytes = None  # torch's SAC has no units
                else:
                    torch_bytes = measure_one(block, x, policy, "torch")[0]
                baseline = baseline or plugin_bytes
                rows.append(
                    {
                        "dim": dim,
                        "seq": seq,
                        "policy": name,
                        "plugin_bytes": plugin_bytes,
                        "torch_sac_bytes": torch_bytes,
                        "ratio_to_no_checkpointing": plugin_bytes / baseline,
                        "ops_recomputed": recomputed,
                    }
                )
    return rows


def print_report(rows, device):
    print(f"activation memory, GPT block, batch 1, {device}, torch {torch.__version__}")
    print(
        f"{'dim':>5} {'seq':>5}  {'policy':<32}{'plugin MiB':>11}{'torch SAC MiB':>15}{'<= SAC':>7}"
        f"{'ratio':>8}{'recomputed':>12}"
    )
    for r in rows:
        torch_mib = "-" if r["torch_sac_bytes"] is None else f"{r['torch_sac_bytes'] / 2**20:.2f}"
        same = "-" if r["torch_sac_bytes"] is None else ("yes" if r["plugin_bytes"] <= r["torch_sac_bytes"] else "NO")
        print(
            f"{r['dim']:>5} {r['seq']:>5}  {r['policy']:<32}{r['plugin_bytes'] / 2**20:>11.2f}{torch_mib:>15}"
            f"{same:>7}{r['ratio_to_no_checkpointing']:>8.3f}{r['ops_recomputed']:>12}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    rows = run(args.dims, args.seqs, args.heads, torch.device(args.device))
    print_report(rows, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "rows": rows}, f, indent=2)
    mismatched = [r for r in rows if r["torch_sac_bytes"] is not None and r["plugin_bytes"] > r["torch_sac_bytes"]]
    if mismatched:
        raise SystemExit(f"the plugin holds more bytes than torch SAC for {len(mismatched)} policies")


if __name__ == "__main__":
    main()
