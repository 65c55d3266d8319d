"""Peer graphs for gossip: which rank sends to which at each iteration.

A graph keeps, for every logical rank (one per node), a "phone book" of out-edges; each
iteration a rank uses ``peers_per_itr`` of them, and dynamic graphs move on to the next ones
after every gossip. The topologies are FairScale's, edge for edge: the phone books are built with
the same formulas (``int(math.log(world_size - 1, base))`` included), and, as in FairScale, a peer
reached by two formulas appears twice (a ring of two ranks has two edges to the other rank).
Edges carry process ranks (logical rank * ``nprocs_per_node``); they name peers only, the messages
travel on the gossip's engine group, so no process group is built per edge."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import List, Optional, Tuple
from .....internal.args import as_int


class Edge:
    """A directed edge from process rank ``src`` to process rank ``dest``."""

    __slots__ = ("src", "dest", "process_group")

    def __init__(self, local_master_rank: int, dest: int, src: int, local_rank: int) -> None:
        self.src, self.dest = int(src), int(dest)
        self.process_group = None  # messages go through the gossiper's group, not a group per edge

    def __repr__(self) -> str:
        return f"Edge(src={self.src}, dest={self.dest})"


def _check_int(name: str, value: object, low: int) -> int:
    if as_int(value) is None or value < low:
        raise ValueError(f"GraphManager: argument '{name}' must be an int >= {low}, got {value!r}")
    return as_int(value)


class GraphManager(ABC):
    """The out- and in-peers of logical rank ``rank`` among ``world_size`` logical ranks (nodes)."""

    def __init__(
        self, rank: int, world_size: int, nprocs_per_node: int = 1, local_rank: int = 0, peers_per_itr: int = 1
    ) -> None:
        self.world_size = _check_int("world_size", world_size, 2)
        self.rank = _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"GraphManager: argument 'rank' must be < world_size ({world_size}), got {rank}")
        self.nprocs_per_node = _check_int("nprocs_per_node", nprocs_per_node, 1)
        self.local_rank = _check_int("local_rank", local_rank, 0)
        self._peers_per_itr = _check_int("peers_per_itr", peers_per_itr, 1)
        self._group_indices = list(range(peers_per_itr))
        self.phone_book: List[List[Edge]] = [[] for _ in range(world_size)]
        self._make_graph()
        short = min(len(book) for book in self.phone_book)
        if short < peers_per_itr:
            raise ValueError(
                f"{type(self).__name__}: argument 'peers_per_itr' ({peers_per_itr}) exceeds the {short} out-edges "
                f"a rank has at world size {world_size}"
            )

    @property
    def peers_per_itr(self) -> int:
        return self._peers_per_itr

    @peers_per_itr.setter
    def peers_per_itr(self, v: int) -> None:
        self._peers_per_itr = _check_int("peers_per_itr", v, 1)
        self._group_indices = list(range(v))

    @abstractmethod
    def _make_graph(self) -> None:
        """Fill ``self.phone_book``: for every logical rank, the peers it may send to."""

    def _add_peers(self, rank: int, peers: List[int]) -> None:
        book = self.phone_book[rank]
        for peer in peers:
            book.append(
                Edge(
                    local_master_rank=self.rank * self.nprocs_per_node,
                    dest=peer * self.nprocs_per_node,
                    src=rank * self.nprocs_per_node,
                    local_rank=self.local_rank,
                )
            )

    @abstractmethod
    def is_regular_graph(self) -> bool:
        """Whether every node has as many in-peers as out-peers."""

    @abstractmethod
    def is_bipartite_graph(self) -> bool:
        """Whether the graph is bipartite."""

    @abstractmethod
    def is_passive(self, rank: Optional[int] = None) -> bool:
        """Whether ``rank`` (default: this one) is a passive node of a bipartite graph."""

    @abstractmethod
    def is_dynamic_graph(self) -> bool:
        """Whether the peers change from one iteration to the next."""

    def _in_edges(self) -> List[Edge]:
        me = self.rank * self.nprocs_per_node
        found = []
        for index in self._group_indices:
            for rank, book in enumerate(self.phone_book):
                if rank != self.rank and book[index].dest == me:
                    found.append(book[index])
        return found

    def get_peers(self, rotate: bool = False) -> Tuple[List[int], List[int]]:
        """(out-peers as process ranks, in-peers as logical ranks) of this iteration; ``rotate``
        first moves on to the next peers."""
        if rotate:
            self._rotate_group_indices()
        out_peers = [self.phone_book[self.rank][i].dest for i in self._group_indices]
        in_peers = [e.src // self.nprocs_per_node for e in self._in_edges()]
        return out_peers, in_peers

    def get_edges(self, rotate: bool = False) -> Tuple[List[Edge], List[Edge]]:
        """(out-edges, in-edges) of this iteration; ``rotate`` first moves on to the next peers."""
        if rotate:
            self._rotate_group_indices()
        return [self.phone_book[self.rank][i] for i in self._group_indices], self._in_edges()

    def _rotate_group_indices(self) -> None:
        count = len(self.phone_book[self.rank])
        self._group_indices = [(i + self.peers_per_itr) % count for i in self._group_indices]

    def _rotate_forward(self, r: int, p: int) -> int:
        """The rank ``p`` hops after ``r``."""
        return (r + p) % self.world_size

    def _rotate_backward(self, r: int, p: int) -> int:
        """The rank ``p`` hops before ``r``."""
        return (r - p) % self.world_size

    def _hops(self, base: int) -> range:
        return range(int(math.log(self.world_size - 1, base)) + 1)


class _Directed(GraphManager):
    def is_regular_graph(self) -> bool:
        return True

    def is_bipartite_graph(self) -> bool:
        return False

    def is_passive(self, rank: Optional[int] = None) -> bool:
        return False

    def is_dynamic_graph(self) -> bool:
        return True


class _Bipartite(GraphManager):
    """Even ranks are passive; active ranks send to passive ones and passive ranks to active ones."""

    def is_regular_graph(self) -> bool:
        return True

    def is_bipartite_graph(self) -> bool:
        return True

    def is_passive(self, rank: Optional[int] = None) -> bool:
        return (self.rank if rank is None else rank) % 2 == 0

    def is_dynamic_graph(self) -> bool:
        return True

    def _add_across(self, rank: int, forward: int, backward: int) -> None:
        if self.is_passive(rank) != self.is_passive(forward) and self.is_passive(rank) != self.is_passive(backward):
            self._add_peers(rank, [forward, backward])


class DynamicDirectedExponentialGraph(_Directed):
    """Peers 2^i hops ahead and behind, i = 0 .. log2(world_size - 1)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in self._hops(2):
                self._add_peers(rank, [self._rotate_forward(rank, 2**i), self._rotate_backward(rank, 2**i)])


class NPeerDynamicDirectedExponentialGraph(_Directed):
    """Peers j * (peers_per_itr + 1)^i hops ahead, j = 1 .. peers_per_itr."""

    def _make_graph(self) -> None:
        base = self._peers_per_itr + 1
        for rank in range(self.world_size):
            for i in self._hops(base):
                for j in range(1, base):
                    self._add_peers(rank, [self._rotate_forward(rank, j * base**i)])


class DynamicBipartiteExponentialGraph(_Bipartite):
    """Peers 1 and 1 + 2^i hops ahead and behind, between passive and active ranks."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in self._hops(2):
                hops = 1 if i == 0 else 1 + 2**i
                self._add_across(rank, self._rotate_forward(rank, hops), self._rotate_backward(rank, hops))


class DynamicDirectedLinearGraph(_Directed):
    """Peers an odd number of hops ahead and behind."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(1, self.world_size, 2):
                self._add_peers(rank, [self._rotate_forward(rank, i), self._rotate_backward(rank, i)])


class DynamicBipartiteLinearGraph(_Bipartite):
    """Every peer ahead and behind, between passive and active ranks."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            for i in range(1, self.world_size):
                self._add_across(rank, self._rotate_forward(rank, i), self._rotate_backward(rank, i))


class RingGraph(_Directed):
    """The next and the previous rank, always the same (a static graph)."""

    def _make_graph(self) -> None:
        for rank in range(self.world_size):
            self._add_peers(rank, [self._rotate_forward(rank, 1), self._rotate_backward(rank, 1)])

    def is_dynamic_graph(self) -> bool:
        return False
