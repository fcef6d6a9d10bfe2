"""lockstep on a dp2 x tp2 mesh against a hand-written torch loop on the same mesh, in one run.

Four CPU processes (Gloo) train a Llama-style decoder (``transformers``, from a config) with
AdamW. The hand-written loop does what a torchtitan-style script does: ``init_device_mesh``,
``parallelize_module`` with the model's plan, ``fully_shard`` per layer and at the root, and
each data-parallel rank slicing its share of the global batch by hand. The two loops alternate,
``--steps`` steps at a time, for ``--rounds`` rounds in the same processes; the ratio is of the
median steps/s.

    python benchmarks/mesh_overhead.py --rounds 7 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(config)


def worker(rounds: int, steps: int, batch: int, length: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import lockstep
    from lockstep.runtime.parallel.tensor_parallel import plan_of, resolve_plan

    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 2048, (batch * steps * rounds * 2, length), generator=generator)

    rt = lockstep.Runtime(accelerator="cpu", strategy="fsdp", parallel=lockstep.Parallel(tp=2), seed=0)
    ours = _model()
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    ours, ours_opt = rt.setup(ours, ours_opt)
    loader = rt.loader(torch.utils.data.TensorDataset(data), batch_size=batch, num_workers=0)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plain = _model()
    parallelize_module(plain, mesh["tp"], resolve_plan(plain, plan_of(plain, None), 2))
    for layer in plain.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(plain, mesh=mesh["dp"])
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    dp_rank, per_rank = dist.get_rank() // 2, batch // 2

    def ours_steps(batches) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            (tokens,) = next(batches)
            rt.backward(ours(input_ids=tokens, labels=tokens).loss)
            ours_opt.step()
            ours_opt.zero_grad()
        return steps / (time.perf_counter() - start)

    def plain_steps(position: int) -> float:
        start = time.perf_counter()
        for step in range(steps):
            first = (position + step) * batch + dp_rank * per_rank
            tokens = data[first:first + per_rank]
            plain(input_ids=tokens, labels=tokens).loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()
        return steps / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {"lockstep": [], "hand-written": []}
    batches = iter(loader)
    for round_ in range(rounds):
        order = ("lockstep", "hand-written") if round_ % 2 == 0 else ("hand-written", "lockstep")
        for name in order:
            dist.barrier()
            rate = ours_steps(batches) if name == "lockstep" else plain_steps(round_ * steps)
            rates[name].append(rate)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    import lockstep

    rates = lockstep.launch(worker, nprocs=4, args=(args.rounds, args.steps, args.batch, args.length))
    ours, plain = statistics.median(rates["lockstep"][1:]), statistics.median(rates["hand-written"][1:])
    print(f"dp2 x tp2 on 4 CPU processes, global batch {args.batch} x {args.length}, {args.rounds} rounds x "
          f"{args.steps} steps (the first round is warm-up)")
    print(f"hand-written: {plain:.2f} steps/s   lockstep: {ours:.2f} steps/s   ratio {ours / plain:.3f}")
    print("per round, lockstep / hand-written:",
          " ".join(f"{a / b:.2f}" for a, b in zip(rates["lockstep"], rates["hand-written"], strict=True)))


if __name__ == "__main__":
    main()
