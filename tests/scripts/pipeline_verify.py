"""A Llama on pipeline stages (Parallel(pp=2)) trained through rt.forward_backward, for `lockstep verify`.
argv[1]: "ok", "bug" (the loss is scaled by the rank that computes it: the last stage's differs), or "tanh" (a
model whose forward applies tanh between its blocks: refused on stages)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import hf as hc  # noqa: E402
from checks import mesh as mc  # noqa: E402
from checks import pipeline as pc  # noqa: E402

rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy="fsdp",
                      parallel=lockstep.Parallel(pp=2, pp_schedule="Interleaved1F1B"))
model = pc.NotAChain("tanh") if sys.argv[1] == "tanh" else pc.llama()
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
scale = 1.0 + 0.5 * rt.rank if sys.argv[1] == "bug" else 1.0
loader = rt.loader(mc.Rows(32), batch_size=8, collate_fn=pc.collate, num_workers=0)
for _ in range(3):
    for batch in loader:
        rt.forward_backward(model, batch, lambda output, rows: pc.token_loss(output, rows) * scale,
                            num_items=hc.valid_tokens)
        rt.clip_grad_norm_(model, optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad()
