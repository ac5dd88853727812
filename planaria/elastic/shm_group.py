"""Collectives of the expert-parallel ranks of one epoch on one node, through shared memory.

Over gloo each MoE layer cost four all-to-alls on loopback TCP (counts, tokens, expert ids,
results), each a few hundred microseconds of system calls and wake-ups: 120 per step on a
30-layer model, most of a decode step. On one node the ranks can instead read each
other's memory, as vLLM's CPU backend does for its tensor-parallel all-reduce
(csrc/cpu/shm.cpp there). One segment per epoch holds, per rank, its tokens of the layer
(hidden states and expert ids) and, per (computing rank, source rank), the unweighted
outputs of the source's pairs whose expert the computing rank owns. A MoE layer is two
phases, each closed by a barrier of sequence flags (kernels/csrc/shm_sync.cpp: release
after the writes, acquire before the reads):

  A. every rank writes its tokens, publishes; waits for all;
  B. every rank runs its share of the experts over every rank's tokens (one kernel call
     over all of them, so each expert's weights stream once), writes each source's pair outputs,
     publishes; waits for all; then each rank sums its own tokens' pairs in k order in
     float32 (``moe_combine``, the same code as the one-engine kernel's, so a token gets
     the same bits wherever its experts ran).

A rank's share is the experts it owns, or, when every rank maps the node's expert cache
(each layer's every expert a view of one file in the node's page cache), the experts the
round's load gives it (``assign_experts``), so no rank waits through a peer's heavier
share: with skewed routing, and at one stream, where a token's experts sit on one rank a
third of the time (4 experts, top-2, 2 ranks).

A buffer is rewritten only after every rank has passed the barrier that follows its last
read (tokens are read in B before the B barrier; outputs are read before the next A
barrier); the small all-reduce (the lockstep sync) alternates between two slots because two
of them can follow each other directly. Steps larger than the segment's capacity go in
rounds of ``capacity`` tokens per rank.

A wait spins for up to 500 us (a peer a layer behind arrives within that; yielding at once
cost a time slice whenever another process was runnable: 15 of a 30 ms step under load),
then yields the core (the node's frontends and supervisor need it),
and between looks checks the collective timeout, an abort flag (a rank that failed or left
sets it, so its peers do not wait for the timeout) and whether every peer process is
still alive (pid and start time from /proc: a SIGKILLed peer is seen within ~10 ms, where
gloo saw a reset connection). Any of these raises CollectiveError, as gloo's failures did.

The segment is created by rank 0 under /dev/shm, opened by every rank, and unlinked as soon
as all have it mapped: nothing is left behind when the processes die, however they die.
Ranks on different nodes keep gloo (``shared_node`` decides, from what each rank
published in the rendezvous store).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from planaria.common.proc_stat import process_start
from planaria.elastic.errors import ElasticError
from planaria.kernels import cpu_ext
from planaria.kernels.moe import expert_pair_outputs, fused_kernel_takes


class ShmCollectiveError(ElasticError):
    """A shared-memory collective failed: a peer died, left, or the timeout passed."""


ENV_TRANSPORT = "PLANARIA_EP_TRANSPORT"  # "auto" (shared memory on one node) or "gloo"
ENV_BUDGET_MB = "PLANARIA_EP_SHM_MB"
DEFAULT_BUDGET_MB = 32
_FLAG_STRIDE = 8  # int64s per rank's flag: one cache line each
_AR_WORDS = 64  # int64s per rank's all-reduce slot
_HDR_WORDS = 8
_ALIGN = 64
_SPIN_US = 500  # busy-wait before yielding the core
_YIELD_US = 2000  # then sched_yield between looks, returning to Python this often
_PEER_CHECK_S = 0.01


def node_identity() -> str:
    """What ranks that share this machine's /dev/shm have in common (and others do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(shm_dir())
        dev = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        dev = ""
    return f"{socket.gethostname()}|{boot}|{dev}"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"


def wanted() -> bool:
    """Whether this rank offers the shared-memory transport (the C++ flags are built and the
    environment does not ask for gloo)."""
    return os.environ.get(ENV_TRANSPORT, "auto").lower() != "gloo" and cpu_ext.available()


def rank_card() -> dict:
    """What a rank publishes for the transport decision (parsed as hostile by its peers)."""
    return {"node": node_identity(), "pid": os.getpid(), "start": process_start(os.getpid()) or 0,
            "shm": wanted()}


def shared_node(cards: list[dict]) -> bool:
    """Every rank is on this node and can use shared memory (the same answer on every rank:
    it reads only the cards, which every rank reads alike)."""
    if len(cards) < 2:
        return False
    return all(c.get("shm") is True for c in cards) and len({c.get("node") for c in cards}) == 1


def parse_card(raw: bytes) -> dict:
    try:
        card = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ElasticError(f"a rank's transport card is not JSON: {exc}") from exc
    if not isinstance(card, dict) or not isinstance(card.get("node"), str) or \
            not isinstance(card.get("pid"), int) or not isinstance(card.get("start"), int):
        raise ElasticError(f"a rank's transport card is malformed: {str(card)[:200]}")
    return card


@dataclass(frozen=True)
class Layout:
    world_size: int
    capacity: int  # tokens per rank per round
    hidden: int
    top_k: int
    dtype: torch.dtype

    @staticmethod
    def fit(world_size: int, hidden: int, top_k: int, dtype: torch.dtype, max_tokens: int,
            budget_bytes: int) -> "Layout | None":
        """The largest capacity (<= max_tokens) whose segment fits the budget; None below 16."""
        probe = Layout(world_size, 1, hidden, top_k, dtype)
        per_token = probe.size() - Layout(world_size, 0, hidden, top_k, dtype).size()
        fixed = Layout(world_size, 0, hidden, top_k, dtype).size()
        cap = min(max_tokens, (budget_bytes - fixed) // max(per_token, 1))
        if cap < 16:
            return None
        return Layout(world_size, int(cap), hidden, top_k, dtype)

    def _regions(self) -> list[tuple[str, int]]:
        W, C, H, K = self.world_size, self.capacity, self.hidden, self.top_k
        elem = torch.empty((), dtype=self.dtype).element_size()
        return [("flags", W * _FLAG_STRIDE * 8), ("abort", _ALIGN), ("ar", 2 * W * _AR_WORDS * 8),
                ("hdr", W * _HDR_WORDS * 8), ("x", W * C * H * elem), ("ids", W * C * K * 8),
                ("y", W * W * C * K * H * 4)]

    def offsets(self) -> dict[str, tuple[int, int]]:
        out, off = {}, 0
        for name, size in self._regions():
            out[name] = (off, size)
            off += -(-size // _ALIGN) * _ALIGN
        return out

    def size(self) -> int:
        return sum(-(-s // _ALIGN) * _ALIGN for _, s in self._regions())


def create_segment(epoch: int, size: int) -> str:
    """A new zeroed segment file (0600); returns its path. Old segments of dead creators are
    swept first (a creator killed between creating and unlinking)."""
    d, uid = shm_dir(), os.getuid()
    prefix = f"planaria-ep-{uid}-"
    try:
        for name in os.listdir(d):
            if name.startswith(prefix):
                try:
                    pid = int(name[len(prefix):].split("-")[0])
                except ValueError:
                    continue
                if process_start(pid) is None:
                    try:
                        os.unlink(os.path.join(d, name))
                    except OSError:
                        pass
    except OSError:
        pass
    path = os.path.join(d, f"{prefix}{os.getpid()}-{epoch}-{os.urandom(4).hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


_EXPERT_COST = 16  # what streaming an expert's weights costs, in pairs computed


def assign_experts(pairs: list[int], owner: list[int], world: int) -> list[int]:
    """Expert -> the rank that computes its pairs this round, given each expert's pair count
    over every rank's tokens: the active experts, most pairs first (ties: lower id), each
    to the rank with the least load so far (ties: the expert's owner, then the lower rank),
    an expert's load being ``_EXPERT_COST`` plus its pairs (its weights are streamed once
    whatever the pairs). An expert's pairs stay together (its weights are read by one
    rank). Inactive experts keep their owners. Every rank computes the same answer from the
    same counts."""
    assign = list(owner)
    load = [0] * world
    for e in sorted((e for e, c in enumerate(pairs) if c), key=lambda e: (-pairs[e], e)):
        best = min(range(world), key=lambda q: (load[q], q != owner[e], q))
        assign[e] = best
        load[best] += _EXPERT_COST + pairs[e]
    return assign


class ShmGroup:
    """One epoch's segment, mapped by one rank."""

    def __init__(self, path: str, rank: int, layout: Layout, peers: list[tuple[int, int]],
                 timeout_s: float) -> None:
        self.rank, self.layout, self.timeout_s = rank, layout, timeout_s
        self.world_size = layout.world_size
        self.peers = peers  # (pid, start time) per rank
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != layout.size():
                raise ElasticError(f"shared segment {path}: {os.fstat(fd).st_size} bytes, expected {layout.size()}")
            self._mm = mmap.mmap(fd, layout.size())
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        off = layout.offsets()
        W, C, H, K = self.world_size, layout.capacity, layout.hidden, layout.top_k

        def region(name, dtype, shape):
            o, s = off[name]
            return raw[o:o + s].view(dtype).view(shape)

        self.flags = region("flags", torch.int64, (W * _FLAG_STRIDE,))
        self.abort_flag = region("abort", torch.int64, (_ALIGN // 8,))
        self.ar = region("ar", torch.int64, (2, W, _AR_WORDS))
        self.hdr = region("hdr", torch.int64, (W, _HDR_WORDS))
        self.x = region("x", layout.dtype, (W, C, H))
        self.ids = region("ids", torch.int64, (W, C, K))
        self.y = region("y", torch.float32, (W, W, C, K, H))
        self._rows = self.y.view(W * W * C * K, H)
        self._hdr_np = self.hdr.numpy()  # numpy views: an element read or write in 0.1 us, not 2
        self._abort_np = self.abort_flag.numpy()
        self._x_of, self._ids_of = list(self.x.unbind(0)), list(self.ids.unbind(0))  # per source
        self._x_own, self._ids_own = self._x_of[rank], self._ids_of[rank]
        self._y_own = list(self.y[rank].unbind(0))  # this rank's outputs, per source
        self._owner_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.balanced_layers = 0  # MoE layers whose experts were shared out by load
        self.seq = 0
        self._ar_count = 0
        self.waiting_since: float | None = None

    # -- the barrier -----------------------------------------------------------------------------
    def _check_peers(self) -> None:
        for r, (pid, start) in enumerate(self.peers):
            if r != self.rank and process_start(pid) != start:
                raise ShmCollectiveError(f"rank {r} (pid {pid}) is gone")

    def _phase(self) -> None:
        """Publish this rank's writes of the phase and wait until every rank published."""
        self.seq += 1
        target = self.seq
        torch.ops.planaria.shm_publish(self.flags, self.rank, _FLAG_STRIDE, target)
        W = self.world_size
        if torch.ops.planaria.shm_wait_all(self.flags, W, _FLAG_STRIDE, target, _SPIN_US, False):
            return
        now = time.monotonic()
        self.waiting_since = now
        deadline, next_check = now + self.timeout_s, now + _PEER_CHECK_S
        try:
            while not torch.ops.planaria.shm_wait_all(self.flags, W, _FLAG_STRIDE, target, _YIELD_US, True):
                if self._abort_np[0]:
                    if torch.ops.planaria.shm_wait_all(self.flags, W, _FLAG_STRIDE, target, 0, False):
                        return  # the rank that left had finished this phase
                    raise ShmCollectiveError(f"a peer left the group: {self._abort_reason()}")
                now = time.monotonic()
                if now >= next_check:
                    self._check_peers()
                    next_check = now + _PEER_CHECK_S
                if now >= deadline:
                    raise ShmCollectiveError(f"no peer progress for {self.timeout_s:.0f} s")
        except ShmCollectiveError:
            self.abort()
            raise
        finally:
            self.waiting_since = None

    def _abort_reason(self) -> str:
        r = int(self._abort_np[1]) - 1
        return f"rank {r} aborted" if r >= 0 else "aborted"

    def abort(self) -> None:
        """Tell the peers this rank takes part in no more collectives of this group."""
        self._abort_np[1] = self.rank + 1
        torch.ops.planaria.shm_publish(self.abort_flag, 0, 1, 1)

    # -- collectives -----------------------------------------------------------------------------
    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        if t.dtype != torch.int64 or n > _AR_WORDS:
            raise ElasticError(f"shared all-reduce: int64 up to {_AR_WORDS} values, got {t.dtype} x {n}")
        slot = self.ar[self._ar_count % 2]
        self._ar_count += 1
        slot[self.rank, :n].copy_(t.reshape(-1))
        self._phase()
        t.copy_(slot[:, :n].amax(dim=0).view_as(t))
        return t

    def moe(self, moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            rank_of_expert: torch.Tensor) -> torch.Tensor:
        """One MoE layer's experts across the group: x [T, H], weights/ids [T, K] -> [T, H].

        Who computes a pair: when every rank maps the same node expert file (every rank's
        ``moe.node_key``, published with its token count, is the same and non-zero), the
        experts the round's pairs route to are shared out by load (``assign_experts``), so
        the ranks finish together whatever the routing (at one stream a token's two
        experts sit on one rank a third of the time, and its peer used to wait through
        both); otherwise each expert's owner (``rank_of_expert``) computes its pairs."""
        T, K = ids.shape
        W, r, C = self.world_size, self.rank, self.layout.capacity
        if K != self.layout.top_k or x.shape[1] != self.layout.hidden or x.dtype != self.layout.dtype:
            raise ElasticError("shared MoE: the layer does not match the segment's layout")
        out = torch.empty_like(x)
        w32 = weights.float().contiguous()
        ids = ids.contiguous()
        hdr = self._hdr_np
        hdr[r, 0] = T
        hdr[r, 1] = getattr(moe, "node_key", 0)
        rounds, i, balanced, shared_any = 1, 0, False, False
        totals: list[int] = []
        while i < rounds:
            lo = i * C
            n = max(0, min(C, T - lo))
            whole = n == T  # one round: no slices (each costs microseconds, 30 layers a step)
            if n:
                self._x_own[:n].copy_(x if whole else x[lo:lo + n])
                self._ids_own[:n].copy_(ids if whole else ids[lo:lo + n])
            self._phase()  # A: every rank's tokens of this round are in
            if i == 0:
                totals = hdr[:, 0].tolist()
                if any(not 0 <= t_ <= 1 << 30 for t_ in totals):
                    raise ShmCollectiveError(f"shared MoE: a peer's token count is out of range: {totals}")
                rounds = max(1, max(-(-t_ // C) for t_ in totals))
                keys = hdr[:, 1].tolist()
                balanced = (keys[0] != 0 and all(k_ == keys[0] for k_ in keys)
                            and getattr(moe, "node_w13", None) is not None)
            counts = [max(0, min(C, t_ - lo)) for t_ in totals]
            owner, shared = self._compute(moe, counts, rank_of_expert, balanced)
            shared_any = shared_any or shared
            self._phase()  # B: every rank's outputs for every source are in
            if whole:
                torch.ops.planaria.moe_combine_routed(self._rows, ids, owner, r * C * K, w32, out)
            elif n:
                torch.ops.planaria.moe_combine_routed(self._rows, ids[lo:lo + n], owner, r * C * K,
                                                      w32[lo:lo + n], out[lo:lo + n])
            i += 1
        if shared_any:
            self.balanced_layers += 1
        return out

    def _compute(self, moe, counts: list[int], rank_of_expert: torch.Tensor,
                 balanced: bool) -> tuple[torch.Tensor, bool]:
        """This rank's pairs of the round (every source's tokens), each source's pair outputs
        into y[this rank, source]. Returns, per expert, the first row of the outputs block
        of the rank that computed its pairs (what the sources' combine reads), and whether
        the experts were shared out by load."""
        r, K, H, W, C = self.rank, self.layout.top_k, self.layout.hidden, self.world_size, self.layout.capacity
        srcs = [s for s, c in enumerate(counts) if c]
        block = W * C * K
        if not srcs:
            return self._owner_rows(rank_of_expert, block), False
        if len(srcs) == 1:
            s = srcs[0]
            xs, ids_s = self._x_of[s][:counts[s]], self._ids_of[s][:counts[s]]
        else:
            xs = torch.cat([self._x_of[s][:counts[s]] for s in srcs])
            ids_s = torch.cat([self._ids_of[s][:counts[s]] for s in srcs])
        total = xs.shape[0]
        n_all = moe.num_experts
        invariant = getattr(moe, "invariant", False)
        # Shared out only where the C++ kernel computes the pairs (the one engine's rule at
        # this load): each pair's bits do not depend on which others share its call. Past
        # that, the torch code's batched matmul would stream every expert of node_w13, and
        # at such loads the owners' shares are even anyway. Every rank decides alike.
        balanced = balanced and fused_kernel_takes(xs, moe.node_w13, moe.node_w2, total * K, invariant)
        if balanced:
            try:  # assign_experts in C++, and this rank's pairs: the others' expert ids set to -1
                ids_c, owner = torch.ops.planaria.moe_share(ids_s, rank_of_expert, W, r, block, _EXPERT_COST)
            except RuntimeError as exc:  # a peer's ids out of range
                raise ShmCollectiveError(f"shared MoE: {exc}") from exc
            w13, w2, offset = moe.node_w13, moe.node_w2, 0
            # the one engine's rule at the same load: every expert here, all the pairs
            num_pairs = total * K
        else:
            w13, w2, ids_c, offset = moe.w13, moe.w2, ids_s, moe.expert_start
            owner = self._owner_rows(rank_of_expert, block)
            # the pairs these experts get, on average: the one engine's rule at the same load
            num_pairs = total * K * w13.shape[0] // max(1, n_all)
        direct = len(srcs) == 1
        y = self._y_own[srcs[0]][:total] if direct else torch.empty(total, K, H, dtype=torch.float32)
        expert_pair_outputs(xs, w13, w2, ids_c, offset, y, invariant, num_pairs)
        if not direct:
            off = 0
            for s in srcs:
                self.y[r, s, :counts[s]].copy_(y[off:off + counts[s]])
                off += counts[s]
        return owner, balanced

    def _owner_rows(self, rank_of_expert: torch.Tensor, block: int) -> torch.Tensor:
        if self._owner_cache is None or self._owner_cache[0] is not rank_of_expert:
            self._owner_cache = (rank_of_expert, rank_of_expert * block)
        return self._owner_cache[1]

    def close(self) -> None:
        """Leave the group: peers still waiting in it stop waiting (abort)."""
        try:
            self.abort()
        except (RuntimeError, ValueError):
            pass
