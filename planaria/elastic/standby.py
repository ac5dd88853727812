"""A standby EP engine process: started ahead of need, imports and warms up, then waits
for its assignment. A scale-up that finds one ready skips the interpreter start and the
imports (torch, transformers, and torch._dynamo + sympy, which building the model pulls
in: about 2-5 s on a CPU host, most of a reused-KV join), and goes straight to its weights.

    python -m planaria.elastic.standby --model DIR [--ready-file PATH]
    stdin: one line, the assignment: the JSON list of `python -m planaria.elastic.ep_proc`
    arguments (engine id, addresses, config with the reused KV figure, ...), or an object
    {"argv": [...], "log_path": PATH, "env": {NAME: VALUE}}: the engine's output then goes
    to PATH (appended) and the variables are set before it starts. EOF exits 0.

``--ready-file``: touched once the warm-up is done (the supervisor's status shows it).

Nothing model-specific is loaded before the assignment: the process reads the model's
config only (so the config code is warm) and holds no weights, no KV cache and no socket.
Credentials (PLANARIA_ETCD_*) come from its environment, like any engine's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path


def warm_up(model_dir: str) -> float:
    """Import and touch what an EP engine's start-up needs; returns the seconds it took."""
    t0 = time.monotonic()
    # deferred: these imports are the warm-up, timed here and done before the ready file
    import torch
    import torch._dynamo  # noqa: F401 - building the model under a device context imports it
    import torch.distributed  # noqa: F401

    import planaria.elastic.ep_proc  # noqa: F401 - the engine process itself, and everything it imports
    import planaria.engine.core  # noqa: F401 - imported lazily by make_ep_core (structlog, rich, ...)
    from planaria.engine.models.loader import load_hf_config, spec_from_config

    spec_from_config(load_hf_config(model_dir))
    with torch.device("cpu"):
        torch.nn.Embedding(8, 8)  # the init path a model build takes, once
    torch.nn.functional.linear(torch.zeros(2, 8), torch.zeros(8, 8)).sum()
    gc.collect()  # what the engine would do after loading: its own collection then finds little
    gc.freeze()
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planaria.elastic.standby", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the cluster's model directory (config only is read)")
    p.add_argument("--ready-file", help="touched once warm")
    args = p.parse_args(argv)
    warm_s = warm_up(args.model)
    if args.ready_file:
        Path(args.ready_file).touch()
    print(f"standby: warm after {warm_s:.2f} s; waiting for an assignment", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # released unused
    try:
        engine_argv, log_path, env = parse_assignment(line)
    except ValueError as exc:
        print(f"elastic.standby: bad assignment: {exc}", file=sys.stderr)
        return 2
    if args.ready_file:
        Path(args.ready_file).unlink(missing_ok=True)
    os.environ.update(env)
    if log_path:  # from here on this process is the engine: its output goes to the engine's log
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    from planaria.elastic.ep_proc import main as engine_main  # deferred: warm_up imported it (timed)

    return engine_main(engine_argv)


def parse_assignment(line: str) -> tuple[list[str], str | None, dict[str, str]]:
    """(engine argv, log path or None, environment) from an assignment line."""
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    except RecursionError:  # json.loads of a line nested past the recursion limit
        raise ValueError("JSON nested too deeply") from None
    if isinstance(value, dict):
        engine_argv, log_path, env = value.get("argv"), value.get("log_path"), value.get("env", {})
    else:
        engine_argv, log_path, env = value, None, {}
    if not isinstance(engine_argv, list) or not all(isinstance(a, str) for a in engine_argv):
        raise ValueError("the engine arguments must be a JSON list of strings")
    if log_path is not None and not isinstance(log_path, str):
        raise ValueError("log_path must be a string")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must map names to strings")
    return engine_argv, log_path, env


if __name__ == "__main__":
    sys.exit(main())
