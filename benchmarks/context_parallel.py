"""Context parallel: activation memory per rank and step time against sequence length, for cp 1 (one process,
plain full attention), 2 and 4, in one run.

The model is a Llama from a config (4 layers, hidden 256, 8 heads, 4 key-value heads, SDPA attention), one row
per step, float32, SGD. Each degree runs as ``cp`` processes (Gloo on the CPU, NCCL on GPUs) of
``lockstep.Runtime(parallel=lockstep.Parallel(cp=cp))``; rank 0 reports.

- Activation memory: the bytes of the tensors the autograd graph keeps for the backward during one training
  forward (``torch.autograd.graph.saved_tensors_hooks``), counted once per storage, the weights (parameters)
  left out, on rank 0: what a longer
  sequence costs per rank, measured the same way on any device. On a GPU also the peak allocated memory of a
  step (``torch.cuda.max_memory_allocated``), which adds the weights, gradients and the attention's buffers.
- Step time: the median wall time of a step (forward, backward, optimizer) over ``--steps`` steps after one
  warm-up step. On a machine with fewer cores than ``cp`` processes the processes share cores, and the step
  times say so rather than what ``cp`` devices would do.

    python benchmarks/context_parallel.py [--lengths 512,1024,2048] [--degrees 1,2,4] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import lockstep

VOCAB = 1024


def make_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=16384, attn_implementation="sdpa"))


class Rows(torch.utils.data.Dataset):
    def __init__(self, length: int, rows: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def saved_bytes(forward) -> int:
    """Bytes of the activations autograd keeps during ``forward()``: each storage once, weights left out."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not (base.is_leaf and base.requires_grad):  # a weight, or a view of one
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    return sum(storages.values()), loss


def run(cp: int, lengths: list[int], steps: int) -> list[dict]:
    torch.set_num_threads(1)
    rt = lockstep.Runtime(seed=0, parallel=lockstep.Parallel(cp=cp) if cp > 1 else None)
    model = make_model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    rows = []
    for length in lengths:
        times, memory, peak = [], 0, 0.0
        loader = rt.loader(Rows(length, steps + 1), batch_size=1, num_workers=0)
        for index, batch in enumerate(loader):
            if rt.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rt.barrier()
            start = time.perf_counter()
            kept, output = saved_bytes(lambda batch=batch: model(**batch).loss)
            rt.backward(output)
            optimizer.step()
            optimizer.zero_grad()
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated() / 2**20)
            rt.barrier()
            memory = max(memory, kept)
            if index:  # the first step warms up
                times.append(time.perf_counter() - start)
        rows.append({"cp": cp, "length": length, "activation_mib": round(memory / 2**20, 2),
                     "step_s": round(statistics.median(times), 4), "peak_mib": round(peak, 1) if peak else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048")
    parser.add_argument("--degrees", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    results: list[dict] = []
    for cp in (int(n) for n in args.degrees.split(",")):
        results += lockstep.launch(run, nprocs=cp, args=(cp, lengths, args.steps)) if cp > 1 else run(1, lengths,
                                                                                                        args.steps)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{'cp':>3} {'sequence':>9} {'activations/rank MiB':>21} {'vs cp 1':>8} {'step s':>8}"
          + (f" {'peak MiB':>9}" if device == "cuda" else ""))
    whole = {r["length"]: r["activation_mib"] for r in results if r["cp"] == 1}
    for r in results:
        share = f"{r['activation_mib'] / whole[r['length']]:.2f}" if r["length"] in whole else "-"
        print(f"{r['cp']:>3} {r['length']:>9} {r['activation_mib']:>21.2f} {share:>8} {r['step_s']:>8.3f}"
              + (f" {r['peak_mib']:>9.1f}" if device == "cuda" else ""))
    print(json.dumps({"device": device, "torch": torch.__version__, "rows": results}))


if __name__ == "__main__":
    main()
