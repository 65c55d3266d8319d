"""fairscale_c.experimental.nn.auto_shard.shard_model: the pieces, run in order, compute what the
model does (outputs and gradients), hold every parameter exactly once and about equal shares of
them; no cut inside a skip connection; untraceable submodules kept whole; the pieces as the
stages of a Pipe; bad input."""

import pytest
import torch
from torch import nn

from fairscale_c.experimental.nn.auto_shard import shard_model


def _run(pieces, *inputs):
    out = pieces[0](*inputs)
    for piece in pieces[1:]:
        out = piece(out)
    return out


def _param_ids(module):
    return {id(p) for p in module.parameters()}


class Residual(nn.Module):
    """x + f(g(x)): the skip spans two layers, so no cut may fall between them."""

    def __init__(self, d):
        super().__init__()
        self.g, self.f = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.f(torch.relu(self.g(x)))


class Gated(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it, so it stays one call."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Residual(d), Gated(d), Residual(d), nn.Linear(d, d)])
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("shift", torch.arange(d, dtype=torch.float32))

    def forward(self, x, bias):
        x = self.embed(x) + bias
        for block in self.blocks:
            x = block(x)
        return (x * self.scale + self.shift).sum(-1), x


@pytest.mark.parametrize("shard_count", [1, 2, 3, 4, 8])
def test_pieces_compute_the_model_and_split_its_parameters(shard_count):
    torch.manual_seed(0)
    model = Net()
    pieces = shard_model(model, shard_count)
    assert 1 <= len(pieces) <= shard_count
    ids = [_param_ids(p) for p in pieces]
    assert set().union(*ids) == _param_ids(model)
    assert sum(len(i) for i in ids) == len(_param_ids(model))  # each parameter in one piece
    x, bias = torch.randn(5, 8), torch.randn(8)
    want = model(x, bias)
    want[0].sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = _run(pieces, x, bias)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got[0].sum().backward()
    for n, p in model.named_parameters():  # the gate's untaken branch has none on both sides
        assert (p.grad is None and grads[n] is None) or torch.equal(p.grad, grads[n]), n


def test_cuts_fall_only_where_one_value_crosses():
    model = Net()
    pieces = shard_model(model, 8)
    for piece in pieces:
        names = {n for n, _ in piece.named_modules()}
        for i, block in enumerate(model.blocks):
            if isinstance(block, Residual):
                inside = {f"blocks.{i}.g", f"blocks.{i}.f"}
                assert not names & inside or inside <= names  # a residual is never split
        if "blocks.1" in names:  # the untraceable block is called whole
            assert any(n.op == "call_module" and n.target == "blocks.1" for n in piece.graph.nodes)
    assert len(pieces) > 1


def test_equal_layers_split_evenly():
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(10)])
    pieces = shard_model(model, 3)
    sizes = [len(list(p.parameters())) // 2 for p in pieces]
    assert sizes == [4, 4, 2]  # a piece ends once it holds more than a third of the parameters
    x = torch.randn(3, 10)
    assert torch.equal(_run(pieces, x), model(x))


def test_pieces_as_pipe_stages():
    from fairscale_c.nn import Pipe

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(6)])
    pieces = shard_model(model, 3)
    pipe = Pipe(nn.Sequential(*pieces), balance=[1] * len(pieces), devices=["cpu"] * len(pieces), chunks=2)
    x = torch.randn(8, 16)
    assert torch.allclose(pipe(x), model(x))


def test_bad_input():
    with pytest.raises(TypeError, match="argument 'model' must be an nn.Module, got list"):
        shard_model([nn.Linear(2, 2)])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="argument 'shard_count' must be an int >= 1"):
            shard_model(nn.Linear(2, 2), bad)
