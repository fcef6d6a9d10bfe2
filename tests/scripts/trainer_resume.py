"""Trainer run with dropout, checkpoints every 3 steps; rank 1 SIGKILLs itself at a chosen step."""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402
from checks import trainer as tc  # noqa: E402

checkpoint_dir, out = sys.argv[1], sys.argv[2]
kill_in_save = sys.argv[3] == "save"  # rank 1 dies inside a checkpoint save instead of at a step
kill_at = -1 if kill_in_save else int(sys.argv[3])
# "one-layout": DDP keeps its first gradient-bucket layout for the whole run (no rebuild), so that a
# resumed run's first step sums the ranks' gradients in the same order as an uninterrupted run's.
strategy = lockstep.DDP(find_unused_parameters=True) if sys.argv[4:] == ["one-layout"] else None
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # an elastic restart: no kill
killed_marker = checkpoint_dir.rstrip("/") + ".killed"  # the rerun that resumes must not die again
if kill_in_save and os.environ.get("RANK") == "1" and not os.path.exists(killed_marker):
    # Rank 1 dies in its second checkpoint save (step 6), while rank 0 writes its shard file.
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data, saves = FileSystemWriter.write_data, []

    def dying_write_data(self, plan, planner):
        saves.append(plan)
        if len(saves) == 2:
            open(killed_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = dying_write_data


class KillAt(lockstep.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == kill_at and trainer.runtime.rank == 1 and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


class EpochLosses(lockstep.Callback):
    def __init__(self):
        self.losses = {}

    def on_train_epoch_end(self, trainer, module):
        self.losses[trainer.current_epoch] = trainer.callback_metrics["train_loss_epoch"]


class StepLosses(lockstep.Callback):
    """The train_loss logged every 4 steps: its window spans the checkpoint at step 6."""

    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.at_step_boundary and trainer.is_logging_step:
            self.losses[trainer.global_step] = trainer.callback_metrics["train_loss"]


losses, step_losses = EpochLosses(), StepLosses()
module = tc.Classifier(dropout=0.3)
trainer = tc.quiet_trainer(max_epochs=3, strategy=strategy, checkpoint_dir=checkpoint_dir, resume="auto",
                           log_every_n_steps=4, callbacks=[
    lockstep.ModelCheckpoint(every_n_steps=3, every_n_epochs=None, save_top_k=2), KillAt(), losses, step_losses])
trainer.fit(module, checks.make_data(103), batch_size=16)
if trainer.is_global_zero:
    torch.save({"weights": checks.flat_weights(module), "steps": trainer.global_step,
                "epoch_losses": losses.losses, "step_losses": step_losses.losses}, out)
