"""lockstep.launch on 2 processes whose loaders have persistent workers.

argv: MODE [FOLDER]. MODE ok: return; raise: rank 1 raises while its workers run; wait: each rank
writes FOLDER/RANK.pid once its workers run, then waits to be stopped; squares: the loader reads
a Dataset class defined in this script, and rank 0 prints what every rank read, in dataset order.
"""

import os
import sys
import time

import torch
from torch.utils.data import TensorDataset

import lockstep


class Squares(torch.utils.data.Dataset):
    """Defined in the script, as notebooks and scripts define datasets."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index * index])


def work(mode: str, folder: str) -> int:
    rt = lockstep.Runtime(accelerator="cpu")
    if mode == "squares":
        loader = rt.loader(Squares(), batch_size=4, num_workers=2)
        return rt.gather([batch for batch in loader]).flatten().tolist()
    loader = rt.loader(TensorDataset(torch.arange(64.0)), batch_size=8, num_workers=2)
    seen = sum(len(x) for (x,) in loader)
    if mode == "raise" and rt.rank == 1:
        raise RuntimeError("rank 1 fails with its loader workers running")
    if mode == "wait":
        with open(os.path.join(folder, f"{rt.rank}.tmp"), "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(os.path.join(folder, f"{rt.rank}.tmp"), os.path.join(folder, f"{rt.rank}.pid"))
        time.sleep(120)
    return seen


if __name__ == "__main__":
    mode, folder = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    print("samples of rank 0:", lockstep.launch(work, nprocs=2, args=(mode, folder)))
