"""A Trainer run that is slow enough to be preempted; rank 0 writes MARKER once step 5 is done.
TRAINER_DROPOUT sets the model's dropout (default 0.3)."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402
from checks import trainer as tc  # noqa: E402

checkpoint_dir, out, marker = sys.argv[1], sys.argv[2], sys.argv[3]


class Slow(lockstep.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        time.sleep(0.3)
        if trainer.global_step == 5 and trainer.is_global_zero and not os.path.exists(marker):
            open(marker, "w").write(os.environ.get("SLURM_JOB_ID", ""))


module = tc.Classifier(dropout=float(os.environ.get("TRAINER_DROPOUT", "0.3")))
# DDP keeps one gradient-bucket layout (no rebuild), so the resumed run's first step sums as the
# uninterrupted run's does: the 4-rank result is then bitwise equal.
trainer = tc.quiet_trainer(max_epochs=3, checkpoint_dir=checkpoint_dir, resume="auto", callbacks=[Slow()],
                           strategy=lockstep.DDP(find_unused_parameters=True))
trainer.fit(module, checks.make_data(103), batch_size=16)
if trainer.is_global_zero:
    torch.save({"weights": checks.flat_weights(module), "steps": trainer.global_step,
                "restarts": os.environ.get("SLURM_RESTART_COUNT", "0")}, out)
