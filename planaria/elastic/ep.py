"""Expert parallelism: a per-epoch process group and the MoE dispatch/combine over it.

Every engine is a data-parallel rank with its own scheduler and KV cache; the MoE layers
are expert-parallel across all ranks. A layer's (token, expert) pairs are sent to the
rank that owns the expert (all-to-all), computed there with the grouped expert matmul,
and sent back (all-to-all); the source rank applies the routing weights and sums.

The process group lives on a TCPStore that outlives epochs (hosted by the supervisor, or
by whoever calls ``host_store``); each epoch gets a fresh group under its own
``PrefixStore``, so rebuilding at a new world size costs milliseconds.

Forming a group is two-phase. *Prepare*: each rank sets its arrival key
(``planaria/arrive/<epoch>/<rank>``) in the store, and nobody builds the group before every
rank of the epoch has arrived (``all_arrived``), so no rank ever blocks in the group's
constructor waiting for a rank that is not coming. *Commit*: build the group, with the
collective timeout as the bound. A rank that never arrives leaves the others free to go on
serving the old epoch (or to take a newer one) — the leader aborts the switch.

Applied as a transform (``apply_expert_parallel``): the model code only has a hook.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Callable

import msgspec
import torch
import torch.distributed as dist

from planaria.elastic import shm_group
from planaria.elastic.errors import ElasticError
from planaria.elastic.shm_group import ShmGroup
from planaria.engine.models.decoder import SparseMoE
from planaria.kernels import cpu_ext
from planaria.kernels.moe import expert_pair_outputs, grouped_expert_mlp


log = logging.getLogger(__name__)


class CollectiveError(ElasticError):
    """A collective failed or timed out: a peer rank died or hung."""


class EPSpec(msgspec.Struct, kw_only=True):
    """What an engine needs to join an epoch's expert-parallel group."""

    epoch: int
    rank: int
    world_size: int
    rendezvous: str  # host:port of the TCPStore
    expert_map: list[int]  # expert -> rank
    timeout_s: float = 30.0
    backend: str = "gloo"  # "nccl" on GPU
    ranks: list[str] = []  # rank -> engine id ([]: unknown, every rank counts as a joiner)

    def expert_range(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        owned = [e for e, owner in enumerate(self.expert_map) if owner == r]
        if not owned:
            return (0, 0)
        if owned != list(range(owned[0], owned[-1] + 1)):
            raise ElasticError(f"rank {r}: experts {owned} are not contiguous")
        return owned[0], owned[-1] + 1


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def host_store(addr: str, timeout_s: float = 300.0) -> dist.TCPStore:
    """The rendezvous store server (one per cluster, outlives epochs)."""
    host, port = _split(addr)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(addr: str, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client of the rendezvous store (raises CollectiveError when it cannot connect)."""
    host, port = _split(addr)
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"cannot reach the rendezvous store {addr}: {exc}") from exc


def arrival_key(epoch: int, rank: int) -> str:
    return f"planaria/arrive/{epoch}/{rank}"


def arrive(store, spec: EPSpec) -> None:
    """Prepare: say this rank is at the switch point of ``spec.epoch``."""
    try:
        store.set(arrival_key(spec.epoch, spec.rank), b"1")
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"epoch {spec.epoch}: cannot arrive: {exc}") from exc


def arrived(store, epoch: int, ranks: list[int]) -> bool:
    """Whether every rank in ``ranks`` has arrived at ``epoch`` (never blocks)."""
    if not ranks:
        return True
    try:
        return bool(store.check([arrival_key(epoch, r) for r in ranks]))
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"epoch {epoch}: cannot read arrivals: {exc}") from exc


FORM_POLL_S = 0.005  # how often a rank forming a group looks at whether to give it up


class EPGroup:
    """The process group of one epoch (commit: every rank has arrived).

    Forming waits for every rank to connect, bounded by the collective timeout. A rank that
    died after arriving never connects, so the wait is given up as soon as ``abandon()``
    says so (the leader wrote a newer epoch: its re-form without the dead rank); the
    constructor goes on in its thread until its own timeout and its result is dropped."""

    def __init__(self, spec: EPSpec, store=None, bind_host: str | None = None,
                 abandon: Callable[[], bool] | None = None) -> None:
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        host, _port = _split(spec.rendezvous)
        if abandon is not None:  # the forming thread may outlive this call: a client of its own
            store = None
        self._store = store if store is not None else connect_store(spec.rendezvous, spec.timeout_s)
        if spec.backend not in ("gloo", "nccl"):
            raise ElasticError(f"unknown EP backend {spec.backend!r}")
        device = (bind_host or _local_ip(host)) if spec.backend == "gloo" else None
        if abandon is None:
            self.pg = self._make_pg(device)
            return
        result: dict = {}

        def form() -> None:
            try:
                result["pg"] = self._make_pg(device)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=form, name=f"form-epoch{spec.epoch}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(FORM_POLL_S)
            if thread.is_alive() and abandon():
                raise CollectiveError(f"epoch {spec.epoch}: forming given up: a newer epoch was written")
        if "error" in result:
            raise result["error"]
        self.pg = result["pg"]

    def _make_pg(self, device: str | None):
        spec = self.spec
        try:
            # Every rank has arrived: forming is bounded by the collective timeout.
            self._store.set_timeout(datetime.timedelta(seconds=spec.timeout_s))
            prefix = dist.PrefixStore(f"planaria/epoch{spec.epoch}/", self._store)
            timeout = datetime.timedelta(seconds=spec.timeout_s)
            if spec.backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=device)]
                return dist.ProcessGroupGloo(prefix, spec.rank, spec.world_size, opts)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(prefix, spec.rank, spec.world_size, opts)
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveError(f"epoch {spec.epoch}: cannot form the group: {exc}") from exc

    # The shared-memory transport of ranks on one node (elastic/shm_group.py), set up by
    # ``attach_shm`` once the group formed; None: every collective goes through gloo.
    shm: ShmGroup | None = None
    _waiting_since: float | None = None

    # ``waiting_since``: the monotonic time this rank entered the collective it is in (None
    # between collectives). A rank blocked there waits on a peer, it is not hung itself: its
    # heartbeat says so, and the collective timeout bounds the wait.
    @property
    def waiting_since(self) -> float | None:
        if self.shm is not None and self.shm.waiting_since is not None:
            return self.shm.waiting_since
        return self._waiting_since

    @waiting_since.setter
    def waiting_since(self, value: float | None) -> None:
        self._waiting_since = value

    @property
    def transport(self) -> str:
        return "shm" if self.shm is not None else self.spec.backend

    def attach_shm(self, hidden: int, top_k: int, dtype: torch.dtype, max_tokens: int) -> bool:
        """Move the group's collectives to shared memory when every rank is on this node
        (every rank calls it right after forming; they agree through gloo). Returns whether
        the group uses it. Raises CollectiveError when a peer fails meanwhile."""
        if self.spec.backend != "gloo" or self.world_size < 2 or top_k <= 0:
            return False
        spec = self.spec
        store = dist.PrefixStore(f"planaria/epoch{spec.epoch}/shm/", self._store)
        path = ""
        try:
            store.set(f"card/{self.rank}", msgspec.json.encode(shm_group.rank_card()))
            self._gloo_min([0])
            cards = [shm_group.parse_card(store.get(f"card/{r}")) for r in range(self.world_size)]
            budget = int(float(os.environ.get(shm_group.ENV_BUDGET_MB, shm_group.DEFAULT_BUDGET_MB)) * 2**20)
            layout = shm_group.Layout.fit(self.world_size, hidden, top_k, dtype, max_tokens, budget)
            ok = shm_group.shared_node(cards) and layout is not None
            agreed = self._gloo_min([int(ok), layout.capacity if layout is not None else 0])
            if not agreed[0]:
                return False
            layout = shm_group.Layout(self.world_size, agreed[1], hidden, top_k, dtype)
            if self.rank == 0:
                try:
                    path = shm_group.create_segment(spec.epoch, layout.size())
                except OSError as exc:
                    log.warning("epoch %d: no shared segment (%s): collectives over gloo", spec.epoch, exc)
                store.set("path", path.encode())
            self._gloo_min([0])
            path = store.get("path").decode("utf-8", "replace")
            group = None
            if path:
                try:
                    group = ShmGroup(path, self.rank, layout, [(c["pid"], c["start"]) for c in cards],
                                     spec.timeout_s)
                except (OSError, ElasticError, ValueError) as exc:
                    log.warning("epoch %d: shared segment %s not mapped (%s)", spec.epoch, path, exc)
            everyone = self._gloo_min([int(group is not None)])[0]
            self.shm = group if everyone else None
            return self.shm is not None
        except (RuntimeError, dist.DistError, ElasticError) as exc:
            raise CollectiveError(f"epoch {spec.epoch}: cannot set up the shared transport: {exc}") from exc
        finally:
            if self.rank == 0 and path:
                try:
                    os.unlink(path)  # every rank mapped it (or gave up): nothing outlives the processes
                except OSError:
                    pass

    def _gloo_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return t.tolist()

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        self.waiting_since = time.monotonic()
        try:
            self.pg.alltoall_base(out, inp, out_splits, in_splits).wait()
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveError(f"all_to_all failed: {exc}") from exc
        finally:
            self.waiting_since = None

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.shm is not None:
            try:
                return self.shm.all_reduce_max(t)
            except ElasticError as exc:
                raise CollectiveError(f"all_reduce failed: {exc}") from exc
        self.waiting_since = time.monotonic()
        try:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.pg.allreduce([t], opts).wait()
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveError(f"all_reduce failed: {exc}") from exc
        finally:
            self.waiting_since = None
        return t

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        self.pg = None
        self._store = None


def _local_ip(store_host: str) -> str:
    """The local address that routes to the store (loopback stays loopback)."""
    if store_host.startswith("127.") or store_host == "localhost":
        return "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((store_host, 9))
        return s.getsockname()[0]
    finally:
        s.close()


class ExpertParallel:
    """Dispatch/combine for every SparseMoE layer of one model over one EPGroup."""

    def __init__(self, group: EPGroup, expert_map: list[int]) -> None:
        self.group = group
        self.rank_of_expert = torch.tensor(expert_map, dtype=torch.long)
        self.num_collectives = 0

    def forward(self, moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; weights, ids: [T, K]
        g = self.group
        if g.shm is not None:
            try:
                return g.shm.moe(moe, x, weights, ids, self.rank_of_expert)
            except ElasticError as exc:
                raise CollectiveError(f"shared MoE exchange failed: {exc}") from exc
        invariant = getattr(moe, "invariant", False)
        if g.world_size == 1:  # every expert is here: the one-engine code, nothing to exchange
            return grouped_expert_mlp(x, moe.w13, moe.w2, weights, ids, moe.expert_start, None, invariant)
        T, K = ids.shape
        H = x.shape[1]
        W = g.world_size
        flat_ids = ids.reshape(-1)  # [P = T*K]
        dest = self.rank_of_expert.to(ids.device)[flat_ids]  # [P]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=W)  # [W]
        recv_counts = torch.empty_like(send_counts)
        g.all_to_all(recv_counts, send_counts, [1] * W, [1] * W)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        R = sum(rc)
        send_x = x.index_select(0, order // K)  # [P, H] sorted by destination rank
        send_ids = flat_ids.index_select(0, order)
        recv_x = x.new_empty(R, H)
        recv_ids = ids.new_empty(R)
        g.all_to_all(recv_x, send_x, rc, sc)
        g.all_to_all(recv_ids, send_ids, rc, sc)
        # Each received pair's output, unweighted and in float32, goes back to its source,
        # which sums its pairs in k order with the one-engine code (moe_combine), so a token
        # gets the same bits whichever rank ran its experts (as over shared memory).
        y = self._pair_outputs(moe, recv_x, recv_ids, invariant)  # [R, H] float32
        back = y.new_empty(T * K, H)
        g.all_to_all(back, y, sc, rc)
        self.num_collectives += 4
        pair_out = torch.empty_like(back).index_copy_(0, order, back)
        if cpu_ext.available() and x.device.type == "cpu":
            out = torch.empty_like(x)
            src = torch.arange(T * K, device=x.device).view(T, K)
            torch.ops.planaria.moe_combine(pair_out, src, weights.float().contiguous(), out)
            return out
        return (pair_out.view(T, K, H) * weights.float()[..., None]).sum(dim=1).to(x.dtype)

    @staticmethod
    def _pair_outputs(moe, recv_x: torch.Tensor, recv_ids: torch.Tensor, invariant: bool) -> torch.Tensor:
        """Each received (token, expert) pair's expert output [R, H], float32, unweighted."""
        R, H = recv_x.shape
        y = torch.empty(R, 1, H, dtype=torch.float32, device=recv_x.device)
        expert_pair_outputs(recv_x, moe.w13, moe.w2, recv_ids[:, None], moe.expert_start, y, invariant)
        return y.view(R, H)


def apply_expert_parallel(model, ep: ExpertParallel | None) -> int:
    """Route every SparseMoE layer through ``ep`` (None: back to local). Returns layers."""
    n = 0
    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.ep_forward = ep.forward if ep is not None else None
            n += 1
    return n
