"""A Trainer run for elastic jobs: checkpoints every 3 steps, resumes from the latest, paced so that a
node can be killed mid-run. Arguments: CHECKPOINT_DIR OUT PROGRESS [EPOCHS (3)]. Rank 0 writes the
global step to PROGRESS after each step, and at the end the weights, the steps and the world size to
OUT."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402
from checks import trainer as tc  # noqa: E402

checkpoint_dir, out, progress = sys.argv[1:4]
epochs = int(sys.argv[4]) if len(sys.argv) > 4 else 3


class Pace(lockstep.Callback):
    """0.3 s a step; with ELASTIC_HOLD_AT=STEP a job of 2 processes waits at that step (at most 90 s) for a node
    that joins, whose arrival restarts it on 4 (a joining node's start outlasts the run on a busy machine)."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            with open(progress, "a") as handle:
                handle.write(f"{trainer.global_step} {trainer.runtime.world_size} {time.time():.1f}\n")
        time.sleep(0.3)
        hold = int(os.environ.get("ELASTIC_HOLD_AT", "0"))
        if trainer.global_step == hold and trainer.runtime.world_size == 2:
            time.sleep(90)


module = tc.Classifier()
trainer = tc.quiet_trainer(max_epochs=epochs, checkpoint_dir=checkpoint_dir, resume="auto", callbacks=[
    lockstep.ModelCheckpoint(every_n_steps=3, every_n_epochs=None, save_top_k=2), Pace()])
trainer.fit(module, checks.make_data(103), batch_size=16)
if trainer.is_global_zero:
    torch.save({"weights": checks.flat_weights(module), "steps": trainer.global_step,
                "world_size": trainer.runtime.world_size}, out)
