"""CUDA: the same guarantees on the GPU, where backward (and so the recompute) runs on the
autograd engine's device thread. Skipped, with the reason, where torch has no CUDA device."""

import copy
import warnings

import pytest
import sac_plugin
import torch
from sac_plugin import Policy
from sac_plugin.models import Llama
from sac_plugin.targets import ATTENTION_OPS
from torch.utils.checkpoint import checkpoint
from support.toy_models import assert_same_gradients, make_pair, run_step

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)


@pytest.mark.parametrize("policy", [Policy(kept_units=["attn"]), Policy(kept_ops=["aten::addmm", "aten::tanh"])])
@pytest.mark.parametrize("dropout", [None, "inside", "after"])
def test_cuda_gradients_bitwise_equal_with_rng_preserved(policy, dropout):
    model, reference = make_pair(policy=policy, device="cuda", dropout=dropout)
    x = torch.randn(8, 16, device="cuda")
    with sac_plugin.audit() as audit:
        loss = run_step(model, x)
    assert torch.equal(loss, run_step(reference, x))
    assert_same_gradients(model, reference)
    assert audit.hits("aten::tanh") == 2
    # The recompute ran on the autograd device thread, which inherits the audit's key set.
    assert audit.count("aten::tanh_backward", phase="backward") == 2


def test_cuda_flash_attention_kept_without_dropout():
    torch.manual_seed(0)
    model = Llama(dim=256, heads=4, layers=2, seq=128).cuda().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    sac_plugin.apply_recompute_config(model, sac_plugin.RecomputeConfig(kept_units=["attn"]))
    tokens = torch.randint(512, (2, 128), device="cuda")
    with sac_plugin.audit() as audit:
        model.loss(tokens, tokens).backward()
    reference.loss(tokens, tokens).backward()
    kept_attention = sum(audit.hits(op) for op in ATTENTION_OPS.resolve())
    assert kept_attention == 2
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        # Attention backward kernels may accumulate in a different order run to run.
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2, msg=name)


def test_cuda_state_does_not_leak_to_the_device_thread():
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    seen = []

    def fn(v):
        seen.append(repr(torch._C._dispatch_tls_local_include_set()))
        return torch.tanh(v)

    before = repr(torch._C._dispatch_tls_local_include_set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint(
            fn, x, use_reentrant=False, context_fn=sac_plugin.context_fn(Policy(kept_ops=["aten::tanh"]))
        ).sum().backward()
    assert len(seen) == 2 and all("Fake" in s for s in seen)
    assert repr(torch._C._dispatch_tls_local_include_set()) == before


def test_cuda_offloaded_outputs_leave_the_device_and_gradients_equal_keeping():
    # NOTE: [Offloading kept outputs]: the held device bytes drop by the bytes copied to the host,
    # and the gradients are those of keeping the same calls, bitwise.
    def run(policy):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[
                torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
                for _ in range(2)
            ]
        ).cuda()
        for layer in model:
            sac_plugin.apply_selective_checkpointing(layer, policy)
        x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
        # The first step learns which kept outputs the recompute never reaches (each layer's last
        # addmm: NOTE: [Kept outputs the recompute never reaches]); the second is measured.
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        copied_before = sac_plugin.memory.offload_stats()["bytes_to_host"]
        before = torch.cuda.memory_allocated()
        loss = model(x).square().mean()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        copied = sac_plugin.memory.offload_stats()["bytes_to_host"] - copied_before
        with sac_plugin.audit() as audit:
            loss.backward()
        torch.cuda.synchronize()
        return held, copied, audit.hits("aten::addmm"), [p.grad for p in model.parameters()] + [x.grad]

    kept_held, kept_copied, kept_hits, kept_grads = run(Policy(kept_ops=["aten::addmm"]))
    offload_held, offload_copied, offload_hits, offload_grads = run(Policy(offloaded_ops=["aten::addmm"]))
    assert kept_copied == 0 and offload_copied == kept_held - offload_held == 2 * 2048 * 4096 * 4
    assert offload_hits == kept_hits == 2  # each layer's last addmm runs after its last save
    assert all(torch.equal(a, b) for a, b in zip(kept_grads, offload_grads))
