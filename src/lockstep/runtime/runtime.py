"""``Runtime``: keep your own training loop; lockstep sets up processes, devices, precision and data."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lockstep.env import DistEnv, checksums_from_environ, slurm_requeue_from_environ, verify_from_environ
from lockstep.env.fault_tolerance import FaultTolerance
from lockstep.env.settings import DEFAULT_TIMEOUT_S, verify_fingerprints_from_environ, verify_trace_from_environ
from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.checkpoint.life import Checkpoint, Checkpoints, Ranks
from lockstep.runtime.checkpoint.ray_record import RayRecord
from lockstep.runtime.comm import collectives, process_group
from lockstep.runtime.config import RuntimeConfig
from lockstep.runtime.data.assembly import Loaders
from lockstep.runtime.data.current import CurrentBatch
from lockstep.runtime.data.loader import DistributedLoader
from lockstep.runtime.fault_tolerance.replication import replication_for
from lockstep.runtime.faults.lifetime import as_elastic_worker
from lockstep.runtime.faults.preemption import Preemption, ReclaimNotice
from lockstep.runtime.faults.stragglers import stragglers_for
from lockstep.runtime.faults.watchdog import Watchdog
from lockstep.runtime.launch.membership import report_membership
from lockstep.runtime.optimizer_step import OptimizerStep
from lockstep.runtime.parallel.activation_checkpointing import Policy
from lockstep.runtime.parallel.compiling import compile_in_place, compile_options, unwrap_compiled
from lockstep.runtime.parallel.devices import Devices, processes_asked_for, resolve_placement
from lockstep.runtime.parallel.fsdp import FSDP
from lockstep.runtime.parallel.mesh import Membership, Mesh, MeshLayout, Parallel, check_ranks_agree
from lockstep.runtime.parallel.models import ModelKind, Tools, default_inputs, prepare
from lockstep.runtime.parallel.num_items import ItemNormalizer
from lockstep.runtime.parallel.pipeline.staged import model_kind_for
from lockstep.runtime.parallel.precision import make_precision
from lockstep.runtime.parallel.strategy import DDP, Strategy, make_strategy
from lockstep.runtime.parallel.wrappers import STATISTICS_MOVED, WrappedModule, unwrap
from lockstep.runtime.seed import RandomStates, order_seed, seed_everything, set_determinism
from lockstep.runtime.trace import ModuleTrace
from lockstep.runtime.verify import StepRecorder


class Runtime:
    """Processes, devices, strategy, precision, data and collectives for one training job.

    Every rank creates one ``Runtime`` with the same arguments. Creating it joins the process
    group (blocking until every rank has arrived, at most ``timeout`` seconds); a single process
    creates no group and every collective is then the identity. A script started with plain
    ``python`` that asks for several devices first becomes their launcher (see
    ``launch_workers_if_asked``). ``rt.config`` holds the arguments, resolved. ``rt.membership`` is
    this rank's place among the data-parallel replicas, read at every step (docs/parallelism.md).

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
        parallel: the device mesh besides data parallel, ``lockstep.Parallel(tp=..., pp=..., replicate=...)``
            (tensor and pipeline parallel, HSDP); default none (docs/parallelism.md).
        precision: ``"32-true"``, ``"64-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"float8"``
            (aliases ``32``, ``64``, ``16``, ``bf16``).
        seed: seeds python, numpy and torch on every rank, and the data order (default order seed 0).
        deterministic: deterministic kernels (slower); ``benchmark``: cuDNN autotuning.
        timeout: seconds (or a ``timedelta``) any collective may wait (default ``LOCKSTEP_TIMEOUT`` or 300).
        backend: ``"gloo"``, ``"nccl"`` or ``"mpi"``; default NCCL on CUDA, Gloo on CPU.
        init_method: ``"tcp://host:port"`` or ``"env://"``; default a TCP store on the master.
        env: where this process sits; default read from the launcher's environment.
        debug: before each collective, check that all ranks call the same one with the same shapes
            (default ``LOCKSTEP_DEBUG``); costs one small gather per collective.
        per_sample_rng: the loaders fetch each sample with torch, python and numpy seeded from
            (seed, epoch, dataset index), so random augmentations in ``__getitem__`` do not depend
            on the world size or the workers (a few microseconds per sample; docs/models.md).
        fault_tolerance: this job is one of several replica groups that may die and join while the
            others train on (``lockstep.FaultTolerance(...)``; default what ``lockstep run
            --fault-tolerant`` set). Call ``rt.resume(folder, state)`` before the loop, and step
            schedulers only when ``rt.step_committed`` (docs/fault-tolerance.md).
    """

    def __init__(
        self, *,
        accelerator: str | None = None,
        devices: Devices = "auto",
        strategy: str | Strategy | None = None,
        parallel: Parallel | None = None,
        precision: str | int | None = None,
        seed: int | None = None,
        deterministic: bool = False,
        benchmark: bool | None = None,
        timeout: float | timedelta | None = None,
        backend: str | None = None,
        init_method: str | None = None,
        env: DistEnv | None = None,
        debug: bool | None = None,
        per_sample_rng: bool = False,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        self.config = RuntimeConfig(
            accelerator=accelerator, devices=devices, strategy=strategy, parallel=parallel, precision=precision,
            seed=seed, deterministic=deterministic, benchmark=benchmark, timeout=timeout, backend=backend,
            init_method=init_method, debug=debug, per_sample_rng=per_sample_rng, fault_tolerance=fault_tolerance,
        ).resolved()
        self.env = env if env is not None else DistEnv.from_environ()
        layout = self._start_process()
        self.mesh = Mesh(layout, self.rank, self.device.type)  # the degrees, the DeviceMesh, the data-parallel ranks
        self._wrapped: list[weakref.ref[nn.Module]] = []
        self._watchdog = self._make_watchdog(layout)
        check_ranks_agree(self.strategy.name, self.precision.name, self.config.parallel or Parallel(),  # uncounted,
                          lambda text: collectives.all_gather(text, self.device), self.env)  # not the script's
        self._current = CurrentBatch(self._watchdog)
        self.replication = replication_for(self.config.fault_tolerance, self.membership, self.rank, self.world_size,
                                           self.device, self.print, self.seed)
        self._items = ItemNormalizer(self.membership, self.device, self._sum_over_data_parallel, layout.cp)
        # Under SLURM the time-limit warning (USR1) and TERM become a stop every rank agrees on.
        can = self.env.capabilities
        self.preemption = (Preemption(slurm_requeue_from_environ() if can.requeues else None, self.rank)
                           if can.preempts_with_grace else None)
        self.reclaim = ReclaimNotice() if can.warns_of_reclaim else None
        self._logger = _RankLogger(logging.getLogger("lockstep"), {"rank": self.rank})
        self._checkpoints = self._make_checkpoints()
        self._loaders = self._make_loaders()
        self.compiled: list[str] = []  # what setup(compile=...) compiled: block names, "" for a whole model
        self._recorder = self._make_recorder()
        self._optimizer_step = OptimizerStep(self.precision, self._items, self._checkpoints, self._watchdog,
                                             self._recorder, self.replication, self._current_batch)
        self._model = self._make_model_kind()

    def _start_process(self) -> MeshLayout:
        """This process made a rank of the job: its launcher's watch, self-launch, the strategy, the device,
        the precision, the seed, and the process group joined. Returns the mesh's degrees."""
        config, env = self.config, self.env
        if env.capabilities.agent_watches:
            as_elastic_worker()
        launch_workers_if_asked(config, env)
        self.strategy, layout = make_strategy(config.strategy or "auto", env.world_size, config.parallel)
        self.placement = resolve_placement(config.accelerator or "auto", config.devices, env,
                                           self.strategy.one_process_many_devices)
        self.precision = make_precision(config.precision or "32-true", self.placement.device,
                                        sharded=self.strategy.collective_forward)
        self.timeout = float(config.timeout or DEFAULT_TIMEOUT_S)  # type: ignore[arg-type]  # resolved: s
        set_determinism(config.deterministic, config.benchmark)
        self._owns_group = self._join_group(process_group.choose_backend(
            self.placement.accelerator, config.backend, self.placement.shares_gpu,
            sharded=self.strategy.collective_forward and env.world_size > 1))
        self.seed = order_seed(0 if config.seed is None else seed_everything(config.seed),  # rank 0's orders the data
                               lambda mine: collectives.all_gather(mine, self.device), env.world_size, self.print)
        return layout

    def _current_batch(self) -> tuple[float, object]:
        """The loss weight of the batch the loop holds, and which batch it is (kind, epoch, index)."""
        return self._current.loss_weight, self._watchdog.batch

    def _make_model_kind(self) -> ModelKind:
        """What ``setup`` makes of a model, chosen once: the whole model, or this rank's pipeline stages."""
        tools = Tools(self.strategy, self.precision, self.placement, self.mesh, self.config.parallel or Parallel(),
                      self.seed, self.rank, self._watchdog, self._items,
                      (lambda: self._current.stand_in) if self.shards_model else None,
                      self._current, self.all_gather,
                      lambda loss, items: self.backward(loss, num_items=items), self._recorder)
        return model_kind_for(tools)

    def _make_checkpoints(self) -> Checkpoints:
        """The checkpoint room, over this Runtime's watched collectives (DCP loads at its first use)."""
        ranks = Ranks(self.rank, self.world_size, self.barrier, self.all_gather, self.sync_buffers, self.print,
                      self._watchdog)
        record = RayRecord(self.rank, self.print) if self.env.capabilities.records_checkpoints else None
        return Checkpoints(ranks, self.strategy.name, checksums_from_environ(), record, self.precision)

    def _make_loaders(self) -> Loaders:
        count = ((lambda flag: int(self._sum_over_data_parallel(torch.tensor(int(flag)))))
                 if self.world_size > 1 else None)
        every_rank = self.all_gather if self.world_size > 1 else None
        return Loaders(self.membership, self.env.local_world_size, self.device,
                       self.seed, self._current, self.config.per_sample_rng, self.strategy.collective_forward, count,
                       self.print, self.replication.gate, self.replication.evaluation_membership(self.membership),
                       every_rank, self.mesh.cut)

    def _sum_over_data_parallel(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the data-parallel ranks (tensor-parallel peers hold the same value),
        over every live replica group of a fault-tolerant job."""
        total = self.all_reduce(value, op="sum") / self.mesh.layout.batch_peers if self.world_size > 1 else value
        return self.replication.sum(total)

    def _make_watchdog(self, layout: MeshLayout) -> Watchdog:
        """The hang reports' watchdog, with this rank's part of the straggler report (docs/reliability.md):
        ranks are compared with the others of their pipeline stage."""
        stragglers = stragglers_for(self.rank, self.world_size, self.env.local_rank, self.device.type,
                                    layout.pipeline_rank(self.rank))
        return Watchdog(self.rank, self.world_size, self.timeout, bool(self.config.debug), stragglers)

    def _make_recorder(self) -> StepRecorder | None:
        """Under ``lockstep verify``: the recorder of the first steps (it ends the run after them)."""
        verifying = verify_from_environ()
        if verifying is None:
            return None
        traced, layout = verify_trace_from_environ(), self.mesh.layout
        place = {"data_parallel_rank": layout.data_parallel_rank(self.rank), "strategy": self.strategy.name}
        trace = (traced, ModuleTrace(Path(verifying[0]), self.rank, place, self._current.rows, traced,
                                     lambda: self._model.warms_up, verify_fingerprints_from_environ())
                 ) if traced else None
        return StepRecorder(Path(verifying[0]), verifying[1], self.rank, lambda t: self.all_reduce(t, op="sum"),
                            self.full_state_dict, self.barrier, layout.parameter_holders, trace)

    @classmethod
    def from_config(cls, config: RuntimeConfig, env: DistEnv | None = None) -> Runtime:
        """The Runtime that ``config`` describes (``Runtime(**config.kwargs())``)."""
        return cls(**config.kwargs(), env=env)

    def _join_group(self, backend: str) -> bool:
        """Join the job's process group (blocking until every rank is there); True when this created it."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.init()  # so that torch's DeviceMesh keeps this device, not cuda:LOCAL_RANK (devices=[0, 0])
        if not self.env.is_distributed:
            if not isinstance(self.strategy, FSDP):  # FSDP on one process: its CPU offload (make_strategy)
                return False
            owns = process_group.init_single_process_group(backend, self.timeout)
            atexit.register(self.close)
            return owns
        owns = process_group.init_process_group(self.env, backend, self.timeout, self.config.init_method, self.device)
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

    @property
    def membership(self) -> Membership:
        """This rank's place among the data-parallel replicas (``.rank``, ``.size``), read at every step by
        the loaders, ``num_items`` and ``gather``: ``change`` re-splits the next global batch."""
        return self.mesh.membership

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place among the ranks that see different batches: ``rank``, except on a mesh with
        tensor parallelism (``Parallel(tp=...)``), whose ``tp`` peers share one data-parallel rank."""
        return self.membership.rank

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step sees: ``world_size / (tp × pp × cp)``."""
        return self.membership.size

    @property
    def tensor_parallel_size(self) -> int:
        """How many ranks share one batch, each computing part of every layer: ``tp`` on a mesh, else 1."""
        return self.mesh.tp

    @property
    def context_parallel_size(self) -> int:
        """How many ranks share each row, each holding part of its sequence: ``cp`` on a mesh, else 1."""
        return self.mesh.layout.cp

    @property
    def pipeline_parallel_size(self) -> int:
        """How many ranks hold the stages of one copy of the model, one after another: ``pp``, else 1."""
        return self.mesh.pp

    node_rank = property(attrgetter("env.node_rank"), doc="This rank's node (0 to num_nodes - 1).")
    num_nodes = property(attrgetter("env.num_nodes"), doc="How many nodes the job runs on.")
    is_global_zero = property(attrgetter("env.is_global_zero"), doc="True on rank 0.")

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
        chosen = compile if compile is not None else was_compiled
        wrapped, released = prepare(model, optimizers, self._model, lambda module: self.compile(module, chosen),
                                    activation_checkpointing)
        self._wrapped.append(weakref.ref(released))
        if self._recorder is not None:
            self._recorder.watch(unwrap(wrapped), optimizers)
        for optimizer in optimizers:
            self._optimizer_step.attach(optimizer)  # its step runs OptimizerStep.run: the order of a step
        return (wrapped, *optimizers) if optimizers else wrapped

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                         num_items: Callable[[Any], int | torch.Tensor] | None = None,
                         inputs: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
        """One micro-step: ``loss_fn(model(inputs(batch)), batch)`` and its backward as ``rt.backward`` runs it;
        returns the loss, detached. The same call runs a model split into pipeline stages (``pp > 1``), where
        the first stage takes the inputs, each micro-batch's output reaches ``loss_fn`` on the last stage with
        its own rows of ``batch``, and the loss returned is the same on every rank of the pipeline. The loss is
        this data-parallel rank's (the mean over its rows or items), so it changes with the world size:
        ``rt.all_reduce(loss)`` averages it over the data-parallel ranks (docs/parallelism.md).

        ``inputs``: what the model is called with (default a dict batch's ``input_ids``, a tuple's first
        item, or the batch itself); the output ``loss_fn`` receives is a Hugging Face model's ``logits``, else
        what the model returns. ``num_items``: the items (tokens) of some rows of the batch, e.g.
        ``lambda rows: (rows["labels"] != -100).sum()``; ``loss_fn`` then returns the mean over them, and the
        gradients are those of the mean over every item of the step (``rt.backward(num_items=...)``).
        """
        return self._model.forward_backward(model, batch, loss_fn, num_items, default_inputs(inputs))

    def compile(self, model: nn.Module, compile: bool | dict[str, Any] | None = True) -> nn.Module:  # noqa: A002
        """Compile ``model`` in place as ``setup(compile=...)`` does, and return it: its repeated blocks (or,
        with none, blocks of too many layouts (docs/models.md), or ``regional=False``, the
        model whole: its forward, or without one its children). ``torch.compile(model)``'s wrapper is taken
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
        weight belongs to the batch: until the next batch, the pass's end or a ``break`` (a loop that holds
        several batches names its batch by the forward's tensors); never to any other backward.

        ``num_items``: ``loss`` is a mean over this many items (e.g. the valid tokens of this
        rank's batch, ``(labels != -100).sum()``), which differ by rank and micro-batch. The
        gradients that the optimizer step (or ``rt.clip_grad_norm_``) then sees are those of the
        mean over every item of every rank and every micro-batch since the last step, whatever the
        world size and accumulation. Cost: one all-reduce of one number per optimizer step.
        Give it to every backward of a step, or to none; clip with ``rt.clip_grad_norm_``.

        Gradient accumulation: with ``num_items``, never divide the loss by the accumulation steps
        (that shrinks the gradient k times; a first step whose every loss is divided by its number of
        micro-batches is warned of); without it, divide, as a plain loop does.
        """
        self._current.backward_started()  # another loader's batch after this is the next loss's (no zip)
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
            raise UsageError(
                f"rt.no_sync needs the model that rt.setup returned; got a {type(model).__name__} that did "
                "not come from rt.setup, so its gradients would be all-reduced on every micro-step."
            )
        return self._model.no_sync(model) if enabled else contextlib.nullcontext()

    def clip_grad_norm_(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Unscale the gradients (``16-mixed``), then clip their total norm; returns the norm. The gradients
        are those of the parameters ``optimizer`` steps; several optimizers are clipped together, by the
        total norm of all their parameters."""
        return self._optimizer_step.clip(model, optimizer, max_norm, norm_type)

    @property
    def step_committed(self) -> bool:
        """Whether the last ``optimizer.step()`` was taken. Always, except in a fault-tolerant job, where
        a step during which a replica group died is taken nowhere and its batch comes again: step your
        schedulers (and count your steps) only when this is True."""
        return self.replication.step_committed

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
        DataLoader (``num_workers``, ``pin_memory``, ``collate_fn``, ...). Every rank must call it, in the same
        order: it compares the dataset's length across the ranks (one small all-gather).
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

    def step_times(self) -> dict[str, Any]:
        """This rank's newest training steps, timed without a sync (``steps``: each step's ``step_s``,
        ``data_s`` waiting for the batch, ``forward_s``, ``backward_s``, ``wait_s`` for the other ranks'
        gradients, ``collective_s`` in lockstep's other collectives);
        on rank 0 also the straggler report's view of every rank (``step_time/max_over_median``,
        ``step_time/slowest_rank`` over the newest steps judged, ``stragglers``: rank -> cause of each rank
        named); in a fault-tolerant job, on each group's rank 0, the same over the replica groups
        (``step_time/groups_max_over_median``, ``step_time/slowest_group``, ``group_stragglers``). Empty on
        one process or with ``LOCKSTEP_STRAGGLER_FACTOR=0`` (docs/reliability.md)."""
        stragglers = self._watchdog.stragglers
        return {**(stragglers.report() if stragglers is not None else {}), **self.replication.step_times()}

    def mark(self, stage: str) -> None:
        """Say what this rank is doing (e.g. the hook it enters); hang and failure reports show it.

        Costs one attribute write: call it as often as you like.
        """
        self._watchdog.stage = stage

    # -- collectives: every rank calls them, in the same order; the watchdog names a rank that never arrives
    def barrier(self) -> None:
        """Block until every rank arrives here."""
        with self._watchdog.watch("barrier"):
            collectives.barrier(self.device)

    def all_reduce(self, data: Any, op: str = "mean") -> Any:
        """Reduce the tensors and numbers in ``data`` (``sum``, ``mean``, ``max``, ``min``) over all ranks.

        Every rank gets the result.
        """
        with self._watchdog.watch(f"all_reduce({op})", data):
            return collectives.all_reduce(data, op, self.device)

    def all_gather(self, data: Any) -> list[Any]:
        """Every rank's ``data`` as a list indexed by rank, on every rank. Shapes may differ by rank."""
        with self._watchdog.watch("all_gather", data, exact_shapes=False):
            return collectives.all_gather(data, self.device)

    def gather(self, data: Any, loader: DistributedLoader | None = None, order: str = "dataset") -> Any:
        """Outputs of all ranks as one structure with one row per sample, in dataset order, on every rank.

        ``data`` holds this rank's outputs of one pass over a lockstep loader (``loader``, by default
        the loader whose pass started last), collected batch by batch: the loader knows
        which dataset index each row belongs to, so the rows come back sorted by it, whichever
        loader it was (training or evaluation, shuffled or not, any sampler). Outputs that do not
        match the samples the pass handed out on some rank raise an error naming the rank.
        ``order="rank"``, or no loader used yet: every rank's rows concatenated in rank order.

        Tensors concatenate along dim 0; a list of tensors is taken as chunks of rows (per-batch
        outputs) and joined first, or, one per sample of the pass, as its rows (stacked where their
        shapes agree, else kept a list); a list of per-batch structures of tensors (dicts, ModelOutputs,
        namedtuples, dataclasses, tuples) is merged into one, each field joined (a list in a batch holds
        its rows, e.g. texts: a batch's fields given as a list are refused, naming a tuple); other lists
        concatenate; dicts and tuples are gathered per entry. A rank with no rows may pass ``[]``.
        On a mesh with tensor parallelism the ``tp`` peers hold the same rows: one copy is kept.
        """
        if order not in ("dataset", "rank"):
            raise ConfigError(f"order={order!r}: use 'dataset' (the rows of a loader pass) or 'rank'.")
        source = (loader if loader is not None else self._current.last) if order == "dataset" else None
        handed = source.handed_rows() if source is not None else None
        # a tensor-parallel peer or a later pipeline rank of the one that keeps them (they hold the same rows)
        replica = not self.mesh.layout.keeps_rows(self.rank)
        with self._watchdog.watch("gather", data, exact_shapes=False):
            return collectives.gather_rows(data, self.device, handed, replica=replica)

    def full_state_dict(self, model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict``, keyed as your module's own, as plain CPU tensors: shards
        (FSDP) are gathered, wrappers left out; buffers are rank 0's. For ``torch.save``,
        ``save_pretrained`` or an export. Every rank must call it. ``rank0_only=True``: rank 0 gets
        it and the other ranks an empty dict (one full copy in host memory, not one per rank).
        """
        module = unwrap(model)
        from lockstep.runtime.checkpoint.parts import full_state_dict

        self.sync_buffers(module)
        with self._watchdog.watch("full_state_dict"):
            return self._model.whole_state(lambda rank0_only: full_state_dict(module, rank0_only), rank0_only)

    def sync_buffers(self, model: nn.Module, src: int = 0) -> None:
        """Give every rank rank ``src``'s buffers of ``model`` (BatchNorm's running statistics, say).

        Each rank updates such statistics from its own share of the batch, so after training the
        ranks hold different ones (DDP hands rank 0's to all at the start of each training forward;
        FSDP never). Call it before evaluating, predicting or saving from every rank, so that all
        ranks compute with, and save, the same model. ``rt.save`` and the Trainer (before
        evaluation, prediction and checkpoints) call it for you. Every rank must call it.
        """
        module = unwrap(model)
        buffers = [b for b in module.buffers() if not b.is_meta]
        if self.world_size > 1:
            self._model.sync_buffers(buffers, src)
            module.__dict__.pop(STATISTICS_MOVED, None)  # every rank holds rank src's statistics again

    def broadcast(self, data: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``data`` on every rank."""
        with self._watchdog.watch(f"broadcast(src={src})"):
            return collectives.broadcast(data, src, self.device)

    def should_stop(self) -> bool:
        """True on every rank when any rank received the preemption signal (USR1 or TERM).

        Every rank must call it at the same points (e.g. each step boundary); it is one small
        all-reduce under a scheduler that preempts with a grace period (SLURM's ``srun``; a pod under
        Kubernetes, whose TERM comes before the kill) and free elsewhere (always False). On True: save a
        checkpoint, call ``rt.requeue()``, and exit; the requeued (or restarted) job resumes from the
        checkpoint. A process that
        has never called it when the signal comes has 5 seconds to do so; after that the signal
        ends it as it would without lockstep.
        """
        if self.preemption is None:
            return False
        self.preemption.poll()
        return bool(self.all_reduce(self.preemption.local_flag, op="max"))

    def should_checkpoint(self) -> bool:
        """True on every rank, once per notice, when the engine has announced that a node of the job will
        be reclaimed (Ray Train: a node drained for preemption, with a deadline): save a checkpoint now and
        keep training; when the node goes, the engine restarts the job, which resumes from that checkpoint.
        Every rank must call it at the same points (e.g. each step boundary); one small all-reduce under
        Ray, free elsewhere (always False: there the notice is a signal, see ``should_stop``)."""
        if self.reclaim is None:
            return False
        told = int(self.all_reduce(float(self.reclaim.count()), op="max"))
        if told <= self.reclaim.handled:
            return False
        self.reclaim.handled = told
        return True

    def requeue(self) -> str:
        """After ``should_stop``: rank 0 requeues the SLURM job when USR1 came and the job script
        asked for it (``lockstep slurm --requeue``). Returns what happened."""
        return "not under SLURM" if self.preemption is None else self.preemption.requeue(self.rank)

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        """Rank 0 (``local=True``: each node's local rank 0) runs the block first; the others wait.

        For work such as downloading or preprocessing a dataset once. Every rank must enter it.
        """
        first = self.is_local_zero if local else self.is_global_zero
        if not first:
            self.barrier()
        yield
        if first:
            self.barrier()

    # -- checkpoints (the room: checkpoint/life.py) ------------------------------------------
    def save(self, path: str | Path, state: dict[str, Any], blocking: bool = True,
             metadata: dict[str, Any] | None = None, on_commit: Callable[[], None] | None = None) -> float:
        """Save ``state`` as the checkpoint folder ``path``; every rank calls it. Returns the seconds
        the call blocked.

        Models (what ``rt.setup`` returned) and their optimizers are saved by parameter name, each
        rank writing its own shards; loaders and anything else with ``state_dict()`` are saved
        through it; other values (numbers, strings, tensors, dicts of them) as they are on rank 0.
        The folder is committed atomically and loads on any number of processes and any strategy
        (``rt.load``). ``blocking=False`` writes in the background while training goes on (see
        ``wait_for_save``). ``metadata``: JSON values added to the folder's ``lockstep.json``
        (readable without loading, e.g. the step). ``on_commit``: run on rank 0 once the folder is
        complete (after the background write, with ``blocking=False``).

        In a fault-tolerant job, the first replica group of the step writes it (the others return 0.0
        at once), adding the committed steps to its metadata.
        """
        return self.replication.save(self._checkpoints.save, path, state, blocking, metadata, on_commit)

    def load(self, path: str | Path | Checkpoint, state: dict[str, Any], verify: bool = True) -> dict[str, Any]:
        """Load the checkpoint folder ``path`` (or what ``latest_checkpoint`` found) into ``state``, as
        given to ``rt.save``: models, optimizers, loaders and other objects with ``load_state_dict``
        in place; plain values (None too) are replaced in ``state``, which is also returned. Every
        rank calls it, with the same keys. The files are checked against their checksums first
        (``verify=False``: already done, by ``verify_checkpoint`` or ``latest_checkpoint``); a
        damaged checkpoint is refused, naming the file.
        """
        return self._checkpoints.load(path, state, verify)

    def random_states(self) -> RandomStates:
        """Every rank's random states (python, numpy, torch CPU and CUDA) as an entry of the ``state``
        given to ``rt.save``: ``state["random"] = rt.random_states()``, and ``rt.resume``/``rt.load``
        put them back (on the same number of processes): dropout and other draws continue as in an
        uninterrupted run. The Trainer's checkpoints hold them already."""
        return RandomStates(self.all_gather, self.rank, self.world_size, self.print)

    def latest_checkpoint(self, path: str | Path, exact: bool = False) -> Checkpoint | None:
        """The checkpoint to resume from, the same on every rank: ``path`` itself when it is a checkpoint
        folder (refused if damaged), else the newest intact checkpoint in the folder ``path`` (a
        damaged one is skipped, saying why), or None when it holds none. Ranks that see different
        checkpoints (a folder the nodes do not share) are refused, each named. Every rank calls it.
        ``.path``, ``.step`` and ``.metadata`` (its ``lockstep.json``) describe what was found;
        ``rt.load(found, state, verify=False)`` loads it without reading or checking it again.
        ``exact=True``: ``path`` must be a checkpoint folder itself (else an error says what it is).
        """
        return self._checkpoints.find(path, exact)

    def resume(self, path: str | Path, state: dict[str, Any]) -> Checkpoint | None:
        """``resume="auto"`` of the Trainer, for your own loop: load ``latest_checkpoint(path)`` into
        ``state`` (as ``rt.load``) and return it, or return None when there is none (start from
        scratch). Every rank calls it.

        ``found = rt.resume("runs/exp", state)``, then ``start = found.step if found else 0``.

        In a fault-tolerant job every replica group calls it before its loop: after the checkpoint,
        if any, it joins the first quorum, which gives a group that starts behind the live groups
        their state (``state``'s plain values too: keep your step and epoch in it). It returns the
        checkpoint loaded from disk, if any.
        """
        found = self._checkpoints.find(path)
        if found is not None:
            self._checkpoints.load(found, state, verify=False)
        self.replication.resumed(state, found.metadata if found is not None else None,
                                 found.step if found is not None else 0)
        return found

    def join(self, state: dict[str, Any], step: int) -> None:
        """Fault tolerance: join the replica groups with ``state`` (as given to ``rt.save``) at committed
        step ``step``. A group behind the live ones receives their state into ``state`` (models,
        optimizers, loaders and other objects with ``load_state_dict`` in place; plain values replaced);
        a live group sends its own ``state`` to each group that joins later. ``rt.resume`` calls it
        after loading the newest checkpoint; every rank calls it once, before the first batch."""
        self.replication.join(state, step)

    def verify_checkpoint(self, path: str | Path) -> list[str]:
        """Every problem with the files of checkpoint ``path`` (none when intact: each file matches the
        checksum written at commit, and nothing in it would run code). Every rank calls it, reads its
        share of the files, and gets the same list."""
        return self._checkpoints.verify(path)

    def prepare_checkpoint_folder(self, path: str | Path) -> None:
        """Before training: remove what interrupted saves left in the folder ``path``, and check that
        every rank can write into it, so that a read-only or missing folder fails now, naming itself
        and the ranks, instead of at the first save. Every rank calls it."""
        self._checkpoints.prepare_folder(path)

    def wait_for_save(self) -> None:
        """Block until a background save (``save(blocking=False)``) is written and committed; raise its
        error if it failed. Returns at once when none is under way. Every rank calls it."""
        self._checkpoints.wait()

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
        idle = SimpleNamespace(wait=lambda report: None, stop=lambda: None, close=lambda: None)  # what a failed
        self.__dict__.get("_checkpoints", idle).wait(report=False)  # start (the ranks disagree) never made
        self.__dict__.get("_watchdog", idle).stop()
        self.__dict__.get("replication", idle).close()
        if self.__dict__.get("_owns_group"):
            self._owns_group = False
            for ref in self._wrapped:
                module = ref()
                if module is not None:
                    self.strategy.release(module)
            gc.collect()  # pending work objects sit in reference cycles: free them while the group lives
            process_group.destroy_process_group()

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
    named = config.strategy.lower() if isinstance(config.strategy, str) else None  # "DDP" as "ddp", as elsewhere
    one_per_device = named in ("auto", "ddp", "fsdp") or isinstance(config.strategy, (DDP, FSDP))
    if env.capabilities.started_alone and one_per_device:
        nproc = processes_asked_for(config.accelerator or "auto", config.devices)
        if nproc > 1:
            from lockstep.runtime.launch.elastic import self_launch  # the agent's code: only where it runs

            self_launch(nproc)


class _RankLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank'] if self.extra else 0}] {msg}", kwargs


__all__ = ["Runtime", "unwrap"]
