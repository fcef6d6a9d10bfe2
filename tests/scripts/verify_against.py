"""A small Llama (transformers, from a config) for `lockstep verify --against`: its layout comes from the
launcher (`lockstep run --parallel tp=2`, or none). argv MODE: ok, or tp-scale (a bug planted in
model.layers.1.mlp: its output scaled by the tensor-parallel rank, which only a tensor-parallel run has)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import hf as hc  # noqa: E402
from checks import mesh as mc  # noqa: E402
from checks import pipeline as pc  # noqa: E402

rt = lockstep.Runtime(seed=0)
model = pc.llama()
if sys.argv[1] == "tp-scale":
    tp_rank = rt.rank % rt.tensor_parallel_size
    model.model.layers[1].mlp.register_forward_hook(lambda _m, _a, out: out * (1.0 + 0.25 * tp_rank))
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
for batch in rt.loader(mc.Rows(32), batch_size=8, collate_fn=pc.collate, num_workers=0):
    rt.backward(pc.token_loss(model(input_ids=batch["input_ids"]).logits, batch), num_items=hc.valid_tokens(batch))
    optimizer.step()
    optimizer.zero_grad()
