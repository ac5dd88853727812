"""elastic package: the etcd control plane of a Planaria cluster.

- ``etcd_server``  EmbeddedEtcd: a loopback single-node etcd (default, and tests)
- ``etcd_client``  make_client / client_factory: fail-fast, fast-reconnect etcd3 clients
- ``keys``         key layout under /planaria/<cluster>/ and the msgspec records
- ``membership``   Membership: the node's lease, owned keys re-written after outages
- ``watch``        KeyWatch: a key/prefix watch that survives etcd restarts
- ``election``     LeaderElection: create-if-absent leader key, create revision = token
- ``epochs``       EpochStore: read_epoch / write_epoch (fenced compare-and-swap)
- ``kv_budget``    KVBudgetRegistry: smallest profiled KV figure per model and device
- ``desired``      DesiredStore: request_scale, ops/<op id> records
- ``planner``      plan_epoch, expert_map, moves: pure "decide" logic for the leader
- ``errors``       the error tree (EtcdUnavailableError, StaleLeaderError, ...)
"""
