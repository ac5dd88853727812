"""The KV segment directory (daemon/kv_segments.py) and its lifecycle in the supervisor:
where it is, who may own it, the sweep at start, each dead engine's file kept for the TTL
then removed (by pid, its own only), everything removed at a clean stop; the environment
variable that names it to engines and standbys; the `serve` flags."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from planaria.daemon import config as config_mod
from planaria.daemon.cli import build_parser
from planaria.daemon.kv_segments import (SEGMENT_DIR_ENV, KVSegmentDir, KVSegmentDirError,
                                         filesystem_type, segment_dir_path, segment_name, segment_pid)
from planaria.daemon.launch import Launcher
from planaria.daemon.supervisor import Supervisor
from tests.daemon.test_supervisor_logic import Clock, FakeSpawner, die, engine_child

SHM = Path("/dev/shm")


def _on_memory_fs(path) -> bool:
    return filesystem_type(path) in ("tmpfs", "ramfs")


@pytest.fixture
def shm_dir():
    """A directory of this test's own on the /dev/shm tmpfs, removed afterwards."""
    if not SHM.is_dir() or not _on_memory_fs(SHM):
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="planaria-test-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def touch(directory: Path, name: str, size: int = 0) -> Path:
    path = directory / name
    with open(path, "wb") as f:
        f.write(b"\1" * size)
    return path


# -- where ------------------------------------------------------------------------------------

# mount points that do not exist on the host: the table alone decides (by the longest
# mount point above the path; an existing path is matched by its device first)
R = "/nonexistent-planaria-test"
MOUNTINFO = "\n".join([
    "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
    f"30 27 0:27 / {R}/run rw,nosuid - tmpfs tmpfs rw,size=100k",
    f"31 30 0:28 / {R}/run/user/1000 rw - tmpfs tmpfs rw",
    f"32 27 0:29 / {R}/srv/with\\040space rw - ramfs ramfs rw",
    f"33 27 0:30 / {R}/data rw - tmpfs tmpfs rw",
    f"34 27 254:1 / {R}/data rw - xfs /dev/vdb rw",  # mounted over the tmpfs: it hides it
    "garbage line",
])


@pytest.mark.parametrize("path, fstype", [
    ("/run/planaria", "tmpfs"), ("/run", "tmpfs"), ("/runx/planaria", "ext4"),
    ("/run/user/1000/p", "tmpfs"), ("/srv/with space/run", "ramfs"), ("/srv/with", "ext4"),
    ("/data/run", "xfs"), ("/elsewhere/x", "ext4")])
def test_filesystem_type_from_the_mount_table(path, fstype):
    assert filesystem_type(R + path, MOUNTINFO) == fstype


def test_filesystem_type_of_an_existing_path_by_its_device(shm_dir):
    dev = os.stat(shm_dir).st_dev
    table = MOUNTINFO + f"\n40 27 {os.major(dev)}:{os.minor(dev)} / /mnt/elsewhere rw - tmpfs none rw"
    assert filesystem_type(shm_dir, table) == "tmpfs"  # the device's mount, wherever it is
    assert filesystem_type(shm_dir) == "tmpfs"  # the host's own table


def test_the_runtime_dir_on_a_tmpfs_holds_the_segments():
    runtime = f"{R}/run/planaria"
    assert segment_dir_path(runtime, mountinfo=MOUNTINFO) == Path(runtime) / "kv"
    assert segment_dir_path(f"{R}/srv/with space/r", mountinfo=MOUNTINFO) == Path(f"{R}/srv/with space/r/kv")


def test_elsewhere_a_directory_of_its_own_in_dev_shm():
    a = segment_dir_path(f"{R}/var/run", uid=1234, mountinfo=MOUNTINFO)
    b = segment_dir_path(f"{R}/var/run2", uid=1234, mountinfo=MOUNTINFO)
    assert a.parent == b.parent == SHM
    assert a.name.startswith("planaria-1234-") and len(a.name) == len("planaria-1234-") + 16
    assert a != b  # one per runtime dir, i.e. one per daemon
    assert a == segment_dir_path(f"{R}/var/run/", uid=1234, mountinfo=MOUNTINFO)
    int(a.name.rsplit("-", 1)[1], 16)


def test_real_paths(tmp_path, shm_dir):
    """This host's own mount table: a tmpfs runtime dir gets RUNTIME/kv, a directory on
    any other file system one in /dev/shm (uid and hash)."""
    assert segment_dir_path(shm_dir) == shm_dir / "kv"
    if _on_memory_fs(tmp_path):
        assert segment_dir_path(tmp_path) == tmp_path / "kv"
    else:
        path = segment_dir_path(tmp_path)
        assert path.parent == SHM and path.name.startswith(f"planaria-{os.geteuid()}-")


# -- the directory ----------------------------------------------------------------------------

def test_made_0700_whatever_the_umask_and_an_existing_one_tightened(shm_dir):
    old = os.umask(0)
    try:
        d = KVSegmentDir(shm_dir / "kv")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(d.path).st_mode) == 0o700
    d.close()
    os.chmod(d.path, 0o755)
    d = KVSegmentDir(d.path)
    assert stat.S_IMODE(os.lstat(d.path).st_mode) == 0o700
    d.remove_all()
    assert not d.path.exists()


def test_a_symlink_is_refused(shm_dir, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (shm_dir / "kv").symlink_to(target)
    with pytest.raises(KVSegmentDirError, match="symlink"):
        KVSegmentDir(shm_dir / "kv")
    assert target.is_dir() and (shm_dir / "kv").is_symlink()  # left as found


def test_a_file_is_refused(shm_dir):
    touch(shm_dir, "kv")
    with pytest.raises(KVSegmentDirError, match="not a directory"):
        KVSegmentDir(shm_dir / "kv")


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's directory needs root")
def test_another_users_directory_is_refused(shm_dir):
    (shm_dir / "kv").mkdir(mode=0o700)
    os.chown(shm_dir / "kv", 65534, 65534)
    with pytest.raises(KVSegmentDirError, match="owned by uid 65534"):
        KVSegmentDir(shm_dir / "kv")


def test_sweep_removes_what_a_previous_daemon_left(shm_dir):
    d = KVSegmentDir(shm_dir / "kv")
    for name in ("engine0-123.kv", "engine12-99999.kv", "engine-odd.kv", "notes.txt", "engine0-1.kv.tmp"):
        touch(d.path, name)
    (d.path / "engine9-9.kv").mkdir()  # a directory is never removed
    assert d.sweep() == 3
    assert sorted(os.listdir(d.path)) == ["engine0-1.kv.tmp", "engine9-9.kv", "notes.txt", "owner"]
    assert (d.path / "owner").read_text().split()[0] == str(os.getpid())  # this daemon holds it
    d.remove_all()


def test_dirs_of_daemons_that_died_elsewhere_are_swept(tmp_path):
    """A daemon SIGKILLed whose runtime dir is never used again leaves its /dev/shm dir: the
    next daemon of the user removes it (its owner is dead), not one whose owner runs, not one
    without an owner file, not another user's name."""
    from planaria.daemon import kv_segments

    uid = os.geteuid()
    dead = tmp_path / f"planaria-{uid}-dead"
    alive = tmp_path / f"planaria-{uid}-alive"
    unknown = tmp_path / f"planaria-{uid}-unknown"
    other = tmp_path / f"planaria-{uid + 1}-x"
    for d in (dead, alive, unknown, other):
        d.mkdir()
        touch(d, "engine0-5.kv")
    (dead / "owner").write_text("999999 12345\n")  # no such process
    (other / "owner").write_text("999999 12345\n")
    (alive / "owner").write_text(f"{os.getpid()} {kv_segments.process_start(os.getpid())}\n")
    keep = tmp_path / f"planaria-{uid}-mine"
    assert kv_segments.sweep_orphans(keep, shm_root=str(tmp_path)) == 1
    assert not dead.exists() and alive.exists() and unknown.exists() and other.exists()


def test_a_dead_pids_segments_go_when_due_and_no_others(shm_dir):
    d = KVSegmentDir(shm_dir / "kv")
    mine = [touch(d.path, segment_name(0, 111)), touch(d.path, segment_name(3, 111))]
    others = [touch(d.path, name) for name in ("engine0-1111.kv", "engine0-11.kv", "engine1-222.kv",
                                               "xengine0-111.kv", "engine0-111.kv.part")]
    d.schedule_removal(111, 10.0)
    d.schedule_removal(222, 30.0)
    assert d.next_due() == 10.0 and d.pending() == {111: 10.0, 222: 30.0}
    assert d.tick(9.9) == 0 and all(p.exists() for p in mine)
    assert d.tick(10.0) == 2
    assert not any(p.exists() for p in mine) and all(p.exists() for p in others)
    assert d.next_due() == 30.0 and d.pending() == {222: 30.0}
    assert d.tick(11.0) == 0
    d.remove_all()


def test_a_later_schedule_wins_and_a_live_pid_keeps_its_files(shm_dir):
    d = KVSegmentDir(shm_dir / "kv")
    seg = touch(d.path, segment_name(1, 500))
    d.schedule_removal(500, 10.0)
    d.schedule_removal(500, 20.0)  # exited again (a reused pid): the later one
    d.schedule_removal(500, 15.0)
    assert d.next_due() == 20.0
    assert d.tick(19.0) == 0 and seg.exists()
    assert d.tick(20.0, live_pids={500}) == 0 and seg.exists()  # a child has that pid now
    assert d.pending() == {}  # it is scheduled again when that child exits
    d.schedule_removal(500, 25.0)
    assert d.tick(25.0) == 1 and not seg.exists()
    d.remove_all()


def test_files_that_vanish_and_symlinks_are_taken_in_stride(shm_dir, tmp_path):
    d = KVSegmentDir(shm_dir / "kv")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (d.path / segment_name(0, 7)).symlink_to(victim)
    d.schedule_removal(7, 1.0)
    d.schedule_removal(8, 1.0)  # its file never existed
    assert d.tick(1.0) == 1
    assert victim.read_text() == "keep me"  # the link went, never its target
    assert not d._unlink(segment_name(0, 8))
    d.remove_all()
    assert victim.exists() and not d.path.exists()


def test_usage_and_unscheduled(shm_dir):
    d = KVSegmentDir(shm_dir / "kv")
    touch(d.path, segment_name(0, 100), 8192)
    touch(d.path, segment_name(1, 200), 4096)
    touch(d.path, "other")
    d.schedule_removal(200, 5.0)
    usage = d.usage()
    assert usage["dir"] == str(d.path) and usage["num_files"] == 2 and usage["num_kept"] == 1
    assert usage["bytes"] >= 12288
    assert d.unscheduled(live_pids={100}) == set()
    assert d.unscheduled() == {100}
    d.remove_all()


def test_remove_all_removes_the_files_and_the_directory(shm_dir):
    d = KVSegmentDir(shm_dir / "kv")
    touch(d.path, segment_name(0, 1))
    touch(d.path, "anything")
    d.schedule_removal(1, 5.0)
    assert d.remove_all() == 2
    assert not d.path.exists() and d.closed and d.pending() == {} and d.next_due() is None
    assert d.remove_all() == 0  # once only


def test_names():
    assert segment_name(3, 4567) == "engine3-4567.kv"
    assert segment_pid("engine3-4567.kv") == 4567
    assert segment_pid("engine3-4567.kvx") is None and segment_pid("engineX-1.kv") is None


# -- the flags -----------------------------------------------------------------------------

def _config(tmp_path, argv: list[str]) -> config_mod.ServeConfig:
    parser = argparse.ArgumentParser()
    config_mod.add_serve_arguments(parser)
    flags = config_mod.given_flags(parser.parse_args(["--model", str(tmp_path), *argv]))
    return config_mod.build(flags, {"STATE_DIRECTORY": str(tmp_path)})


def test_flags_and_defaults(tmp_path):
    cfg = _config(tmp_path, [])
    assert cfg.kv_salvage is True and cfg.kv_segment_ttl_s == 20.0
    assert _config(tmp_path, ["--kv-salvage", "off"]).kv_salvage is False
    assert _config(tmp_path, ["--kv-salvage", "ON"]).kv_salvage is True
    assert _config(tmp_path, ["--kv-segment-ttl", "2.5"]).kv_segment_ttl_s == 2.5
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--kv-salvage", "off",
                                      "--kv-segment-ttl", "7"])
    cfg = config_mod.build(config_mod.given_flags(args), {"STATE_DIRECTORY": str(tmp_path)})
    assert (cfg.kv_salvage, cfg.kv_segment_ttl_s) == (False, 7.0)
    assert "kv_segment_ttl_s" in config_mod.LIVE_FIELDS and "kv_salvage" not in config_mod.LIVE_FIELDS


@pytest.mark.parametrize("argv, message", [
    (["--kv-salvage", "yes"], "--kv-salvage must be on or off, got 'yes'"),
    (["--kv-salvage", ""], "--kv-salvage must be on or off"),
    (["--kv-segment-ttl", "0"], "--kv-segment-ttl must be a number of seconds > 0, got 0"),
    (["--kv-segment-ttl", "-1"], "--kv-segment-ttl must be a number of seconds > 0"),
    (["--kv-segment-ttl", "nan"], "--kv-segment-ttl must be a number of seconds > 0"),
    (["--kv-segment-ttl", "inf"], "--kv-segment-ttl must be a number of seconds > 0"),
])
def test_bad_values_are_clear_errors(tmp_path, argv, message):
    with pytest.raises(config_mod.ConfigError, match=message.replace(".", r"\.")):
        _config(tmp_path, argv)


def test_not_a_number_is_refused_by_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", str(tmp_path), "--kv-segment-ttl", "soon"])
    assert "--kv-segment-ttl: invalid float value: 'soon'" in capsys.readouterr().err


def test_the_env_file_sets_them_too(tmp_path):
    env = tmp_path / "planaria.env"
    env.write_text(f"PLANARIA_ARGS=--model {tmp_path} --kv-salvage off --kv-segment-ttl 3\n")
    cfg = config_mod.load({"env_file": str(env)}, {"STATE_DIRECTORY": str(tmp_path)})
    assert (cfg.kv_salvage, cfg.kv_segment_ttl_s) == (False, 3.0)
    env.write_text(f"PLANARIA_ARGS=--model {tmp_path} --kv-salvage maybe\n")
    with pytest.raises(config_mod.ConfigError, match="--kv-salvage must be on or off, got 'maybe'"):
        config_mod.load({"env_file": str(env)}, {"STATE_DIRECTORY": str(tmp_path)})


# -- the environment of the children ---------------------------------------------------------

def test_engines_and_standbys_get_the_directory_the_frontend_does_not(tmp_path):
    cfg = _config(tmp_path, [])
    launcher = Launcher(cfg, environ={"PATH": "/bin", SEGMENT_DIR_ENV: "/inherited"})
    # not made yet (or refused): nobody gets it, not even the inherited value
    assert SEGMENT_DIR_ENV not in launcher.engine(0).env
    launcher.kv_segment_dir = "/dev/shm/planaria-1-abc"
    assert launcher.engine(0).env[SEGMENT_DIR_ENV] == "/dev/shm/planaria-1-abc"
    assert launcher.engine(5).env[SEGMENT_DIR_ENV] == "/dev/shm/planaria-1-abc"
    assert launcher.standby(1, str(tmp_path / "s.ready")).env[SEGMENT_DIR_ENV] == "/dev/shm/planaria-1-abc"
    assert SEGMENT_DIR_ENV not in launcher.frontend(1).env


def test_with_salvage_off_no_child_gets_it(tmp_path):
    cfg = _config(tmp_path, ["--kv-salvage", "off"])
    launcher = Launcher(cfg, environ={"PATH": "/bin", SEGMENT_DIR_ENV: "/inherited"})
    launcher.kv_segment_dir = "/dev/shm/planaria-1-abc"
    for spec in (launcher.engine(0), launcher.standby(1, str(tmp_path / "s.ready")), launcher.frontend(1)):
        assert SEGMENT_DIR_ENV not in spec.env


# -- the supervisor --------------------------------------------------------------------------

def _supervisor(tmp_path, **flags):
    cfg = config_mod.build({"model": "/m", "num_engines": 2, "state_dir": str(tmp_path / "s"),
                            "runtime_dir": str(tmp_path / "run"), "stopped_timeout_s": 0.0,
                            "hang_timeout_s": 5.0, "kv_segment_ttl_s": 20.0, **flags}, environ={})
    spawner, clock = FakeSpawner(), Clock()
    return Supervisor(cfg, spawner, clock), spawner, clock


def test_a_dead_engines_segment_is_kept_for_the_ttl_then_removed(tmp_path, shm_dir):
    sup, spawner, clock = _supervisor(tmp_path)
    (shm_dir / "kv").mkdir()
    stale = touch(shm_dir / "kv", segment_name(0, 42))  # a SIGKILLed daemon's: swept at start
    segments = sup.open_kv_segments(KVSegmentDir(shm_dir / "kv"))
    assert not stale.exists()
    assert sup.open_kv_segments() is segments  # once only
    sup.start()
    e0, e1 = engine_child(spawner, 0), engine_child(spawner, 1)
    assert e0.spec.env[SEGMENT_DIR_ENV] == e1.spec.env[SEGMENT_DIR_ENV] == str(segments.path)
    frontend = spawner.live(("frontend",))[0]
    assert SEGMENT_DIR_ENV not in frontend.spec.env
    seg0, seg1 = touch(segments.path, segment_name(0, e0.pid)), touch(segments.path, segment_name(1, e1.pid))
    status = sup.status()["kv_segments"]
    assert status.pop("free_bytes") > 0
    assert status == {"dir": str(segments.path), "num_files": 2, "bytes": 0, "num_kept": 0}

    die(sup, e0)  # SIGKILL: its file stays for the TTL, a survivor copies from it
    assert segments.pending() == {e0.pid: clock.t + 20.0}
    assert sup.tick() <= clock.t + 20.0
    clock.t += 19.9
    sup.tick()
    assert seg0.exists()
    assert engine_child(spawner, 0) is not e0  # restarted meanwhile; the new one keeps its own
    clock.t += 0.1
    sup.tick()
    assert not seg0.exists() and seg1.exists()
    assert sup.status()["kv_segments"]["num_kept"] == 0


def test_a_planned_exit_keeps_its_segment_too_and_the_frontends_needs_none(tmp_path, shm_dir):
    sup, spawner, clock = _supervisor(tmp_path)
    segments = sup.open_kv_segments(KVSegmentDir(shm_dir / "kv"))
    sup.start()
    e1 = engine_child(spawner, 1)
    sup.drain_engine(1)
    die(sup, e1, 0)
    assert e1.pid in segments.pending()
    frontend = spawner.live(("frontend",))[0]
    die(sup, frontend, 1)
    assert frontend.pid not in segments.pending()


def test_a_file_of_no_known_process_is_removed_after_the_ttl(tmp_path, shm_dir):
    sup, spawner, clock = _supervisor(tmp_path)
    segments = sup.open_kv_segments(KVSegmentDir(shm_dir / "kv"))
    sup.start()
    live = touch(segments.path, segment_name(0, engine_child(spawner, 0).pid))
    orphan = touch(segments.path, segment_name(7, 99999))
    clock.t += 10.0
    sup.tick()  # the periodic look at the directory
    assert segments.pending() == {99999: clock.t + 20.0}
    clock.t += 20.0
    sup.tick()
    assert not orphan.exists() and live.exists()


def test_a_clean_stop_removes_everything(tmp_path, shm_dir):
    sup, spawner, clock = _supervisor(tmp_path)
    segments = sup.open_kv_segments(KVSegmentDir(shm_dir / "kv"))
    sup.start()
    touch(segments.path, segment_name(0, engine_child(spawner, 0).pid))
    sup.begin_shutdown()
    for child in list(sup.live_children()):
        die(sup, child, 0)
    assert sup.done
    sup.close_kv_segments()
    assert not segments.path.exists() and sup.kv_segments is None
    assert sup.launcher.kv_segment_dir == ""


def test_an_unsafe_directory_turns_salvage_off_with_a_warning(tmp_path, shm_dir, monkeypatch):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (shm_dir / "kv").symlink_to(target)
    import planaria.daemon.kv_segments as kv_mod

    monkeypatch.setattr(kv_mod, "segment_dir_path", lambda runtime_dir, **kw: shm_dir / "kv")
    sup, spawner, clock = _supervisor(tmp_path)
    assert sup.open_kv_segments() is None and sup.kv_segments is None
    sup.start()
    assert SEGMENT_DIR_ENV not in engine_child(spawner, 0).spec.env
    status = sup.status()["kv_segments"]
    assert status["dir"] is None and "symlink" in status["error"]
    die(sup, engine_child(spawner, 0))  # nothing to keep
    sup.tick()
    sup.close_kv_segments()
    assert (shm_dir / "kv").is_symlink() and target.is_dir()


def test_salvage_off_makes_no_directory(tmp_path, monkeypatch):
    import planaria.daemon.kv_segments as kv_mod

    monkeypatch.setattr(kv_mod.KVSegmentDir, "for_runtime_dir",
                        classmethod(lambda cls, runtime_dir: pytest.fail("made a directory")))
    sup, spawner, clock = _supervisor(tmp_path, kv_salvage=False)
    assert sup.open_kv_segments() is None
    sup.start()
    assert SEGMENT_DIR_ENV not in engine_child(spawner, 0).spec.env
    assert sup.status()["kv_segments"] is None


def test_the_default_directory_is_made_and_removed(tmp_path):
    """No injection: the directory of the runtime dir (in /dev/shm here, unless tmp is a
    tmpfs), made by open_kv_segments and gone after close_kv_segments."""
    sup, spawner, clock = _supervisor(tmp_path)
    (tmp_path / "run").mkdir(mode=0o700)
    segments = sup.open_kv_segments()
    try:
        assert segments is not None and segments.path == segment_dir_path(tmp_path / "run")
        assert stat.S_IMODE(os.lstat(segments.path).st_mode) == 0o700
    finally:
        sup.close_kv_segments()
    assert not segments.path.exists()


# -- systemd -------------------------------------------------------------------------------

def test_the_unit_lets_the_engines_map_their_segments():
    """/run/planaria (RuntimeDirectory=, a tmpfs) holds them; nothing in the unit's sandbox
    forbids a shared file mapping there."""
    unit = (Path(__file__).resolve().parents[2] / "systemd" / "planaria.service").read_text()
    settings = [line.split("=", 1)[0] for line in unit.splitlines()
                if "=" in line and not line.lstrip().startswith(("#", ";"))]
    assert "RuntimeDirectory" in settings
    for forbidden in ("MemoryDenyWriteExecute", "RestrictFileSystems", "PrivateDevices",
                      "InaccessiblePaths", "TemporaryFileSystem"):
        assert forbidden not in settings
