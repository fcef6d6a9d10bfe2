"""Fault tolerance without a restart: replica groups that leave and join between two steps.

A fault-tolerant job is several replica groups. Inside a group, the Runtime's own process group and
strategy (one process, DDP, FSDP, tensor parallel); across groups, torchft: a lighthouse forms a
quorum of the live groups before every step, and the gradients are averaged over the quorum's
members through torchft's reconfigurable process group. A group that dies is dropped at the next
quorum; a group that starts later takes its state from a live peer, not from disk.

Exactness, the promise (docs/fault-tolerance.md):

- the quorum is synchronous, so the participants of step ``s`` are known before its forward: the
  data-parallel ``Membership`` becomes this group's share of them, and the loaders split global
  batch ``s`` over the participants (the global batch never shrinks; no sample is lost or read twice);
- ``s`` is the number of committed steps: a group whose step does not commit (a participant died
  during it) steps none of its optimizers, and its loaders serve the same global batch again, split
  over the new quorum; each group votes on its own (torchft), so a group that failed alone is a step
  behind at the next quorum and takes a live group's state;
- the loss weights come from the participants' shares of the global batch, and the cross-group
  average divides by the same number of participants, so the gradients are those of the mean loss
  over the global batch, whoever computed them.

One step timeout sets every wait (``FaultTolerance.timeouts``).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lockstep.env.fault_tolerance import FaultTolerance, import_torchft
from lockstep.env.lines import printable
from lockstep.env.settings import straggler_factor_from_environ
from lockstep.errors import CollectiveError, ConfigError, StateError
from lockstep.runtime.fault_tolerance._torchft_compat import manager_bound_to, record_quorums
from lockstep.runtime.fault_tolerance.alarm import Alarm
from lockstep.runtime.fault_tolerance.pace import GroupPace
from lockstep.runtime.parallel.mesh import Membership
from lockstep.runtime.parallel.wrappers import unwrap
from lockstep.runtime.seed import RandomStates, capture_rng, restore_rng

#: The key of a rank's random states in what a joining group receives (beside the user's own keys).
_RANDOM = "lockstep.random_states"
#: Steps in a row that may fail to commit (a member lost at each) before the job ends with the cause.
MAX_FAILED_STEPS = 20


def _manager_store(index: int, address: str, group_size: int) -> tuple[Any, int]:
    """The store of a group's torchft manager, and its port: what the other groups reach this one by
    (its manager, its store) is the address of its own rendezvous, ``MASTER_ADDR``, which ``lockstep run
    --fault-tolerant`` puts on the node's address towards the lighthouse's node when the groups span
    several nodes (else loopback). A group of one process has no store of its own: the manager's is
    hosted here (returned, to keep it alive); a larger group's is its rendezvous store (None)."""
    if group_size > 1:
        return None, int(os.environ["MASTER_PORT"])
    from lockstep.runtime.comm.network import host_store

    try:
        return host_store(address)
    except OSError as error:
        raise ConfigError(f"replica group {index}: cannot listen on MASTER_ADDR={address} ({error.strerror}): it "
                          "must be an address of this node (lockstep run --fault-tolerant sets it).") from None


def _group_index(replica_id: object) -> int:
    """The group index in a torchft replica id (``lockstep_<index>:<uuid>``). Anything else joined the
    lighthouse from outside this job (its port is reachable by whoever reaches its address): refused, since
    a participant's gradients go into every group's step."""
    found = re.fullmatch(r"lockstep_(\d{1,6}):[0-9a-f-]{1,64}", replica_id) if isinstance(replica_id, str) else None
    if found is None:
        shown = printable(replica_id, 80)
        raise CollectiveError(f"a replica {shown!r} that is not one of this job's groups joined the lighthouse's "
                              "quorum: stop it, and keep the lighthouse's address reachable only by the job's nodes "
                              "(lockstep run --fault-tolerant binds it to loopback on one node).")
    return int(found.group(1))


class ReplicaGroups:
    """This replica group's seat in a fault-tolerant job, over torchft's ``Manager``.

    ``membership`` (the Runtime's data-parallel one) becomes, at every quorum, this rank's place among
    the participants' data-parallel ranks: participant ``p`` of ``P`` holds data-parallel ranks
    ``p * D .. p * D + D - 1`` of ``P * D``, ``D`` being a group's own data-parallel size.

    The life of a step: ``next_step`` (a training loader asks it before drawing a batch) takes the
    quorum when the last step was decided (or never taken), and says which step to draw: the same one
    again after a step that did not commit; ``reduce_gradients`` averages the gradients over the
    participants (once a step); ``commit`` asks every participant whether the step may be taken (once
    a step). ``state`` (given to ``rt.resume``) is what a joining group receives from a live peer.
    """

    def __init__(self, config: FaultTolerance, membership: Membership, group_rank: int, group_size: int,
                 device: torch.device, say: Callable[[str], None], seed: int = 0) -> None:
        import_torchft()
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.config, self.membership, self.say, self.device = config, membership, say, device
        self.index = int(config.replica_group or 0)
        self.local_rank, self.local_size = membership.rank, membership.size  # inside the group
        timeouts = config.timeouts()
        collective = timedelta(seconds=timeouts.collective)
        self._pg = pg = (ProcessGroupNCCL(timeout=collective) if device.type == "cuda"
                         else ProcessGroupGloo(timeout=collective))
        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._store, store_port = _manager_store(self.index, address, group_size)
        self.state: dict[str, Any] | None = None
        with manager_bound_to(address, self.index) if group_rank == 0 else contextlib.nullcontext():
            # rank 0 of the group builds its torchft manager's gRPC server (Kill, ShouldCommit, Quorum): on this
            # address only
            self.manager = Manager(
                pg=pg, load_state_dict=self._load_state, state_dict=self._state_dict,
                min_replica_size=config.min_replicas, use_async_quorum=False, timeout=collective,
                quorum_timeout=timedelta(seconds=timeouts.quorum), connect_timeout=timedelta(seconds=timeouts.connect),
                rank=group_rank, world_size=group_size, store_addr=address, store_port=store_port, hostname=address,
                lighthouse_addr=config.lighthouse, replica_id=f"lockstep_{self.index}",
                heartbeat_interval=timedelta(milliseconds=100), max_retries=MAX_FAILED_STEPS,
                checkpoint_transport=PGTransport(pg, timeout=collective, device=device),
            )
        self._recorder = record_quorums(self.manager)
        self._alarm = Alarm(group_rank, timeouts.connect, device.type == "cuda")
        self._members: list[int] = []  # the group indices of the last quorum, in participant order
        self._decided: bool | None = True  # the last step's commit decision (None: a step is under way)
        self._reduced = False
        self._step_start: tuple[Any, int] | None = None  # the loader and position where the current step began
        self._step_rng: dict[str, Any] | None = None  # the random states at the current step's start
        self.committed: bool | None = None  # whether the last optimizer step was taken
        self._stalled_since: float | None = None
        self._fresh = False  # a quorum was taken (by start) and no step has used it yet
        self._seed = seed
        self._fingerprint: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._checked_quorum: Any = None  # the last quorum whose members compared their fingerprints
        self._step_began = time.monotonic()
        self._closed = False
        # the groups' pace: a group the others wait for is named (its slots ride along, the report on or off)
        self._pace = GroupPace(straggler_factor_from_environ(), self._say_first, group_rank == 0)

    # -- the quorum ------------------------------------------------------------------------
    def quorum(self) -> None:
        """Take the quorum of step ``manager.current_step()``: heal from a peer if this group is behind,
        then make this rank's data-parallel membership its share of the participants."""
        previous, before = self._members, self._recorder.last
        try:
            self.manager.start_quorum()
        except Exception as error:  # torchft raises what its RPC raised: a timeout, a lost lighthouse
            if self._recorder.last is not before:  # the quorum formed: loading a live group's state failed
                raise CollectiveError(f"replica group {self.index} could not load the state of a live group "
                                      f"({type(error).__name__}: {error}): start every group with the same "
                                      "script and model.") from error
            raise CollectiveError(self._quorum_failure(error)) from error
        quorum = self._recorder.last
        if quorum is None:
            raise CollectiveError(f"replica group {self.index}: the lighthouse returned no quorum.")
        members = [_group_index(name) for name in quorum.replica_ids]
        self._members = members
        rank, size = self.manager.participating_rank(), self.manager.num_participants()
        if rank is None:
            raise CollectiveError(f"replica group {self.index} is not among the participants of step "
                                  f"{self.manager.current_step()} (groups {members}).")
        self.membership.change(rank * self.local_size + self.local_rank, size * self.local_size)
        self._alarm.arm(quorum, self.manager.current_step())
        self._report(previous, members, quorum)
        if quorum.quorum_id != self._checked_quorum:  # the members changed: every one of them compares
            self._checked_quorum = quorum.quorum_id
            self._check_same_job(members, rank, size)
        self._step_began = time.monotonic()  # a failure while re-forming the group (a member died in it)
        # leaves the manager errored: the step then does not commit, and the next quorum tries again

    def _report(self, previous: list[int], members: list[int], quorum: Any) -> None:
        """One line for each change: who left, who joined, who healed from whom, how long the step stalled."""
        parts = []
        if previous and previous != members:
            left, joined = sorted(set(previous) - set(members)), sorted(set(members) - set(previous))
            parts += [f"left {left}"] if left else []
            parts += [f"joined {joined}"] if joined else []
        if quorum.heal and quorum.max_step > 0:
            parts.append(f"group {self.index} healed from group {members[quorum.recover_src_replica_rank]}")
        if not parts:
            return
        if self._stalled_since is not None:
            parts.append(f"the step stalled {time.monotonic() - self._stalled_since:.2f} s")
        self.say(f"fault tolerance: step {self.manager.current_step()}, groups {members}: " + ", ".join(parts))

    def _check_same_job(self, members: list[int], rank: int, size: int) -> None:
        """Refuse a group started with another model, seed or global batch, by name: the participants
        exchange their fingerprints (one small all-reduce, at each change of members); a group that
        differs from the most of them raises, the others say so and go on without it."""
        table = torch.zeros(size, 3, dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        table[rank] = torch.tensor(self._fingerprint, dtype=torch.float64)
        self._all_reduce(table, average=False)
        if self.manager.errored() is not None:
            return  # a participant died meanwhile: this step will not commit, the next quorum checks again
        rows = [tuple(row) for row in table.tolist()]
        what = ("model (its parameters' names, shapes or dtypes)", "seed", "global batch size or dataset length")
        for column, name in enumerate(what):
            values = [row[column] for row in rows]
            usual = max(values, key=lambda value: (values.count(value), -values.index(value)))
            odd = [members[i] for i, value in enumerate(values) if value != usual]
            if not odd:
                continue
            alike = [members[i] for i, value in enumerate(values) if value == usual]
            if self.index in odd:
                raise ConfigError(f"replica group {self.index} was started with another {name} than groups "
                                  f"{alike}: start every group with the same script, arguments and data.")
            self.say(f"fault tolerance: replica group(s) {odd} refused: another {name} than groups {alike}")

    def _quorum_failure(self, error: BaseException) -> str:
        known = ", ".join(str(i) for i in self._members if i != self.index) or "none yet"
        return (f"replica group {self.index}: no quorum of at least {self.config.min_replicas} live group(s) "
                f"formed within {self.config.timeouts().quorum:g} s at step {self.manager.current_step()} "
                f"(the other groups of the last quorum: {known}). Start the missing groups, or lower "
                f"min_replicas; the newest checkpoint stands ({type(error).__name__}: {error})")

    # -- one step --------------------------------------------------------------------------
    def next_step(self, loader: Any, step: int) -> int:
        """The step a training loader draws next, asked before each of its batches: ``step`` while a
        step is under way (its micro-batches); else the quorum is taken first, and the step is the one
        that did not commit (drawn again), or where a heal put the loader."""
        if self._decided is None:
            return step
        if self._decided is False and self._step_rng is not None:  # the step is drawn again: so are its randoms
            restore_rng(self._step_rng)
        if self.state is None:
            raise StateError("fault tolerance: call rt.resume(folder, state) before the first batch, with the "
                             "state to save (model, optimizer, loader, ...): a group that joins later receives it "
                             "from a live one, and the newest checkpoint in `folder` is where a restart begins.")
        if self._decided is False and self._step_start is not None and self._step_start[0] is loader:
            step = self._step_start[1]
        elif step >= len(loader):
            return step  # the pass ends here: the next pass's first batch takes the quorum
        loader.rewind(step)  # what a joining peer receives is this position
        if not self._fresh:
            self.quorum()
        self._fresh = False
        step = loader.healed_position(step)
        self._decided, self._reduced, self._step_start = None, False, (loader, step)
        self._step_rng = capture_rng()
        return step

    def reduce_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Average the gradients over the participants (once a step; a group's own ranks already
        averaged theirs). A participant lost during it makes the step fail to commit.

        The all-reduce's layout is the optimizers' trained parameters, the same in every group: a parameter
        without a gradient here (no row of this group's share used it: an expert, a head) takes part as zeros,
        with a flag, and gets the average where another group's share used it."""
        if self._reduced:
            return
        self._reduced = True
        trained = [p for p in parameters if p.requires_grad]
        if not trained:
            return
        present = [p.grad is not None for p in trained]
        local = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in trained]
        like, participants = local[0], self.manager.num_participants()
        had = (torch.ones(len(trained), dtype=like.dtype, device=like.device) if all(present)  # no copy from the
               else torch.tensor(present, dtype=like.dtype, device=like.device))  # host on the usual path
        # each participant's own time of its previous step, in a slot of its own (the groups' pace)
        slots = self._pace.slots(self.manager.participating_rank() or 0, participants, like)
        flat = torch.cat([*(g.reshape(-1) for g in local), had, slots])
        self._all_reduce(flat, average=True)
        self._pace.reduced(flat[-participants:] * participants, self._members, self.manager.current_step(),
                           valid=self.manager.errored() is None)
        offset, missing = 0, []
        for index, (p, g) in enumerate(zip(trained, local, strict=True)):
            part = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
            if present[index]:
                g.copy_(part)
            else:
                missing.append((index, p, part))
        if missing:  # rare: the flags are read (a device sync) only when this group lacks a gradient
            used = (flat[offset:offset + len(trained)] > 0).tolist()
            for index, p, part in missing:
                if used[index]:
                    p.grad = torch.zeros_like(p)
                    _local(p.grad).copy_(part)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the participants (the item counts of ``num_items``)."""
        out = value.clone()
        self._all_reduce(out, average=False)
        return out

    def _all_reduce(self, tensor: torch.Tensor, average: bool) -> None:
        """Sum ``tensor`` over the participants in place (then divide by their number), straight on
        torchft's process group: what ``Manager.allreduce`` does, without its chain of futures and
        their timeout thread (4 ms a step on 2 CPU cores). A failure (a participant died) is reported
        to the manager, so the step does not commit, and told to the other participants (``_Alarm``):
        a participant whose all-reduce waits on one that failed (Gloo's abort closes no connection)
        stops waiting at once instead of at its timeout."""
        from torch.distributed import AllreduceOptions, ReduceOp

        if self.manager.errored() is not None:
            return
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stub types it as the enum's class
        work = None
        try:
            work = self._pg.allreduce([tensor], options)
            self._alarm.wait(work)
        except RuntimeError as error:  # a lost participant: Gloo and NCCL raise what the transport said
            self.manager.report_error(error)
            self._alarm.fail(self._pg, work)
            return
        if average:
            tensor /= self.manager.num_participants()

    def commit(self) -> bool:
        """Whether every participant may take this step (asked once a step; the same answer after)."""
        if self._decided is None:
            try:
                self._decided = self.committed = bool(self.manager.should_commit())
            except RuntimeError as error:  # torchft's max_retries: too many steps in a row did not commit
                raise CollectiveError(f"replica group {self.index}: {error}; the last failure: "
                                      f"{self.manager.errored()}") from error
            if self._decided:
                self._stalled_since = None
            elif self._stalled_since is None:
                self._stalled_since = self._step_began
        return bool(self._decided)

    @property
    def in_step(self) -> bool:
        """A step's quorum was taken and its commit not yet decided."""
        return self._decided is None

    @property
    def step(self) -> int:
        """The number of steps committed so far (by every participant)."""
        return int(self.manager.current_step())

    # -- state: from a checkpoint, to and from a peer ----------------------------------------
    def start(self, state: dict[str, Any], step: int) -> None:
        """Begin from ``state`` at committed step ``step`` (0, or a checkpoint's), then take the first
        quorum, which heals this group from a live peer when the peers are further on."""
        self.state = state
        self._fingerprint = _fingerprint(state, self._seed)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.quorum()
        self._wait_for_groups(step)
        self._fresh = True

    def _wait_for_groups(self, step: int) -> None:
        """At the first quorum, until it holds ``start_with`` groups: the groups started with this one
        may still be starting (a group left out of step 0 would heal at step 1, its whole state sent
        over the network), and a replacement's live peers ask for their quorum at their next step. When
        they do not come within the step timeout (a group died before its first step, the job has ended),
        this group trains with those it has, and says so."""
        want = self.config.start_with
        quorum = self._recorder.last
        if quorum is not None and quorum.max_step > step:  # (not quorum.heal: torchft heals at step 0 too)
            return  # it joins groups already training: they take no quorum again before their next step
        deadline = time.monotonic() + self.config.step_timeout
        while len(self._members) < want:
            # the members of this quorum give up together (at the first one's deadline), and so do a group's own
            # ranks: one that trained on while another asked for a quorum again would wait for it in an all-reduce
            late = torch.tensor([float(time.monotonic() >= deadline)], device=self.device)
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX)  # this group's ranks
            self._all_reduce(late, average=False)
            if late.item() > 0 or self.manager.errored() is not None:
                break
            time.sleep(0.5)
            self.quorum()
        if len(self._members) < want:
            self.say(f"fault tolerance: replica group {self.index} waited {self.config.step_timeout:g} s for "
                     f"{want} groups at its first quorum; it trains on from step {step} with groups {self._members}")

    def _state_dict(self) -> dict[str, Any]:
        """What a joining group receives from this one (asked at a step's start, in the quorum): the
        ``state`` given to ``start``, and this rank's random states, the same rank's of the joining group."""
        assert self.state is not None
        return {_RANDOM: capture_rng(), **{key: _state_of(value) for key, value in self.state.items()
                                            if not isinstance(value, RandomStates)}}  # every rank's: a collective

    def _load_state(self, received: dict[str, Any]) -> None:
        assert self.state is not None
        randoms = received.pop(_RANDOM, None)
        for key, value in received.items():
            target = self.state.get(key)
            if key in self.state and _has_state(target):
                _unwrapped(target).load_state_dict(value)
            else:
                self.state[key] = value
        if randoms is not None:  # last: loading the state may draw none after it
            restore_rng(randoms)

    # -- what the Runtime asks of its replication (replication.py) --------------------------
    fault_tolerant = True

    @property
    def gate(self) -> Callable[[Any, int], int]:
        return self.next_step

    def evaluation_membership(self, membership: Membership) -> Membership:
        """A group evaluates the whole data over its own ranks (the groups' membership changes; each
        group's evaluation is its own)."""
        return Membership(membership.rank, membership.size)

    def save(self, save: Callable[..., float], path: Any, state: dict[str, Any], blocking: bool,
             metadata: dict[str, Any] | None, on_commit: Callable[[], None] | None) -> float:
        """The first replica group of the step writes the checkpoint, adding the committed steps to its
        metadata; the others return 0.0 at once."""
        if self.manager.participating_rank() != 0:
            return 0.0
        return save(path, state, blocking, {**(metadata or {}), "committed_steps": self.step}, on_commit)

    def resumed(self, state: dict[str, Any], metadata: dict[str, Any] | None, step: int) -> None:
        """After ``rt.resume`` loaded a checkpoint (``metadata`` and ``step``; None and 0 without one): join
        the groups at the committed step it stands for."""
        self.start(state, int((metadata or {}).get("committed_steps", step)))

    def join(self, state: dict[str, Any], step: int) -> None:
        self.start(state, step)

    @property
    def step_committed(self) -> bool:
        return bool(self.committed)

    def _say_first(self, line: str) -> None:
        """Said by the first participant's group alone (every group's rank 0 judges the same numbers)."""
        if self.manager.participating_rank() == 0:
            self.say(line)

    def step_times(self) -> dict[str, Any]:
        return self._pace.report()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manager.shutdown(wait=False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (FSDP's shard of a DTensor), else the tensor."""
    return getattr(tensor, "_local_tensor", tensor)


def _unwrapped(value: Any) -> Any:
    return unwrap(value) if isinstance(value, nn.Module) else value


def _has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _state_of(value: Any) -> Any:
    return _unwrapped(value).state_dict() if _has_state(value) else value


def _fingerprint(state: dict[str, Any], seed: int) -> tuple[float, float, float]:
    """What every group of one job shares, as three numbers exact in float64: the models' parameter
    names, shapes and dtypes; the seed; the training loaders' global batch sizes and dataset lengths."""
    models, data = [], []
    for key, value in state.items():
        module = _unwrapped(value)
        if isinstance(module, nn.Module):
            models.append((key, [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]))
        batch_size = getattr(getattr(value, "sampler", None), "batch_size", None)
        if batch_size is not None:
            data.append((key, batch_size, len(getattr(value, "dataset", ()) or ())))
    return (float(zlib.crc32(repr(models).encode())), float(seed % 2**48), float(zlib.crc32(repr(data).encode())))
