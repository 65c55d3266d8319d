"""Rendezvous: exchanging small byte strings between the ranks of a group, once per group.

Two transports: a torch ``Store`` (TCPStore from torchrun's environment, or the store behind an
initialised torch.distributed default group) under a key prefix per group, or object collectives
on a torch.distributed process group when no store is reachable.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, TypeVar

import torch.distributed as dist

from .. import _C

_T = TypeVar("_T")
_PidsIn = Callable[[List[bytes]], Dict[int, int]]  # the parts of an all_gather -> pids on this host

# How often a rendezvous wait checks whether the ranks it waits for still run.
_LIVENESS_S = 0.05
_CONNECT_TRY_S = 1.0  # a store client's connect attempt, retried until FAIRSCALE_C_TIMEOUT


def timeout_s() -> float:
    """FAIRSCALE_C_TIMEOUT in seconds (default 600), parsed by the C core's one parser: a finite
    number in (0, 1e9]; anything else is a ValueError naming the variable and its value."""
    return _C._comm_timeout_s()


def pid_exited(pid: int) -> bool:
    """True when process ``pid`` (of this host and pid namespace) no longer runs: gone, or a
    zombie nobody has reaped yet (the C engine's rule for peers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


class Exchange:
    """Moves bytes between the ``size`` ranks of one group; every rank calls each method in the
    same order."""

    rank: int
    size: int

    def all_gather(
        self, data: bytes, pids: Optional[Dict[int, int]] = None, pids_in: Optional[_PidsIn] = None
    ) -> List[bytes]:
        """Every rank's ``data``, in rank order. With ``pids`` (rank -> pid, ranks on this host),
        a rank whose process has exited is reported at once instead of at the timeout; with
        ``pids_in`` (the parts -> such a mapping), the same once the parts are in (for the rest of
        the exchange, where the ranks confirm they have read them)."""
        raise NotImplementedError

    def broadcast(self, data: Optional[bytes]) -> bytes:
        """Group rank 0's ``data`` on every rank (others pass None)."""
        raise NotImplementedError

    def peek(self, rank: int) -> Optional[bytes]:
        """What ``rank`` has already published for the next all_gather, or None (not yet, or this
        exchange cannot tell without taking part). Never blocks."""
        return None

    def sub(self, ranks: Sequence[int], index: int) -> "Exchange":
        """An exchange for the members ``ranks`` (ranks of this group); called by members only.
        ``index`` numbers the subgroup among this group's subgroups: every rank of the group counts
        each new_group call, member or not, so the members of one subgroup agree on it."""
        raise NotImplementedError


class StoreExchange(Exchange):
    def __init__(self, store: "dist.Store", prefix: str, rank: int, size: int, name: str) -> None:
        self.store, self.prefix, self.rank, self.size, self.name = store, prefix, rank, size, name
        self._round = 0

    def _wait(self, keys: List[str], what: str, ranks: List[int], pids: Optional[Dict[int, int]] = None) -> None:
        # Poll rather than store.wait(): at the deadline we then know exactly which ranks are
        # missing without asking a store whose host may already have gone.
        t = timeout_s()
        deadline, pause, checked = time.monotonic() + t, 0.001, time.monotonic()
        pending = dict(zip(ranks, keys))
        while True:
            # pids known: a missing rank whose process has exited is reported now, not at the
            # deadline (its key is checked again after its death was seen)
            dead = []
            if pids and time.monotonic() - checked > _LIVENESS_S:
                checked = time.monotonic()
                dead = [r for r in pending if r in pids and pid_exited(pids[r])]
            pending = self._call(
                what,
                f"while waiting for rank(s) {', '.join(map(str, pending))}",
                lambda p=pending: {r: k for r, k in p.items() if not self.store.check([k])},  # type: ignore[misc]
            )
            if not pending:
                return
            dead = [r for r in dead if r in pending]
            if dead:
                raise _C.DistributedError(
                    f"rendezvous ({what}) of group '{self.name}' (rank {self.rank} of {self.size}): "
                    + ", ".join(f"rank {r} (pid {pids[r]})" for r in dead)  # type: ignore[index]
                    + " exited before taking part"
                )
            if time.monotonic() > deadline:
                raise _C.DistributedError(
                    f"rendezvous ({what}) of group '{self.name}' (rank {self.rank} of {self.size}): "
                    f"rank(s) {', '.join(map(str, pending))} did not join within FAIRSCALE_C_TIMEOUT={t:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, _LIVENESS_S)

    def _call(self, what: str, when: str, fn: Callable[[], _T]) -> _T:
        """fn(), a store operation; a store that fails (its host gone, the connection reset) is
        a DistributedError naming the group, the exchange and `when`."""
        try:
            return fn()
        except Exception as exc:
            raise _C.DistributedError(
                f"rendezvous ({what}) of group '{self.name}' (rank {self.rank} of {self.size}): the store "
                f"became unreachable {when} ({exc.__class__.__name__}: {exc})"
            ) from None

    def all_gather(
        self, data: bytes, pids: Optional[Dict[int, int]] = None, pids_in: Optional[_PidsIn] = None
    ) -> List[bytes]:
        base = f"{self.prefix}/ag{self._round}"
        self._round += 1
        mine = f"{base}/{self.rank}"
        self._call("all_gather", "while publishing this rank's part", lambda: self.store.set(mine, data))
        keys = [f"{base}/{r}" for r in range(self.size)]
        self._wait(keys, "all_gather", list(range(self.size)), pids)
        parts = self._call("all_gather", "while reading the parts", lambda: [bytes(self.store.get(k)) for k in keys])
        if pids_in is not None:
            pids = pids_in(parts)
        self._read_by_all(base, keys, "all_gather", pids)
        return parts

    def _read_by_all(self, base: str, keys: List[str], what: str, pids: Optional[Dict[int, int]] = None) -> None:
        """Say this rank has read round ``base`` (its data in ``keys``); rank 0 returns once every
        rank has, and then deletes the round's keys, so a long job's store does not grow with every
        group and shared allocation. The store usually lives in rank 0's process, and rank 0 may
        raise on what it read (a group that spans hosts, say) and exit: the others then still get
        to read it."""
        done = f"{base}/read"
        self._call(what, "while saying it has read", lambda: self.store.set(f"{done}/{self.rank}", b"1"))
        if self.rank == 0:
            acks = [f"{done}/{r}" for r in range(self.size)]
            self._wait(acks, what, list(range(self.size)), pids)
            for key in keys + acks:
                try:
                    self.store.delete_key(key)
                except Exception:  # noqa: BLE001 - a store without delete_key only keeps the keys
                    return

    def peek(self, rank: int) -> Optional[bytes]:
        key = f"{self.prefix}/ag{self._round}/{rank}"
        if not self._call("all_gather", "while looking for an early part", lambda: self.store.check([key])):
            return None
        return self._call("all_gather", "while reading an early part", lambda: bytes(self.store.get(key)))

    def broadcast(self, data: Optional[bytes]) -> bytes:
        key = f"{self.prefix}/bc{self._round}"
        self._round += 1
        if self.rank == 0:
            payload = data if data is not None else b""
            self._call("broadcast", "while publishing the value", lambda: self.store.set(key, payload))
        self._wait([key], "broadcast", [0])
        value = self._call("broadcast", "while reading the value", lambda: bytes(self.store.get(key)))
        self._read_by_all(key, [key], "broadcast")
        return value

    def sub(self, ranks: Sequence[int], index: int) -> "Exchange":
        # The members first meet under their sorted ranks and compare the lists they were given:
        # one given in another order would otherwise wait for peers under another key until the
        # timeout, and be told a rank that did call did not join.
        members = sorted(ranks)
        check = StoreExchange(
            self.store,
            f"{self.prefix}/sub{index}/order[{'-'.join(map(str, members))}]",
            members.index(self.rank),
            len(members),
            f"{self.name}/sub{index}",
        )
        given = check.all_gather(",".join(map(str, ranks)).encode())
        if len(set(given)) > 1:
            raise ValueError(
                f"new_group: the ranks of group '{self.name}' gave the subgroup's ranks in different orders ("
                + "; ".join(f"rank {r}: [{g.decode()}]" for r, g in zip(members, given))
                + "); every rank must give the same list, whose order is the subgroup's rank order"
            )
        tag = "-".join(map(str, ranks))
        return StoreExchange(
            self.store,
            f"{self.prefix}/sub{index}[{tag}]",
            list(ranks).index(self.rank),
            len(ranks),
            f"{self.name}/sub{index}",
        )


class ProcessGroupExchange(Exchange):
    """Object collectives on a torch.distributed group (its own timeout applies)."""

    def __init__(self, pg: "dist.ProcessGroup", name: str) -> None:
        self.pg, self.name = pg, name
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)

    def all_gather(
        self, data: bytes, pids: Optional[Dict[int, int]] = None, pids_in: Optional[_PidsIn] = None
    ) -> List[bytes]:
        # torch's collective notices a peer that exits (its connection closes) on its own
        out: List[Optional[bytes]] = [None] * self.size
        dist.all_gather_object(out, data, group=self.pg)
        return [bytes(x) for x in out]  # type: ignore[arg-type]

    def broadcast(self, data: Optional[bytes]) -> bytes:
        obj = [data]
        dist.broadcast_object_list(obj, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return bytes(obj[0])  # type: ignore[arg-type]

    def sub(self, ranks: Sequence[int], index: int) -> "Exchange":
        raise RuntimeError("internal: subgroups of a process-group exchange are built with torch's new_group")


def default_store() -> Optional["dist.Store"]:
    """The store behind torch.distributed's default group, when torch exposes it."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


class _NoAnswer(Exception):
    pass


def _answered_within(seconds: float, make: Callable[[], _T]) -> _T:
    """make() on a thread of its own, waited for `seconds`. torch's TCPStore client has no
    deadline once connected: a host that accepts the connection and never answers (its process
    stopped mid-handshake) would hold the caller forever. The thread is left to that wait."""
    box: Dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = make()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="fairscale_c-store-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise _NoAnswer("the host accepted the connection but did not answer")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def env_store() -> "dist.Store":
    """A TCPStore from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    Under torchrun the agent already hosts the store; otherwise rank 0 hosts it."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "fairscale_c.distributed: torch.distributed is not initialised and the environment lacks "
            f"{', '.join(missing)}; launch with torchrun or call torch.distributed.init_process_group first"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    t = timeout_s()  # a ValueError of its own, not "cannot reach the TCPStore"
    master = rank == 0 and not agent
    deadline = time.monotonic() + t
    try:
        while True:
            # A client's connect retries with pauses that grow past the timeout it is given:
            # short tries, until the deadline. wait_for_workers=False: a rank that never comes is
            # reported by the first exchange, which can name it, rather than by the store's
            # constructor.
            left = deadline - time.monotonic()
            try_s = max(0.1, min(_CONNECT_TRY_S, left))
            make = functools.partial(
                dist.TCPStore,
                addr,
                port,
                world,
                is_master=master,
                timeout=datetime.timedelta(seconds=t if master else try_s),
                wait_for_workers=False,
                # torch's env:// rendezvous, if the user initialises torch.distributed after
                # this, starts its store on the same port: one server for both, as torch's are
                multi_tenant=True,
            )
            try:
                # a try that finds no host returns within about 3x its timeout (torch's client
                # pauses up to twice it before its last attempt); one still running past that,
                # and past the deadline, is held by a host that accepted and does not answer
                store = make() if master else _answered_within(max(left, 3 * try_s + 1), make)
            except _NoAnswer:
                raise
            except Exception:
                if master or time.monotonic() + 0.05 >= deadline:
                    raise
                time.sleep(0.05)
                continue
            store.set_timeout(datetime.timedelta(seconds=t))
            return store
    except Exception as exc:
        why = str(exc) if isinstance(exc, _NoAnswer) else f"{exc.__class__.__name__}: {exc}"
        raise _C.DistributedError(
            f"rendezvous (rank {rank} of {world}): cannot reach the TCPStore at {addr}:{port} within "
            f"FAIRSCALE_C_TIMEOUT={t:g} s ({why})"
        ) from None
