"""``Runtime``: keep your own training loop; lockstep sets up processes, devices, precision and data."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import gc
import logging
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.env import DistEnv, slurm_requeue_from_environ, verify_from_environ
from lockstep.runtime.checkpoint_methods import CheckpointMethods
from lockstep.runtime.collective_methods import CollectiveMethods
from lockstep.runtime.comm import collectives
from lockstep.runtime.comm.process_group import (
    DEFAULT_TIMEOUT_S,
    choose_backend,
    destroy_process_group,
    init_process_group,
    init_single_process_group,
)
from lockstep.runtime.config import RuntimeConfig
from lockstep.runtime.data.assembly import Loaders
from lockstep.runtime.data.loader import CurrentBatch, DistributedLoader
from lockstep.runtime.faults.lifetime import as_elastic_worker
from lockstep.runtime.faults.preemption import Preemption
from lockstep.runtime.faults.watchdog import Watchdog
from lockstep.runtime.launch.membership import report_membership
from lockstep.runtime.parallel.activation_checkpointing import Policy, checkpoint_activations
from lockstep.runtime.parallel.compiling import compile_in_place, compile_options, unwrap_compiled
from lockstep.runtime.parallel.devices import Devices, processes_asked_for, resolve_placement
from lockstep.runtime.parallel.fsdp import FSDP
from lockstep.runtime.parallel.grad_norm import clip_grad_norm
from lockstep.runtime.parallel.meta_init import is_empty, repoint_optimizers
from lockstep.runtime.parallel.num_items import ItemNormalizer
from lockstep.runtime.parallel.precision import make_precision
from lockstep.runtime.parallel.strategy import DDP, Strategy, make_strategy
from lockstep.runtime.parallel.wrappers import WrappedModule, patch_optimizer_step, unwrap
from lockstep.runtime.seed import seed_everything, set_determinism
from lockstep.runtime.verify import StepRecorder

if TYPE_CHECKING:  # the checkpoint machinery (DCP) loads at the first save or load, not before
    from lockstep.runtime.checkpoint.checkpointer import Checkpointer


class Runtime(CollectiveMethods, CheckpointMethods):
    """Processes, devices, strategy, precision, data and collectives for one training job.

    Every rank creates one ``Runtime`` with the same arguments. Creating it joins the process
    group (blocking until every rank has arrived, at most ``timeout`` seconds); a single process
    creates no group and every collective is then the identity. A script started with plain
    ``python`` that asks for several devices first becomes their launcher (see
    ``launch_workers_if_asked``). ``rt.config`` holds the arguments, resolved.

    Process-wide effects, each where a job needs it (docs/architecture.md says why and how to avoid
    each): under a torch elastic agent, ``sys.excepthook`` is wrapped and a thread ends the worker
    with its agent; under SLURM, USR1/USR2/TERM handlers; ``atexit`` closes the group; python, numpy
    and torch are seeded with ``seed``; ``setup`` patches each optimizer's ``step`` on the instance;
    FSDP on host memory sets glibc's mmap threshold; several nodes set ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` when unset.

    Arguments left unset (None) take what ``lockstep run --accelerator/--strategy/--precision``
    passed (``LOCKSTEP_ACCELERATOR``, ``LOCKSTEP_STRATEGY``, ``LOCKSTEP_PRECISION``), else the default.

    Args:
        accelerator: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        devices: per node, a count (GPUs with CUDA, processes with the CPU), GPU indices such as
            ``[0, 2]`` (what ``CUDA_VISIBLE_DEVICES=0,2`` means) or ``"auto"`` (what the launcher
            started). It must match the processes the launcher started on this node.
        strategy: ``"auto"`` (DDP with several processes), ``"ddp"``, ``"fsdp"``, ``"dp"``, ``"single"``,
            or a configured object such as ``lockstep.DDP(find_unused_parameters=True)`` or
            ``lockstep.FSDP(shard_modules=(Block,))``.
        precision: ``"32-true"``, ``"64-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"float8"``
            (aliases ``32``, ``64``, ``16``, ``bf16``).
        seed: seeds python, numpy and torch on every rank, and the data order (default order seed 0).
        deterministic: deterministic kernels (slower); ``benchmark``: cuDNN autotuning.
        timeout: seconds any collective may wait (default ``LOCKSTEP_TIMEOUT`` or 300).
        backend: ``"gloo"``, ``"nccl"`` or ``"mpi"``; default NCCL on CUDA, Gloo on CPU.
        init_method: ``"tcp://host:port"`` or ``"env://"``; default a TCP store on the master.
        env: where this process sits; default read from the launcher's environment.
        debug: before each collective, check that all ranks call the same one with the same shapes
            (default ``LOCKSTEP_DEBUG``); costs one small gather per collective.
        per_sample_rng: the loaders fetch each sample with torch, python and numpy seeded from
            (seed, epoch, dataset index), so random augmentations in ``__getitem__`` do not depend
            on the world size or the workers (a few microseconds per sample; docs/models.md).
    """

    def __init__(
        self,
        *,
        accelerator: str | None = None,
        devices: Devices = "auto",
        strategy: str | Strategy | None = None,
        precision: str | int | None = None,
        seed: int | None = None,
        deterministic: bool = False,
        benchmark: bool | None = None,
        timeout: float | None = None,
        backend: str | None = None,
        init_method: str | None = None,
        env: DistEnv | None = None,
        debug: bool | None = None,
        per_sample_rng: bool = False,
    ) -> None:
        self.config = config = RuntimeConfig(
            accelerator=accelerator, devices=devices, strategy=strategy, precision=precision, seed=seed,
            deterministic=deterministic, benchmark=benchmark, timeout=timeout, backend=backend,
            init_method=init_method, debug=debug, per_sample_rng=per_sample_rng,
        ).resolved()
        self.env = env if env is not None else DistEnv.from_environ()
        if self.env.launcher == "torchrun":
            as_elastic_worker()
        launch_workers_if_asked(config, self.env)
        self.strategy = make_strategy(config.strategy or "auto", self.env.world_size)
        self.placement = resolve_placement(
            config.accelerator or "auto", config.devices, self.env, self.strategy.one_process_many_devices,
        )
        self.precision = make_precision(config.precision or "32-true", self.placement.device,
                                        sharded=self.strategy.collective_forward)
        self.timeout = float(config.timeout or DEFAULT_TIMEOUT_S)
        set_determinism(config.deterministic, config.benchmark)
        self.seed = 0 if config.seed is None else seed_everything(config.seed)
        self._owns_group = self._join_group(choose_backend(self.placement.accelerator, config.backend))
        self._wrapped: list[weakref.ref[nn.Module]] = []
        self._watchdog = Watchdog(self.rank, self.world_size, self.timeout, bool(config.debug))
        self._current = CurrentBatch(self._watchdog)
        self._items = ItemNormalizer(self.data_parallel_size, self.device, self._sum_over_data_parallel)
        # Under SLURM the time-limit warning (USR1) and TERM become a stop every rank agrees on.
        self.preemption = Preemption(slurm_requeue_from_environ(), self.rank) if self.env.launcher == "slurm" else None
        self._logger = _RankLogger(logging.getLogger("lockstep"), {"rank": self.rank})
        self._checkpointer: Checkpointer | None = None  # made at the first save or load
        self._loaders = self._make_loaders()
        self.compiled: list[str] = []  # what setup(compile=...) compiled: block names, "" for a whole model
        self._recorder = self._make_recorder()

    def _make_loaders(self) -> Loaders:
        count = ((lambda flag: int(self._sum_over_data_parallel(torch.tensor(int(flag)))))
                 if self.world_size > 1 else None)
        return Loaders(self.data_parallel_rank, self.data_parallel_size, self.env.local_world_size, self.device,
                       self.seed, self._current, self.config.per_sample_rng, self.strategy.collective_forward, count,
                       self.print)

    def _sum_over_data_parallel(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the data-parallel ranks (tensor-parallel peers hold the same value)."""
        return self.all_reduce(value, op="sum") / self.tensor_parallel_size

    def _make_recorder(self) -> StepRecorder | None:
        """Under ``lockstep verify``: the recorder of the first steps (it ends the run after them)."""
        verifying = verify_from_environ()
        if verifying is None:
            return None
        return StepRecorder(Path(verifying[0]), verifying[1], self.rank, lambda t: self.all_reduce(t, op="sum"),
                            self.full_state_dict, self.barrier)

    @classmethod
    def from_config(cls, config: RuntimeConfig, env: DistEnv | None = None) -> Runtime:
        """The Runtime that ``config`` describes (``Runtime(**config.kwargs())``)."""
        return cls(**config.kwargs(), env=env)

    def _join_group(self, backend: str) -> bool:
        """Join the job's process group (blocking until every rank is there); True when this created it."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not self.env.is_distributed:
            if not isinstance(self.strategy, FSDP):  # FSDP on one process: its CPU offload (make_strategy)
                return False
            owns = init_single_process_group(backend, self.timeout)
            atexit.register(self.close)
            return owns
        owns = init_process_group(self.env, backend, self.timeout, self.config.init_method, self.device)
        atexit.register(self.close)
        if self.rank != 0:  # every rank runs the same torch code: its warnings are shown once, by rank 0
            warnings.filterwarnings("ignore", module=r"torch(\.|$)")
        if self.env.elastic_store:  # say which nodes left or joined since the last attempt
            report_membership(self.env.elastic_store, self.rank, self.world_size,
                              lambda d: collectives.all_gather(d, self.device))
        return owns

    # -- where this process sits -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """This rank's device: create tensors on it directly (``torch.zeros(3, device=rt.device)``)."""
        return self.placement.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @functools.cached_property
    def _data_parallel(self) -> tuple[int, int]:
        return self.strategy.data_parallel(self.rank, self.world_size)  # fixed for the Runtime's life

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place among the ranks that see different batches: ``rank``, except on a mesh with
        tensor parallelism (``FSDP(tp=...)``), whose ``tp`` peers share one data-parallel rank."""
        return self._data_parallel[0]

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step sees: ``world_size / tp``."""
        return self._data_parallel[1]

    @property
    def tensor_parallel_size(self) -> int:
        """How many ranks share one batch, each computing part of every layer: ``tp`` on a mesh, else 1."""
        return self.world_size // self._data_parallel[1]

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def num_nodes(self) -> int:
        return self.env.num_nodes

    @property
    def is_global_zero(self) -> bool:
        return self.env.is_global_zero

    @property
    def is_local_zero(self) -> bool:
        return self.env.is_local_zero

    # -- model and optimizers ---------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer,
              compile: bool | dict[str, Any] | None = None,  # noqa: A002 - torch's own word
              activation_checkpointing: Policy | None = None) -> Any:
        """Convert, place and wrap ``model``; route each optimizer's ``step`` through the precision.

        Returns the wrapped model, or ``(model, *optimizers)`` when optimizers are given. Optimizers
        may be built before it, from ``model.parameters()``: when setup replaces the parameters
        (FSDP shards them; a model from ``init_module(empty=True)`` is materialised), the optimizers
        are re-pointed to the new ones, keeping their hyperparameters. Every rank must call it (DDP
        broadcasts rank 0's weights, so all ranks start equal whatever their seed).

        ``compile=True`` (or a dict of ``torch.compile`` options; ``regional=False`` compiles the
        model whole) compiles the model's repeated blocks in place before DDP/FSDP wrap them, so
        no graph breaks at DDP's hooks and no ``_orig_mod.`` in state_dict keys. A model you
        compiled yourself (``torch.compile(model)``) is unwrapped and compiled that way too.
        ``rt.compiled`` then names what was compiled.

        ``activation_checkpointing="full"`` recomputes each repeated block's activations in the
        backward instead of keeping them; ``"selective"`` keeps the outputs of matrix products and
        attention and recomputes the rest; a function ``(name, module) -> bool`` picks the modules.
        Gradients stay those without it (docs/parallelism.md).
        """
        model, was_compiled = unwrap_compiled(model)
        before = dict(model.named_parameters())
        module = self.precision.convert_module(model)
        if is_empty(module) and not self.shards_model:
            self.strategy.materialize(module, self.placement, self.seed)
        checkpoint_activations(module, activation_checkpointing)
        self.compile(module, compile if compile is not None else was_compiled)
        forward_module = self.strategy.wrap(module, self.placement, self.precision)
        if is_empty(module):  # sharded first: each rank allocates and initialises its shards only
            self.strategy.materialize(module, self.placement, self.seed)
        repoint_optimizers(before, module, optimizers)
        eval_module = self.strategy.eval_module(forward_module)
        stand_in = (lambda: self._current.stand_in) if self.shards_model else None
        watch = self._watchdog if self.strategy.collective_forward else None  # a forward that is a collective
        wrapped = WrappedModule(forward_module, eval_module, module, self.precision, stand_in, watch)
        self._wrapped.append(weakref.ref(forward_module))
        recorder = self._recorder
        if recorder is not None:
            recorder.watch(module, optimizers)
        for optimizer in optimizers:
            self._items.watch(optimizer)
            patch_optimizer_step(optimizer, self.precision, before_step=self._before_step,
                                 after_step=recorder.after_step if recorder is not None else None)
        return (wrapped, *optimizers) if optimizers else wrapped

    def compile(self, model: nn.Module, compile: bool | dict[str, Any] | None = True) -> nn.Module:  # noqa: A002
        """Compile ``model`` in place as ``setup(compile=...)`` does, and return it: its repeated blocks
        (or, with none or ``regional=False``, its forward). ``torch.compile(model)``'s wrapper is taken
        off and its module compiled so. ``compile`` is True, a dict of ``torch.compile`` options, or
        False/None (nothing is compiled). For a model that ``setup`` will see inside a wrapper of
        your own (the Trainer's); call it before ``setup``. ``rt.compiled`` names what was compiled.
        """
        module, _ = unwrap_compiled(model)
        options = compile_options(compile)
        if options is not None:
            self.compiled = compile_in_place(module, options)
        return module

    @property
    def shards_model(self) -> bool:
        """True when the strategy shards the model (FSDP): build big models in ``init_module(empty=True)``,
        and know that each forward is a collective that every rank must run."""
        return self.strategy.collective_forward

    def _before_step(self) -> None:
        """Before each optimizer step: a background save that failed is raised now, not at the next save."""
        if self._checkpointer is not None:
            self._checkpointer.raise_if_failed()
        self._items.finish_step()
        if self._recorder is not None:
            self._recorder.before_step()

    def init_module(self, empty: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Build the model inside this block: on this rank's device, or with ``empty=True`` on the meta
        device, which allocates nothing. ``rt.setup`` then allocates the model (under FSDP only this
        rank's shards) and initialises it with each submodule's ``reset_parameters``.
        """
        return torch.device("meta") if empty else torch.device(self.device)

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None) -> None:
        """``loss.backward()`` with loss scaling and the global-batch correction.

        Inside a loop over a ``rt.loader``, ``loss`` is the mean over this rank's share of the
        current batch. When that global batch is split unevenly (a short last batch), the loss is
        reweighted so the gradients equal those of the mean loss over the whole global batch. The
        weight belongs to the batch: it applies from the moment the loader hands the batch out
        until the loop asks for the next one or ends, and never to any other backward.

        ``num_items``: ``loss`` is a mean over this many items (e.g. the valid tokens of this
        rank's batch, ``(labels != -100).sum()``), which differ by rank and micro-batch. The
        gradients that the optimizer step (or ``rt.clip_grad_norm_``) then sees are those of the
        mean over every item of every rank and every micro-batch since the last step, whatever the
        world size and accumulation. Cost: one all-reduce of one number per optimizer step.
        Give it to every backward of a step, or to none; clip with ``rt.clip_grad_norm_``.

        Gradient accumulation: with ``num_items``, never divide the loss by the accumulation steps
        (that shrinks the gradient k times; a first step whose every loss is divided by its number of
        micro-batches is refused); without it, divide, as a plain loop does.
        """
        if self._recorder is not None:
            self._recorder.backward(loss, num_items if num_items is not None else self._current.loss_weight)
        if num_items is not None:
            loss = loss * self._items.loss_factor(num_items, loss)
        else:
            self._items.plain_backward()
            weight = self._current.loss_weight
            loss = loss * weight if weight != 1.0 else loss
        with self._watchdog.step("backward"):  # the gradient reduction (DDP, FSDP), tensor-parallel collectives
            self.precision.backward(loss)

    def no_sync(self, model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce inside this block (gradient accumulation micro-steps).

        Gradients accumulate locally; the first backward outside the block reduces them all.
        ``model`` is what ``rt.setup`` returned.
        """
        if not isinstance(model, WrappedModule):
            raise TypeError(
                f"rt.no_sync needs the model that rt.setup returned; got a {type(model).__name__} that did "
                "not come from rt.setup, so its gradients would be all-reduced on every micro-step."
            )
        if not enabled:
            return contextlib.nullcontext()
        return self.strategy.no_sync(model.forward_module)

    def clip_grad_norm_(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Unscale the gradients (``16-mixed``), then clip their total norm; returns the norm."""
        self._items.finish_step()
        self.precision.unscale_(optimizer)
        with self._watchdog.step("clip_grad_norm_"):
            return clip_grad_norm(model.parameters(), max_norm, norm_type)  # the norm over all shards and meshes

    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``optimizer.step()`` was skipped for inf/NaN gradients (``16-mixed``)."""
        return self.precision.last_step_skipped

    # -- data --------------------------------------------------------------------------------
    def loader(
        self, data: Any, batch_size: int | None = None, shuffle: bool | None = None,
        drop_last: bool | None = None, **options: Any,
    ) -> DistributedLoader:
        """A training loader: ``batch_size`` is the GLOBAL batch, split over the ranks.

        Each step's global batch is a contiguous slice of one permutation seeded by (seed, epoch);
        each ``iter()`` is the next epoch. ``data`` is a map-style dataset or a DataLoader, which is
        re-created with the same dataset, collate_fn and options. Other keyword arguments go to
        DataLoader (``num_workers``, ``pin_memory``, ``collate_fn``, ...).
        """
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if value is not None:
                options[name] = value
        return self._loaders.training(data, batch_size, options)

    def eval_loader(self, data: Any, batch_size: int | None = None, **options: Any) -> DistributedLoader:
        """An evaluation loader: every sample goes to exactly one rank, no padding, no duplicates.

        Rank ``r`` gets the ``r``-th contiguous shard in batches of ``batch_size / world_size``, so
        ``rt.gather`` of the outputs returns them in dataset order. Ranks may hold different numbers
        of batches: issue no collective per batch, gather once after the loop. Under FSDP, whose
        forward is a collective, every rank gets the same number of batches: a rank whose shard
        has ended gets batches of zero rows, which add nothing to gathered outputs.
        """
        return self._loaders.evaluation(data, batch_size, options)

    def mark(self, stage: str) -> None:
        """Say what this rank is doing (e.g. the hook it enters); hang and failure reports show it.

        Costs one attribute write: call it as often as you like.
        """
        self._watchdog.stage = stage

    # -- printing and ordering ---------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only; other ranks print nothing."""
        if self.is_global_zero:
            builtins.print(*args, **kwargs)

    @property
    def log(self) -> _RankLogger:
        """The ``lockstep`` logger, prefixing each message with this process's rank."""
        return self._logger

    def close(self) -> None:
        """Leave the process group this Runtime created (safe to call twice; also done at exit).

        Models set up by this Runtime stop synchronising gradients: call it when training is over.
        """
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._watchdog.stop()
        if self._owns_group:
            self._owns_group = False
            for ref in self._wrapped:
                module = ref()
                if module is not None:
                    self.strategy.release(module)
            gc.collect()  # pending work objects sit in reference cycles: free them while the group lives
            destroy_process_group()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch_workers_if_asked(config: RuntimeConfig, env: DistEnv) -> None:
    """Self-launch: a script started with plain ``python`` that asks for several devices becomes their launcher.

    With no launcher around and a one-process-per-device strategy, asking for N > 1 devices
    re-runs the script as N workers under the torch elastic agent; this process waits for them and
    exits with their status, never returning. Under a launcher, or for one device, it does nothing.
    """
    one_per_device = config.strategy in ("auto", "ddp", "fsdp") or isinstance(config.strategy, (DDP, FSDP))
    if env.launcher == "none" and one_per_device:
        nproc = processes_asked_for(config.accelerator or "auto", config.devices)
        if nproc > 1:
            from lockstep.runtime.launch.elastic import self_launch  # the agent's code: only where it runs

            self_launch(nproc)


class _RankLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank'] if self.extra else 0}] {msg}", kwargs


__all__ = ["Runtime", "unwrap"]
