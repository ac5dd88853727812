"""elastic package: the etcd control plane of a Planaria cluster.

- ``etcd_server``  EmbeddedEtcd: a loopback single-node etcd (default, and tests)
- ``etcd_client``  make_client / client_factory: fail-fast, fast-reconnect etcd3 clients
- ``keys``         key layout under /planaria/<cluster>/ and the msgspec records
- ``membership``   Membership: the node's lease, owned keys re-written after outages
- ``watch``        KeyWatch: a key/prefix watch that survives etcd restarts
- ``election``     LeaderElection: create-if-absent leader key, create revision = token
- ``epochs``       EpochStore: read_epoch / write_epoch (fenced compare-and-swap)
- ``kv_budget``    KVBudgetRegistry: smallest profiled KV figure per model and device
- ``desired``      DesiredStore: request_scale (the newest wins), ops/<op id> records
- ``planner``      plan_epoch, plan_abort, expert_map, moves: the next epoch (pure)
- ``reconcile``    decide(view): the leader's actions for one tick, from one frozen view (pure)
- ``controller``   EPController: the leader's tick, observe -> decide -> act
- ``node_view``    NodeView, LeaderWatch: what a node follows, kept from watches
- ``rank_epochs``  RankEpochs: one rank's epoch state machine (pure)
- ``errors``       the error tree (EtcdUnavailableError, StaleLeaderError, ...)
"""

import os as _os

# gRPC's fork support (pthread_atfork handlers) must be off in every Planaria process:
# the supervisor forks children (subprocess with preexec_fn) while its etcd client's gRPC
# threads run, and with fork support on, gRPC's handler restarted its event-engine
# threads inside the forked child, where close_fds then closed their epoll fd before exec:
# "epoll_wait error: Bad file descriptor", SIGABRT, and a dead engine at start (plus
# "Other threads are currently calling into gRPC, skipping fork() handlers" at every
# fork). No Planaria process uses gRPC in a forked child without exec, so it is forced
# off (an inherited GRPC_ENABLE_FORK_SUPPORT=1 would bring the crash back). Set before any
# module of this package imports grpc (read once, at grpc's import).
_os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
