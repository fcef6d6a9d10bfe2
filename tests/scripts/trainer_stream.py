"""A Trainer fit on a Hugging Face stream without __len__ (2 shards), checkpointed every 3 steps,
with a CSV and a JSON-lines logger; rank 0 SIGKILLs itself after step ``kill_at`` (-1: never).

argv: checkpoint_dir, out (weights and steps, written by rank 0 at the end), kill_at, variant:
"workers" (2 loader workers), "state" (no workers: the stream continues from its own state) or
"shuffle" (a shuffle buffer, no workers: the stream's own state would be used if it restored its
buffer)."""

import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import datasets  # noqa: E402

import lockstep  # noqa: E402
from checks import trainer as tc  # noqa: E402

checkpoint_dir, out, kill_at, variant = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]


class StreamClassifier(tc.Classifier):
    def training_step(self, batch, batch_idx):
        self.seen.append(batch["index"])
        return F.cross_entropy(self(batch["x"]), batch["y"])


class KillAt(lockstep.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == kill_at and trainer.runtime.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)


generator = torch.Generator().manual_seed(0)
x, y = torch.randn(100, 8, generator=generator), torch.randint(0, 4, (100,), generator=generator)
table = datasets.Dataset.from_dict({"index": list(range(100)), "x": x.tolist(), "y": y.tolist()}).with_format("torch")
stream = table.to_iterable_dataset(num_shards=2)
if variant == "shuffle":
    stream = stream.shuffle(seed=3, buffer_size=30)
trainer = tc.quiet_trainer(max_steps=24, checkpoint_dir=checkpoint_dir, resume="auto", log_every_n_steps=2,
                           loggers=("csv", "jsonl"), num_workers=2 if variant == "workers" else 0,
                           callbacks=[KillAt(),
                                      lockstep.ModelCheckpoint(every_n_steps=3, every_n_epochs=1, save_top_k=-1)])
module = StreamClassifier()
module.seen = []
trainer.fit(module, stream, batch_size=10)
seen = trainer.runtime.all_gather(torch.cat(module.seen))
if trainer.runtime.is_global_zero:
    torch.save({"weights": tc.checks.flat_weights(module), "seen": seen, "epoch": trainer.current_epoch}, out)
