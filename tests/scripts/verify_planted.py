"""Scripts for `lockstep verify`: argv MODE. tokens: a token-averaged loss given with num_items;
tokens-bug: the same loss averaged per rank without num_items (a planted bug); tokens-bug-ragged: the
same, each rank's batch cut to its own shortest row; tokens-tp: the token
loss on a mesh, ``Parallel(tp=2)``, which one process runs unsplit; tokens-lr: the token loss with a
small learning rate scaled by the world size (a planted bug within 1e-4 of the weights); batchnorm: a
Trainer fit of a model with BatchNorm (each rank normalises with its own rows' statistics)."""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402

mode = sys.argv[1]


def token_data() -> torch.utils.data.TensorDataset:
    """24 sequences of 2 to 12 tokens out of 16, padded to 12 with label -100."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (24, 12), generator=generator)
    lengths = torch.randint(2, 13, (24,), generator=generator)
    labels = tokens.roll(-1, dims=1)
    labels[torch.arange(12)[None, :] >= lengths[:, None]] = -100
    return torch.utils.data.TensorDataset(tokens, labels)


if mode.startswith("tokens"):
    plan = {"2": "colwise", "4": "rowwise"}  # the feed-forward block split over tp
    rt = lockstep.Runtime(seed=0, parallel=lockstep.Parallel(tp=2, tp_plan=plan) if mode == "tokens-tp" else None)
    torch.manual_seed(0)
    if mode == "tokens-tp":
        model = nn.Sequential(nn.Embedding(16, 32), nn.Tanh(), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    else:
        model = nn.Sequential(nn.Embedding(16, 32), nn.Tanh(), nn.Linear(32, 16))
    lr = 1e-4 * rt.world_size if mode == "tokens-lr" else 0.5
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
    for _ in range(3):
        for tokens, labels in rt.loader(token_data(), batch_size=8, shuffle=True, num_workers=0):
            if mode == "tokens-bug-ragged":  # each rank's batch cut to its own shortest row: widths differ by rank
                width = int((labels != -100).sum(dim=1).min())
                tokens, labels = tokens[:, :width], labels[:, :width]
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
            if mode.startswith("tokens-bug"):
                rt.backward(loss)  # the mean over this rank's tokens, averaged over the ranks
            else:
                rt.backward(loss, num_items=(labels != -100).sum())
            optimizer.step()
            optimizer.zero_grad()
else:
    class BatchNormNet(lockstep.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=generator),
                                          torch.randint(0, 4, (64,), generator=generator))
    trainer = lockstep.Trainer(max_epochs=2, loggers=(), enable_progress_bar=False, num_workers=0)
    trainer.fit(BatchNormNet(), data, batch_size=16)
