"""Small models for the tests: every layer opens named units the way real models do."""

import contextlib
import copy

import sac_plugin
import torch
from sac_plugin import _observers, recompute_unit
from torch import nn


class AttnLayer(nn.Module):
    """A layer whose attention unit calls tanh exactly once."""

    def __init__(self, dim=16, dropout=None, nested_unit=False):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = dropout  # None, "before", "inside", "after"
        self.nested_unit = nested_unit

    def _drop(self, x, where):
        return nn.functional.dropout(x, p=0.3, training=self.training) if self.dropout == where else x

    def forward(self, x):
        h = self._drop(x, "before")
        with recompute_unit("attn"):
            q = self.q(h)
            if self.nested_unit:
                with recompute_unit("rope"):
                    q = q * torch.sigmoid(q)
            h = self._drop(torch.tanh(q), "inside")
        h = self.out(h).sin()
        return x + self._drop(h, "after")


class ToyModel(nn.Module):
    def __init__(self, layers=2, dim=16, **layer_kwargs):
        super().__init__()
        self.layers = nn.ModuleList(AttnLayer(dim, **layer_kwargs) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def make_pair(seed=0, policy=None, checkpoint=True, device="cpu", **kwargs):
    """A model and an unmodified deepcopy of it; the first has each layer checkpointed."""
    torch.manual_seed(seed)
    model = ToyModel(**kwargs).to(device)
    reference = copy.deepcopy(model)
    if checkpoint:
        for layer in model.layers:
            sac_plugin.apply_selective_checkpointing(layer, policy)
    return model, reference


def run_step(model, x, seed=1234):
    torch.manual_seed(seed)
    out = model(x)
    loss = (out * out).mean()
    loss.backward()
    return loss.detach()


def assert_same_gradients(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, name
        assert torch.equal(p.grad, q.grad), f"gradient of {name} differs"


@contextlib.contextmanager
def observed_regions():
    """The regions checkpointed calls create inside the block, in order (through the observer seam)."""
    regions = []

    class Regions(_observers.Observer):
        def region_created(self, region):
            regions.append(region)

    with _observers.observe(Regions()):
        yield regions
