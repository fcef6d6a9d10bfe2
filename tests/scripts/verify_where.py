"""A token model of three blocks for `lockstep verify`'s `first difference:` line, with a bug planted in block 1.
argv: MODE LAYOUT.

MODE: ok; rank-scale (block 1's MLP scales its output by the rank); batch-stats (block 1 centres its normalised
input on this rank's rows' mean before its MLP); dropout (block 1's dropout has p=0.5); token-mean (the loss is
each rank's own token mean, without num_items); grad-hook (a gradient hook on block 1's output scales the
gradient by the rank: the forward agrees, the backward does not); grad-hook-inside (the same on block 1's MLP's
output, inside the block's forward, registered after the trace's own hook on it); grad-edit (block 1's first
weight's gradient multiplied by the world size after the backward, as a sum over the ranks would be, before the
optimizer step);
unseeded (block 1's MLP adds noise from a generator no seed fixes: two runs of one layout differ).

LAYOUT: ddp; fsdp; tp (Parallel(tp=2), the MLPs split over the tensor-parallel peers: dp2 x tp2 on 4 processes);
pp (Parallel(pp=2): embed and blocks 0-1 on the first stage, block 2 and the head on the second: pp2 x dp2 on 4
processes, through rt.forward_backward)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402

mode, where = sys.argv[1], sys.argv[2]
WIDTH, VOCAB = 16, 12


class Mlp(nn.Module):
    def __init__(self, planted: bool) -> None:
        super().__init__()
        self.up, self.down, self.planted = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.tanh(self.up(x)))
        if self.planted and mode == "rank-scale":
            h = h * (1.0 + 0.25 * (dist.get_rank() if dist.is_initialized() else 0))
        if self.planted and mode == "unseeded":  # a draw no seed fixes: two runs of one layout differ
            noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
            h = h + 1e-2 * torch.randn(h.shape, generator=noise)
        return h


class Block(nn.Module):
    def __init__(self, planted: bool) -> None:
        super().__init__()
        self.planted = planted
        self.norm, self.mlp = nn.LayerNorm(WIDTH), Mlp(planted)
        self.drop = nn.Dropout(0.5 if planted and mode == "dropout" else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.planted and mode == "batch-stats":
            h = h - h.mean(dim=0, keepdim=True)  # a statistic over this rank's rows only
        mixed = self.mlp(h)
        if self.planted and mode == "grad-hook-inside" and mixed.requires_grad:  # on a submodule's output, in here
            rank = dist.get_rank() if dist.is_initialized() else 0
            mixed.register_hook(lambda grad: grad * (1.0 + 0.25 * rank))
        out = x + self.drop(mixed)
        if self.planted and mode == "grad-hook" and out.requires_grad:  # the backward alone changed, per rank
            rank = dist.get_rank() if dist.is_initialized() else 0
            out.register_hook(lambda grad: grad * (1.0 + 0.25 * rank))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(planted=i == 1) for i in range(3)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def token_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (32, 10), generator=generator)
    lengths = torch.randint(2, 11, (32,), generator=generator)
    labels = tokens.roll(-1, dims=1)
    labels[torch.arange(10)[None, :] >= lengths[:, None]] = -100
    return torch.utils.data.TensorDataset(tokens, labels)


plan = {f"blocks.{i}.mlp.{name}": style for i in range(3) for name, style in (("up", "colwise"), ("down", "rowwise"))}
layout = {"tp": {"parallel": lockstep.Parallel(tp=2, tp_plan=plan)}, "ddp": {"strategy": "ddp"},
          "fsdp": {"strategy": "fsdp"}, "pp": {"parallel": lockstep.Parallel(pp=2)}}[where]
rt = lockstep.Runtime(seed=0, **layout)
torch.manual_seed(0)
model = Net()
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
def token_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=-100)


def tokens_of(batch) -> torch.Tensor:
    return (batch[1] != -100).sum()


for _ in range(2):
    for batch in rt.loader(token_data(), batch_size=8, shuffle=True, num_workers=0):
        if rt.pipeline_parallel_size > 1:
            rt.forward_backward(model, batch, token_loss, num_items=None if mode == "token-mean" else tokens_of)
        elif mode == "token-mean":
            rt.backward(token_loss(model(batch[0]), batch))
        else:
            rt.backward(token_loss(model(batch[0]), batch), num_items=tokens_of(batch))
        if mode == "grad-edit":  # a gradient changed by hand after its reduction (summed, not averaged)
            lockstep.unwrap(model).blocks[1].mlp.up.weight.grad.mul_(rt.world_size)
        optimizer.step()
        optimizer.zero_grad()
