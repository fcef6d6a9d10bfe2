"""A Ray user's own driver: TorchTrainer(train_loop_per_worker=train) where train is a plain lockstep
Runtime loop (nothing in it names Ray), on the cluster of RAY_ADDRESS with WORKERS workers. Rank 0's
worker saves the weights, the world size and the node count to OUT."""

import os
import sys

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out, workers, storage = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def train(config):
    sys.path.insert(0, config["tests"])
    import lockstep
    from checks import dist as checks

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    weights = checks.train_lockstep(rt, checks.make_data(103), 16, epochs=2, shuffle=True)
    if rt.is_global_zero:
        torch.save({"weights": weights, "world_size": rt.world_size, "num_nodes": rt.num_nodes,
                    "launcher": rt.env.launcher}, config["out"])


ray.init()
TorchTrainer(train, train_loop_config={"tests": TESTS, "out": out},
             scaling_config=ScalingConfig(num_workers=workers),
             run_config=RunConfig(storage_path=storage, name="own")).fit()
