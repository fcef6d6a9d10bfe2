"""Modules and rank functions for the Trainer tests (importable by spawned workers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from checks import dist as checks  # noqa: F401 - re-exported for tests


class Classifier(lockstep.Module):
    def __init__(self, dropout: float = 0.0, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 4))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def quiet_trainer(**kwargs) -> lockstep.Trainer:
    options = dict(accelerator="cpu", enable_progress_bar=False, enable_throughput_monitor=False, loggers=(),
                   num_workers=0, seed=0)
    options.update(kwargs)
    return lockstep.Trainer(**options)


def fit_weights(epochs: int = 2) -> torch.Tensor:
    module = Classifier()
    quiet_trainer(max_epochs=epochs).fit(module, checks.make_data(103), batch_size=16)
    return checks.flat_weights(module)


def runtime_loop_weights(epochs: int = 2) -> torch.Tensor:
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    module = Classifier()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model, optimizer = rt.setup(module, optimizer)
    loader = rt.loader(checks.make_data(103), batch_size=16, shuffle=True, num_workers=0)
    for _ in range(epochs):
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    return checks.flat_weights(module)


def validation_metrics() -> dict[str, float]:
    module = Classifier()
    trainer = quiet_trainer()  # evaluation only: no stopping rule needed
    return trainer.validate(module, checks.make_data(1001), batch_size=30)


def early_stopping_step() -> tuple[int, int | None, int]:
    stopper = lockstep.EarlyStopping(monitor="val_loss", patience=2)
    module = Classifier(lr=0.0)  # never improves: stops after 1 + patience validations
    trainer = quiet_trainer(max_epochs=50, callbacks=[stopper])
    trainer.fit(module, checks.make_data(64), checks.make_data(40, seed=1), batch_size=16)
    return trainer.global_step, stopper.stopped_at_step, trainer.current_epoch


def count_host_syncs(steps: int = 100) -> dict[str, int]:
    """Host-synchronising calls made by fit over ``steps`` steps with log_every_n_steps=50."""
    import torch.distributed as dist

    counts = {"item": 0, "tolist": 0, "all_reduce": 0, "all_gather_object": 0}
    originals = {"item": torch.Tensor.item, "tolist": torch.Tensor.tolist,
                 "all_reduce": dist.all_reduce, "all_gather_object": dist.all_gather_object}

    def counting(name):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return wrapper

    module = Classifier()
    trainer = quiet_trainer(max_steps=steps, log_every_n_steps=50)
    data = checks.make_data(16 * steps)  # one epoch of exactly `steps` steps
    torch.Tensor.item, torch.Tensor.tolist = counting("item"), counting("tolist")
    dist.all_reduce, dist.all_gather_object = counting("all_reduce"), counting("all_gather_object")
    try:
        trainer.fit(module, data, batch_size=16)
    finally:
        torch.Tensor.item, torch.Tensor.tolist = originals["item"], originals["tolist"]
        dist.all_reduce, dist.all_gather_object = originals["all_reduce"], originals["all_gather_object"]
    counts["steps"] = trainer.global_step
    return counts


def predictions() -> torch.Tensor:
    module = Classifier()
    return quiet_trainer().predict(module, checks.make_data(1001), batch_size=30)


def accumulation_matches_big_batch() -> float:
    small = Classifier()
    quiet_trainer(max_epochs=2, accumulate_grad_batches=2).fit(small, checks.make_data(96), batch_size=8)
    big = Classifier()
    quiet_trainer(max_epochs=2).fit(big, checks.make_data(96), batch_size=16)
    return float((checks.flat_weights(small) - checks.flat_weights(big)).abs().max())


def resume_from_unshared_folders(base: str) -> str:
    """Each rank gets its own checkpoint folder under the same name, as on nodes without a shared file system."""
    import os

    own = f"{base}/rank{lockstep.DistEnv.from_environ().rank}"
    os.makedirs(own)
    os.chdir(own)
    folder = "checkpoints"
    first = quiet_trainer(max_epochs=1, checkpoint_dir=folder,
                          callbacks=[lockstep.ModelCheckpoint(every_n_steps=3, every_n_epochs=None)])
    first.fit(Classifier(), checks.make_data(64), batch_size=16)  # rank 0 writes into its folder only
    again = quiet_trainer(max_epochs=2, checkpoint_dir=folder, resume="auto")
    try:
        again.fit(Classifier(), checks.make_data(64), batch_size=16)
    except lockstep.CheckpointError as error:
        return str(error)
    return "resumed"


def fit_with_settings_by_rank() -> str:
    """A fit whose max_steps and gradient clipping depend on the rank: refused before the first batch."""
    rank = lockstep.DistEnv.from_environ().rank
    trainer = quiet_trainer(max_steps=4 + 2 * rank, gradient_clip_val=1.0 if rank else None)
    try:
        trainer.fit(Classifier(), checks.make_data(64), batch_size=16)
    except lockstep.ConfigError as error:
        return str(error)
    return f"trained {trainer.global_step} steps"


def warnings_of_a_fit(folder: str) -> list[str]:
    """Every warning a normal fit (validation, checkpoints, loggers, progress bar) raises on this rank."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer(max_epochs=2, checkpoint_dir=folder, resume="auto", log_every_n_steps=2,
                                loggers=("csv", "jsonl", "tensorboard"), enable_progress_bar=True,
                                enable_throughput_monitor=True, callbacks=[lockstep.ModelCheckpoint()])
        module = Classifier()
        trainer.fit(module, checks.make_data(96), checks.make_data(40, seed=1), batch_size=16)
        trainer.validate(module, checks.make_data(40, seed=1), batch_size=16)
        trainer.predict(module, checks.make_data(40, seed=1), batch_size=16)
    return [f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}" for w in caught]


class MappingBatches(Classifier):
    """Batches arrive as a UserDict, as transformers' DataCollatorWithPadding makes them."""

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["x"]), batch["y"])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch["x"]), batch["y"]))


def collate_to_mapping(rows):
    return checks.Encoding({"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])})


class BatchNormClassifier(Classifier):
    """Each rank's BatchNorm statistics follow its own share of the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


def batchnorm_predictions(folder: str) -> dict:
    """Fit with checkpoints, then predict: every rank's rows and the last checkpoint's path."""
    module = BatchNormClassifier()
    trainer = quiet_trainer(max_epochs=2, checkpoint_dir=folder)
    trainer.fit(module, checks.make_data(64), batch_size=16)
    rows = trainer.predict(module, checks.make_data(40, seed=1), batch_size=8)
    metrics = trainer.validate(module, checks.make_data(40, seed=1), batch_size=8)
    return {"rows": rows, "val_loss": metrics["val_loss"], "checkpoint": str(trainer.callbacks[0].best_model_path)}


def batchnorm_model_from(folder: str) -> nn.Module:
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    model = rt.setup(BatchNormClassifier())
    rt.load(folder, {"model": model})
    return lockstep.unwrap(model).eval()


class Regressor(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_logging(tmp_path, module: lockstep.Module | None = None, max_steps: int = 6) -> tuple:
    """Fit ``max_steps`` (a ``Regressor`` by default), logging every 2; the Trainer, the throughput
    windows it logged, its throughput monitor."""
    from lockstep.train.progress import ThroughputMonitor

    logged: list[dict] = []
    trainer = lockstep.Trainer(accelerator="cpu", max_steps=max_steps, log_every_n_steps=2, enable_progress_bar=False,
                               loggers=(), num_workers=0, log_dir=tmp_path)
    original = trainer.log_metrics
    trainer.log_metrics = lambda metrics: (logged.append(dict(metrics)), original(metrics))[1]  # type: ignore
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,)))
    trainer.fit(module if module is not None else Regressor(), data, batch_size=16)
    monitor = next(c for c in trainer.callbacks if isinstance(c, ThroughputMonitor))
    return trainer, [m for m in logged if "samples_per_s" in m], monitor


def reduced_metrics(same_names: bool) -> list[dict[str, float]]:
    """``self.log`` sums reduced over the ranks, three times: every rank logs ``loss`` (rank r the
    value r + 1, weight 2); with ``same_names=False`` each rank then also logs a name of its own (value
    r + 1, weight 3) before the second reduce, and only rank 0 logs anything before the third."""
    from lockstep.train.metrics import MetricStore

    rt = lockstep.Runtime(accelerator="cpu")
    store = MetricStore()
    value = float(rt.rank + 1)
    store.add("loss", torch.tensor(value * 2, dtype=torch.float64), 2.0)
    reduced = [store.reduce(rt)]
    if not same_names:
        store.add(f"only_on_{rt.rank}", torch.tensor(value * 3, dtype=torch.float64), 3.0)
    reduced.append(store.reduce(rt))
    store.reset()
    if rt.rank == 0:
        store.add("loss", torch.tensor(4.0, dtype=torch.float64), 1.0)
    reduced.append(store.reduce(rt))
    rt.close()
    return reduced


class MaskedRegression(lockstep.Module):
    """Per-token errors under a mask: a token-weighted value (``batch_size=`` the token count, a tensor
    and an int) beside a per-sample mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def validation_step(self, batch, batch_idx):
        x, y, mask = batch
        err = (self.lin(x).squeeze(-1) - y) ** 2 * mask
        self.log("val_tok", err.sum() / mask.sum(), batch_size=mask.sum())
        self.log("val_tok_int", err.sum() / mask.sum(), batch_size=int(mask.sum()))
        self.log("val_mse", (err.sum(1) / mask.sum(1)).mean())


def masked_rows(samples: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x, y = torch.randn(samples, 6, 3, generator=g), torch.randn(samples, 6, generator=g)
    lengths = torch.randint(1, 7, (samples,), generator=g)
    return x, y, (torch.arange(6)[None, :] < lengths[:, None]).float()


def masked_reference(samples: int = 5) -> dict[str, float]:
    """By hand, over the whole data at once."""
    x, y, mask = masked_rows(samples)
    with torch.no_grad():
        err = (MaskedRegression().lin(x).squeeze(-1) - y) ** 2 * mask
    tok = float(err.sum() / mask.sum())
    return {"val_tok": tok, "val_tok_int": tok, "val_mse": float((err.sum(1) / mask.sum(1)).mean())}


class _MaskedStream(torch.utils.data.IterableDataset):
    def __init__(self, samples: int) -> None:
        self.rows = masked_rows(samples)

    def __iter__(self):
        yield from zip(*self.rows, strict=True)


def masked_validation(strategy: str, stream: bool, samples: int = 5, batch_size: int = 3) -> dict[str, float]:
    """Validation whose last global batch leaves a rank with no row (FSDP: a zero-row stand-in batch; a
    stream: an empty batch)."""
    data = _MaskedStream(samples) if stream else torch.utils.data.TensorDataset(*masked_rows(samples))
    return quiet_trainer(strategy=strategy).validate(MaskedRegression(), data, batch_size=batch_size)


def callback_metrics_with_checkpoints(folder: str) -> dict[str, float]:
    """A fit that writes a checkpoint each epoch: its callback_metrics, which every rank must hold the same."""
    trainer = quiet_trainer(max_epochs=2, checkpoint_dir=folder, loggers=("csv",))
    trainer.fit(Classifier(), checks.make_data(64), checks.make_data(32, seed=1), batch_size=16)
    return dict(trainer.callback_metrics)
