"""Configuration: the embedded default, the shipped etc/bladed.toml, every
validation message, and the daemon refusing to start on a bad value."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib

import pytest
from daemon_util import ROOT, env_with_repo, toml_text

from bladed.config import (
    EMBEDDED_STATE_DIR,
    SYSTEM_SOCKET,
    Config,
    ConfigError,
    SocketLocation,
    config_from_dict,
    find_socket,
    load_config,
    parse_size,
    reload_changes,
)

ETC = os.path.join(ROOT, "etc", "bladed.toml")
DOC = os.path.join(ROOT, "docs", "configuration.md")


def all_keys() -> list[str]:
    cfg = Config()
    return [f"{s.name}.{k.name}" for s in dataclasses.fields(cfg) if s.name != "source"
            for k in dataclasses.fields(getattr(cfg, s.name))]


def test_embedded_default_runs_from_the_state_dir(tmp_path) -> None:
    cfg = load_config(None, state_dir=str(tmp_path))
    assert cfg.device.backend == "file" and cfg.source == ""
    assert cfg.device_path == str(tmp_path / "kv-store.img")
    assert cfg.pagecache_dir == str(tmp_path / "pagecache")
    assert cfg.socket_path == str(tmp_path / "bladed.sock")
    assert not cfg.metrics.enabled and cfg.budget.override is None
    assert load_config(None).state_dir == os.path.abspath("var/bladed")


def test_shipped_config_documents_every_key_with_its_default() -> None:
    with open(ETC, "rb") as f:
        raw = tomllib.load(f)
    with open(ETC) as f:
        text = f.read()
    for key in all_keys():
        section, name = key.split(".")
        # optional keys are shown commented out
        assert name in raw.get(section, {}) or f"# {name} = " in text, key
    shipped = load_config(ETC)
    default = Config()
    differ = {k for k in all_keys()
              if getattr(getattr(shipped, k.split(".")[0]), k.split(".")[1])
              != getattr(getattr(default, k.split(".")[0]), k.split(".")[1])}
    assert differ == {"daemon.state_dir", "socket.path"}  # the systemd deployment's directories


def test_configuration_doc_matches_the_model() -> None:
    with open(DOC) as f:
        doc = f.read()
    for key in all_keys():
        assert f"`{key}`" in doc, key


def test_round_trip_through_toml(tmp_path) -> None:
    cfg = config_from_dict({"device": {"size": "2G", "region_start_lba": 8}, "budget": {"cap": "1G"},
                            "access": {"allowed_uids": [1000], "quota_bytes_per_uid": {"1000": "4G"}},
                            "socket": {"mode": "0600"}})
    assert (cfg.device.size, cfg.budget.cap, cfg.socket.mode) == (2 << 30, 1 << 30, 0o600)
    assert cfg.access.quota_bytes_per_uid == {1000: 4 << 30}
    p = tmp_path / "c.toml"
    p.write_text(cfg.to_toml())
    assert load_config(str(p)) == cfg


def test_every_problem_is_reported_at_once_with_its_key() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({
            "device": {"backend": "nvm", "sise": 1, "lba_size": 1000},
            "io": {"queue_depth": 0, "max_channels": "two"},
            "socket": {"mode": "rwx", "group": "no-such-group-xyz"},
            "metrics": {"listen": "nowhere"},
            "log": {"level": "loud"},
            "budget": {"override": "2G", "cap": "1G"},
            "extra": {},
        })
    text = str(e.value)
    expected = [
        "unknown key device.sise (did you mean 'size'?)",
        "device.backend: must be one of file, block, nvme, got 'nvm'",
        "device.lba_size: must be 0 or a power of two >= 512, got 1000",
        "io.queue_depth: must be within 1..4096, got 0",
        "io.max_channels: expected an integer, got 'two'",
        "socket.mode: expected an octal mode",
        "socket.group: no group named 'no-such-group-xyz'",
        "metrics.listen: expected HOST:PORT or unix:PATH, got 'nowhere'",
        "log.level: must be one of debug, info, warning, error, got 'loud'",
        "budget.override (2147483648) is larger than budget.cap (1073741824)",
        "unknown section [extra]",
    ]
    for msg in expected:
        assert msg in text, msg
    assert len(e.value.problems) == len(expected)


def test_sizes_and_paths() -> None:
    assert [parse_size(x) for x in (4096, "4096", "64M", "2GiB", "1 kb", "3T")] == \
        [4096, 4096, 64 << 20, 2 << 30, 1024, 3 << 40]
    for bad in ("1.5G", "-1", "lots", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ConfigError, match="longer than the 107"):
        config_from_dict({"socket": {"path": "/" + "x" * 120}})
    with pytest.raises(ConfigError, match="absolute /dev path"):
        config_from_dict({"device": {"backend": "block", "path": "sdb"}})


def test_reload_splits_live_keys_from_restart_keys() -> None:
    old = Config()
    new = config_from_dict({"access": {"allowed_uids": [5]}, "log": {"level": "debug"},
                            "io": {"max_channels": 2, "queue_depth": 64}, "device": {"size": "2G"}})
    applied, restart = reload_changes(old, new)
    assert sorted(applied) == ["access.allowed_uids", "io.max_channels", "log.level"]
    assert sorted(restart) == ["device.size", "io.queue_depth"]


def test_one_socket_rule_in_its_order(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """find_socket: --socket, -c, $BLADED_SOCKET, the system config, a bladed started here, /run/bladed;
    each answer says where it came from (the parenthesis of every "no bladed socket" error)."""
    monkeypatch.delenv("BLADED_SOCKET", raising=False)
    system = tmp_path / "system.toml"   # stands in for /etc/bladed/bladed.toml
    here = tmp_path / "here"
    here.mkdir()

    def find(explicit: str | None = None, **kw: str) -> SocketLocation:
        return find_socket(explicit, system_config=str(system), cwd=str(here), **kw)

    assert find() == SocketLocation(SYSTEM_SOCKET, "the system default", "start bladed or set BLADED_SOCKET")
    assert find().why == "the system default; start bladed or set BLADED_SOCKET"
    # what `python -m bladed.server` (no options) creates in its working directory
    embedded = load_config(None, state_dir=str(here / EMBEDDED_STATE_DIR)).socket_path
    os.makedirs(os.path.dirname(embedded))
    open(embedded, "w").close()
    assert find().path == embedded and find().origin == f"the embedded default of a bladed started in {here}"
    system.write_text('[socket]\npath = "/run/sys/b.sock"\n')
    assert find().path == "/run/sys/b.sock" and find().origin == f"socket.path of {system}"
    monkeypatch.setenv("BLADED_SOCKET", "/run/env/b.sock")
    assert (find().path, find().origin) == ("/run/env/b.sock", "from $BLADED_SOCKET")
    cfg = tmp_path / "given.toml"
    cfg.write_text('[daemon]\nstate_dir = "/srv/bladed"\n')
    assert (find(config=str(cfg)).path, find(config=str(cfg)).origin) == ("/srv/bladed/bladed.sock",
                                                                          f"socket.path of {cfg}")
    given = find("/run/x.sock", config=str(cfg), given_as="--socket")
    assert (given.path, given.origin) == ("/run/x.sock", "given as --socket")


def test_an_invalid_config_is_an_error_not_a_fallback(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("BLADED_SOCKET", raising=False)
    system = tmp_path / "system.toml"
    system.write_text("[socket\n")
    with pytest.raises(ConfigError, match="not valid TOML") as e:
        find_socket(system_config=str(system), cwd=str(tmp_path))
    assert e.value.source == str(system)
    with pytest.raises(ConfigError, match="does not exist"):
        find_socket(config=str(tmp_path / "missing.toml"), system_config=str(system))


def check_config(tmp_path, sections: dict) -> subprocess.CompletedProcess[str]:
    p = tmp_path / "bladed.toml"
    p.write_text(toml_text(sections))
    return subprocess.run([sys.executable, "-m", "bladed.server", "--config", str(p), "--state-dir", str(tmp_path),
                           "--check-config"], cwd=ROOT, env=env_with_repo(), capture_output=True, text=True,
                          timeout=120)   # a daemon that serves instead of exiting is killed, not waited for


def test_check_config_against_the_device(store_dir: str, tmp_path) -> None:
    base = {"device": {"path": os.path.join(store_dir, "s.img"), "size": "16M"}}
    ok = check_config(tmp_path, base)
    assert ok.returncode == 0 and "configuration OK: file" in ok.stdout and "16.0 MiB" in ok.stdout
    past = check_config(tmp_path, {"device": dict(base["device"], region_start_lba=1000, region_blocks=4000)})
    assert past.returncode == 2
    assert "device.region_blocks: region [1000, 5000) runs past the end" in past.stderr
    missing = check_config(tmp_path, {"device": {"backend": "block", "path": "/dev/no-such-disk"}})
    assert missing.returncode == 2 and "/dev/no-such-disk does not exist (no such device)" in missing.stderr
    notdir = check_config(tmp_path, {"device": {"path": "/no/such/dir/s.img"}})
    assert notdir.returncode == 2 and "directory /no/such/dir does not exist" in notdir.stderr
    p = tmp_path / "broken.toml"
    p.write_text("[device\n")
    bad = subprocess.run([sys.executable, "-m", "bladed.server", "--config", str(p)], cwd=ROOT,
                         env=env_with_repo(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not valid TOML" in bad.stderr


@pytest.mark.root
def test_lba_size_mismatch_is_refused(loop_device: str, tmp_path) -> None:
    r = check_config(tmp_path, {"device": {"backend": "block", "path": loop_device, "lba_size": 4096}})
    assert r.returncode == 2
    assert f"device.lba_size: {loop_device} has 512-byte LBAs but the configuration requires 4096" in r.stderr
    ok = check_config(tmp_path, {"device": {"backend": "block", "path": loop_device, "lba_size": 512}})
    assert ok.returncode == 0, ok.stderr
