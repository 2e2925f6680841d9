"""bladed's configuration: the model, the TOML loader and validation.

Every key and its default is documented in ``docs/configuration.md`` and in
``etc/bladed.toml``.  Without a config file the *embedded default* applies:
a file-backed store, the page-cache directory and the socket, all under the
state directory (``var/bladed`` relative to the working directory unless
``--state-dir`` says otherwise), so ``python -m bladed.server`` runs anywhere.

Relative paths in the file (``device.path``, ``pagecache.directory``,
``socket.path``, ``metrics.listen = "unix:..."``) are taken relative to
``daemon.state_dir``.
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import importlib.util
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from bladed.protocol import MAX_RANGES

EMBEDDED_STATE_DIR = "var/bladed"
SYSTEM_CONFIG = "/etc/bladed/bladed.toml"
BACKENDS = ("file", "block", "nvme")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "text", "journal")
PREFIX_SCOPES = ("uid", "group")
#: shortest fleet secret of the shared tier (characters): 16 random bytes written in hex
MIN_SECRET_CHARS = 32
SOCKET_PATH_MAX = 107  # sizeof(sun_path) - 1


class ConfigError(ValueError):
    """One or more configuration values are invalid; ``problems`` lists them all."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        if len(problems) == 1:
            # one problem, one line: the key, what is wrong, the fix
            super().__init__(f"{where}{problems[0]}")
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            super().__init__(f"{where}{len(problems)} configuration problems:\n{lines}")


# -- the model ---------------------------------------------------------------
@dataclass
class DaemonConfig:
    state_dir: str = EMBEDDED_STATE_DIR


@dataclass
class DeviceConfig:
    backend: str = "file"
    path: str = "kv-store.img"
    #: file backend: size of the store file (created/extended at start); 0 = keep the existing size
    size: int = 1 << 30
    #: file: block size to use; block/nvme: the LBA size the device must have (0 = accept any)
    lba_size: int = 0
    region_start_lba: int = 0
    #: 0 = from region_start_lba to the end of the device
    region_blocks: int = 0
    #: file/block backends: per-command payload (nvme: derived from MDTS)
    max_command_bytes: int = 1 << 20
    #: after a session's TRIM: "auto" = Write Zeroes where the device does not read zeroes after a
    #: deallocate (or the deallocate failed); "always" = Write Zeroes every freed extent
    zero_freed: str = "auto"
    #: the drive's rated endurance in TB written (decimal TB, 10^12 bytes; the "TBW" of its data sheet) for the
    #: days left at the current rate (``bladectl wear``); 0 = unset (the drive's own estimate where it gives one)
    endurance_tbw: float = 0.0


#: where Dual-Blade's page-cache KPUs (Group 1) live: ``memory`` files the kernel never writes back (live demotion
#: is their eviction), ``disk`` files in ``pagecache.directory`` (the kernel's writeback and reclaim), or ``auto``:
#: memory where live demotion can evict them (``budget.live_replan = true``), disk otherwise
PAGECACHE_BACKINGS = ("auto", "memory", "disk")


@dataclass
class PageCacheConfig:
    directory: str = "pagecache"
    #: Dual-Blade's Group 1: one of PAGECACHE_BACKINGS (``Config.group1_backing`` resolves "auto"); the other
    #: modes' page cache is always on disk
    backing: str = "auto"


@dataclass
class BudgetConfig:
    #: fixed B_pc in bytes instead of Eq. 1-2 (None = measure)
    override: int | None = None
    #: upper bound on the measured B_pc (None = no cap)
    cap: int | None = None
    #: cgroup (v1 or v2 path) whose limits bound M_max; "" = the daemon's own
    cgroup: str = ""
    #: how often the budget terms are re-sampled for metrics, status and live re-planning (seconds)
    interval_s: float = 5.0
    #: re-sample B_pc while running (periodically and on memory pressure) and demote live sessions' KPUs
    live_replan: bool = True
    #: dualblade sessions reserve extent blocks for every KPU at open, so demotions always fit
    reserve_extent: bool = False
    #: kernel memory charged to the cgroup per byte of page cache (buffer heads, page-cache index): B_pc leaves
    #: room for it; measured 0.028 on ext4 (docs/architecture.md, "The page-cache budget"); 0 = the paper's Eq. 2
    kernel_overhead: float = 0.03
    #: the fraction of a cgroup's limit B_pc leaves free (M_free), so the charges no term of Eq. 1-2 names never
    #: bring the cgroup to its limit, where reclaim meets Group 1's dirty pages and stalls (docs/architecture.md,
    #: "The page-cache budget"); 0 = a budget that fills the cgroup
    headroom: float = 0.02
    #: bytes per second a neighbour in a limited cgroup above the daemon may grow that bladed out-runs while Group 1
    #: is in memory files: M_free is at least absorb_rate * the reaction time measured for live demotion
    #: (docs/operations.md, "Memory"); 0 = the headroom fraction alone; with disk files the kernel reclaims instead
    absorb_rate: int = 1 << 30


@dataclass
class IOConfig:
    #: "auto" (io_uring where this process may use it and, for nvme, where the kernel has io_uring_cmd; else
    #: the portable engine), "uring" or "portable" (threads doing preadv2/pwritev2 and passthrough ioctls);
    #: checked where the device opens (bladed.io.engines.choose), which probes the kernel for it
    engine: str = "auto"
    queue_depth: int = 32
    #: most worker channels (copy threads) one session may open
    max_channels: int = 8
    #: most ranges one I/O request may carry (``max_ranges`` in the hello reply)
    max_outstanding: int = 256
    #: a reply that cannot be sent within this time closes the connection
    send_timeout_s: float = 30.0
    #: default of open_session's ``checksums``: crc32c of every token row written, verified on read
    checksums: bool = False
    #: most staging memory (all channels) one session may have the daemon map and pin
    max_staging_bytes: int = 4 << 30
    #: reads one channel keeps in flight (in pieces of half of it), so other channels' appends pass its bulk reads;
    #: 0 = no window (every piece of a read submitted at once)
    read_window_bytes: int = 1 << 20
    #: bytes bladed's own commands may write to the device per UTC day before new direct-path spills (a session
    #: whose plan needs direct KPUs, a live demotion, a retained prefix on the device) are refused with
    #: write_budget_exhausted; 0 = no budget (docs/operations.md, "Wear")
    write_budget: int = 0


@dataclass
class SocketConfig:
    path: str = "bladed.sock"
    mode: int = 0o660
    #: group owning the socket ("" = the daemon's primary group)
    group: str = ""
    max_connections: int = 64


@dataclass
class AccessConfig:
    #: uids allowed besides root and the daemon's own uid
    allowed_uids: list[int] = field(default_factory=list)
    #: a peer whose primary or supplementary group is listed is allowed
    allowed_gids: list[int] = field(default_factory=list)
    #: uids that may run admin ops (trim) besides root
    admin_uids: list[int] = field(default_factory=list)
    #: bytes of KV store (both paths) one uid may hold across its sessions; 0 = unlimited
    quota_bytes: int = 0
    #: per-uid overrides of quota_bytes, keyed by uid
    quota_bytes_per_uid: dict[int, int] = field(default_factory=dict)


@dataclass
class PrefixConfig:
    """Retained prefixes (docs/architecture.md, "Prefix reuse")."""

    #: tokens per hashed block: a prefix is found again in whole blocks
    block_tokens: int = 16
    #: device bytes all retained prefixes may hold on the extent region; 0 = none there
    device_bytes: int = 512 << 20
    #: page-cache bytes all retained prefixes may hold (live sessions' budget always comes first); 0 = none there
    pagecache_bytes: int = 64 << 20
    #: who sees a retained prefix: "uid" (the peer's uid) or "group" (the peer's primary group)
    scope: str = "uid"
    #: the shared tier: a Redis URL (redis://HOST:PORT/DB, rediss:// for TLS, unix:///PATH); "" = off
    shared_url: str = ""
    #: a file whose first line is the Redis password, or USER:PASSWORD for an ACL user ("" = none)
    shared_credentials: str = ""
    #: CA certificate file that verifies a rediss:// server ("" = the system's)
    shared_tls_ca: str = ""
    #: the fleet secret that signs shared-tier values (required with shared_url): a file, not readable by every
    #: user, whose first line is the current secret and whose optional second line is the previous one (read only)
    shared_secret_file: str = ""
    #: longest wait for one Redis call; an error or timeout is a miss, and the tier is skipped for 5 s
    shared_timeout_s: float = 0.25


@dataclass
class BlocksConfig:
    """Block pools for serving engines (docs/vllm.md; bladed.server.blocks)."""

    #: bytes one block pool may hold (its capacity: what the engine asks for, at most this); 0 = pools off
    max_bytes: int = 512 << 20
    #: page-cache bytes one pool may be planned with (what live sessions leave of B_pc, at most this)
    pagecache_bytes: int = 64 << 20


@dataclass
class MetricsConfig:
    enabled: bool = False
    #: "HOST:PORT" (port 0: any free port, shown by ``bladectl status``) or "unix:PATH"
    listen: str = "127.0.0.1:9477"


@dataclass
class LogConfig:
    level: str = "info"
    #: auto = journal when started by systemd (JOURNAL_STREAM set), else text
    format: str = "auto"


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    pagecache: PageCacheConfig = field(default_factory=PageCacheConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    io: IOConfig = field(default_factory=IOConfig)
    socket: SocketConfig = field(default_factory=SocketConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    blocks: BlocksConfig = field(default_factory=BlocksConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    #: where it was loaded from ("" = embedded default)
    source: str = field(default="", compare=False)

    # -- resolved paths --------------------------------------------------------
    @property
    def state_dir(self) -> str:
        return os.path.abspath(self.daemon.state_dir)

    def resolve(self, path: str) -> str:
        """``path`` made absolute against the state directory."""
        return os.path.normpath(os.path.join(self.state_dir, path))

    @property
    def device_path(self) -> str:
        # block/nvme device nodes are given absolute; a relative name is a file under the state dir
        return self.resolve(self.device.path)

    @property
    def pagecache_dir(self) -> str:
        return self.resolve(self.pagecache.directory)

    @property
    def socket_path(self) -> str:
        return self.resolve(self.socket.path)

    @property
    def group1_backing(self) -> str:
        """Where Dual-Blade's Group 1 lives, ``"memory"`` or ``"disk"``: ``pagecache.backing``, with ``"auto"``
        resolved (memory files only where live demotion, their one eviction, runs)."""
        if self.pagecache.backing == "auto":
            return "memory" if self.budget.live_replan else "disk"
        return self.pagecache.backing

    @property
    def metrics_target(self) -> tuple[str, str | tuple[str, int]]:
        """("unix", path) or ("tcp", (host, port))."""
        listen = self.metrics.listen
        if listen.startswith("unix:"):
            return "unix", self.resolve(listen[5:])
        host, _, port = listen.rpartition(":")
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def to_toml(self) -> str:
        """The configuration as TOML that :func:`load_config` reads back identically."""
        out: list[str] = []
        for section, values in self.to_dict().items():
            out.append(f"[{section}]")
            for key, value in values.items():
                if value is None:
                    out.append(f"# {key} = (unset)")
                    continue
                out.append(f"{key} = {_toml_value(value, key)}")
            out.append("")
        return "\n".join(out)


RELOADABLE = frozenset({"access", "budget", "log", "io.max_channels", "io.max_outstanding", "io.send_timeout_s",
                        "io.max_staging_bytes", "io.write_budget", "device.endurance_tbw"})


def reload_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """(keys applied by a reload, keys that need a restart) between two configs."""
    applied: list[str] = []
    restart: list[str] = []
    a, b = old.to_dict(), new.to_dict()
    for section in a:
        for key in a[section]:
            if a[section][key] == b[section][key]:
                continue
            name = f"{section}.{key}"
            (applied if section in RELOADABLE or name in RELOADABLE else restart).append(name)
    return applied, restart


def _toml_value(value: Any, key: str = "") -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"0o{value:o}" if key == "mode" else str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


# -- parsing -----------------------------------------------------------------
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like ``"64M"``, ``"4 GiB"`` (binary units)."""
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(m.group(1)) << _UNITS[m.group(2).lower()]
    raise ValueError(f"expected a size in bytes (e.g. 4096, \"64M\", \"2GiB\"), got {value!r}")


def format_size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


_SIZE_KEYS = {"device.size", "device.max_command_bytes", "budget.override", "budget.cap", "budget.absorb_rate",
              "access.quota_bytes",
              "io.max_staging_bytes", "io.read_window_bytes", "io.write_budget", "prefix.device_bytes",
              "prefix.pagecache_bytes", "blocks.max_bytes", "blocks.pagecache_bytes"}


def _coerce(section: str, key: str, value: Any, default: Any, problems: list[str]) -> Any:
    """``value`` converted to the type of the field, or a problem recorded."""
    name = f"{section}.{key}"
    try:
        if name in _SIZE_KEYS:
            return parse_size(value)
        if name == "socket.mode":
            if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3,4}", value):
                return int(value, 8)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise ValueError(f"expected an octal mode like 0o660 or \"0660\", got {value!r}")
        if name == "access.quota_bytes_per_uid":
            if not isinstance(value, dict):
                raise ValueError("expected a table of uid = size")
            out = {}
            for uid, size in value.items():
                if not str(uid).isdigit():
                    raise ValueError(f"key {uid!r} is not a numeric uid")
                out[int(uid)] = parse_size(size)
            return out
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            return value
        if isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"expected a number, got {value!r}")
            return float(value)
        if isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"expected an integer, got {value!r}")
            return value
        if isinstance(default, str):
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            return value
        if isinstance(default, list):
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ValueError(f"expected a list of integers, got {value!r}")
            return list(value)
    except ValueError as e:
        problems.append(f"{name}: {e}")
        return default
    problems.append(f"{name}: unsupported value {value!r}")
    return default


def config_from_dict(data: dict[str, Any], source: str = "", state_dir: str | None = None) -> Config:
    """Build and validate a Config from parsed TOML; raises ConfigError listing every problem."""
    cfg = Config(source=source)
    problems: list[str] = []
    sections = {f.name: f for f in dataclasses.fields(Config) if f.name != "source"}
    for section, values in data.items():
        if section not in sections:
            problems.append(f"unknown section [{section}]{_hint(section, sections)}")
            continue
        if not isinstance(values, dict):
            problems.append(f"[{section}] must be a table, got {values!r}")
            continue
        target = getattr(cfg, section)
        fields = {f.name: f for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in fields:
                problems.append(f"unknown key {section}.{key}{_hint(key, fields)}")
                continue
            default = getattr(target, key)
            if default is None:  # optional sizes: override / cap
                default = 0
            setattr(target, key, _coerce(section, key, value, default, problems))
    if state_dir is not None:
        cfg.daemon.state_dir = state_dir
    problems.extend(validate(cfg))
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _hint(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_config(path: str | None = None, *, state_dir: str | None = None) -> Config:
    """Load ``path`` (None: the embedded default), with ``state_dir`` overriding ``daemon.state_dir``."""
    if path is None:
        return config_from_dict({}, "", state_dir)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist"]) from None
    except IsADirectoryError:
        raise ConfigError([f"config file {path} is a directory; give the TOML file in it (-c DIR/bladed.toml)"]) \
            from None
    except PermissionError:
        raise ConfigError([f"config file {path} is not readable by uid {os.getuid()}; fix its mode or run as its "
                           "owner"]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"not valid TOML: {e}"], path) from None
    return config_from_dict(data, path, state_dir)


def validate(cfg: Config) -> list[str]:
    """Problems with values that need no device to check."""
    p: list[str] = []
    d = cfg.device
    if d.backend not in BACKENDS:
        p.append(f"device.backend: must be one of {', '.join(BACKENDS)}, got {d.backend!r}")
    if not d.path:
        p.append("device.path: must name the store file, block device or /dev/ngXnY")
    elif d.backend in ("block", "nvme") and not os.path.isabs(d.path):
        p.append(f"device.path: a {d.backend} device must be an absolute /dev path, got {d.path!r}")
    if d.lba_size and (d.lba_size < 512 or d.lba_size & (d.lba_size - 1)):
        p.append(f"device.lba_size: must be 0 or a power of two >= 512, got {d.lba_size}")
    if d.region_start_lba < 0:
        p.append(f"device.region_start_lba: must be >= 0, got {d.region_start_lba}")
    if d.region_blocks < 0:
        p.append(f"device.region_blocks: must be >= 0 (0 = to the end), got {d.region_blocks}")
    if d.backend == "file":
        lba = d.lba_size or 4096
        if lba > 4096:
            # staging slots are page aligned, and the engine needs LBA-aligned buffer addresses
            p.append(f"device.lba_size: the file backend supports 512 to 4096, got {lba}")
        if d.size and d.size % lba:
            p.append(f"device.size: {d.size} is not a multiple of the {lba}-byte LBA")
    if d.zero_freed not in ("auto", "always"):
        p.append(f"device.zero_freed: must be \"auto\" or \"always\", got {d.zero_freed!r}")
    if d.max_command_bytes < 4096:
        p.append(f"device.max_command_bytes: must be at least 4096, got {d.max_command_bytes}")
    if not 0.0 <= d.endurance_tbw < 1e9:
        p.append(f"device.endurance_tbw: must be the drive's rated TB written (e.g. 600), or 0 for unset, got "
                 f"{d.endurance_tbw}")
    if not cfg.pagecache.directory:
        p.append("pagecache.directory: must not be empty")
    if cfg.pagecache.backing not in PAGECACHE_BACKINGS:
        p.append(f"pagecache.backing: must be \"auto\", \"memory\" or \"disk\", got {cfg.pagecache.backing!r}")
    elif cfg.pagecache.backing == "memory" and not cfg.budget.live_replan:
        # only the explicit pair contradicts itself: "auto" (the default) resolves to disk here
        p.append("pagecache.backing: \"memory\" files are evicted by live demotion only, which budget.live_replan = "
                 "false turns off; set pagecache.backing = \"auto\" or \"disk\", or budget.live_replan = true")
    b = cfg.budget
    if b.interval_s <= 0:
        p.append(f"budget.interval_s: must be positive, got {b.interval_s}")
    if not 0.0 <= b.kernel_overhead < 1.0:
        p.append(f"budget.kernel_overhead: must be within [0, 1) (0.03 on ext4, 0 for the paper's Eq. 2), "
                 f"got {b.kernel_overhead}")
    if not 0.0 <= b.headroom < 0.5:
        p.append(f"budget.headroom: must be within [0, 0.5) (a fraction of the memory limit left free; 0.02 by "
                 f"default), got {b.headroom}")
    if b.absorb_rate < 0:
        p.append(f"budget.absorb_rate: must be >= 0 (bytes per second, e.g. \"1G\"; 0 = the headroom fraction "
                 f"alone), got {b.absorb_rate}")
    if b.override is not None and b.cap is not None and b.override > b.cap:
        p.append(f"budget.override ({b.override}) is larger than budget.cap ({b.cap})")
    io = cfg.io
    if not 1 <= io.queue_depth <= 4096:
        p.append(f"io.queue_depth: must be within 1..4096, got {io.queue_depth}")
    if not 1 <= io.max_channels <= 64:
        p.append(f"io.max_channels: must be within 1..64, got {io.max_channels}")
    if not 1 <= io.max_outstanding <= MAX_RANGES:
        p.append(f"io.max_outstanding: must be 1..{MAX_RANGES} (ranges per I/O request), got {io.max_outstanding}")
    if io.max_staging_bytes < 4096:
        p.append(f"io.max_staging_bytes: must be at least 4096, got {io.max_staging_bytes}")
    if io.read_window_bytes and io.read_window_bytes < 8192:
        p.append(f"io.read_window_bytes: must be 0 (no window) or at least 8192 (two 4 KiB pieces), got "
                 f"{io.read_window_bytes}")
    if io.send_timeout_s <= 0:
        p.append(f"io.send_timeout_s: must be positive, got {io.send_timeout_s}")
    s = cfg.socket
    if not s.path:
        p.append("socket.path: must not be empty")
    elif len(cfg.socket_path.encode()) > SOCKET_PATH_MAX:
        p.append(f"socket.path: {cfg.socket_path} is {len(cfg.socket_path.encode())} bytes, "
                 f"longer than the {SOCKET_PATH_MAX} a Unix socket address allows")
    if not 0 <= s.mode <= 0o777:
        p.append(f"socket.mode: must be a permission mode within 0o000..0o777, got {oct(s.mode)}")
    if s.group:
        try:
            group_id(s.group)
        except KeyError:
            p.append(f"socket.group: no group named {s.group!r} on this host")
    if s.max_connections < 1:
        p.append(f"socket.max_connections: must be >= 1, got {s.max_connections}")
    a = cfg.access
    for name in ("allowed_uids", "allowed_gids", "admin_uids"):
        bad = [v for v in getattr(a, name) if v < 0]
        if bad:
            p.append(f"access.{name}: ids must be >= 0, got {bad}")
    pr = cfg.prefix
    if not 1 <= pr.block_tokens <= 4096:
        p.append(f"prefix.block_tokens: must be within 1..4096, got {pr.block_tokens}")
    if pr.scope not in PREFIX_SCOPES:
        p.append(f"prefix.scope: must be one of {', '.join(PREFIX_SCOPES)}, got {pr.scope!r}")
    if pr.shared_url:
        if not pr.shared_url.startswith(("redis://", "rediss://", "unix://")):
            p.append(f"prefix.shared_url: expected redis://HOST:PORT/DB, rediss://... or unix:///PATH, got "
                     f"{pr.shared_url!r}")
        elif importlib.util.find_spec("redis") is None:
            p.append("prefix.shared_url: the shared tier needs the 'redis' Python package "
                     "(pip install 'bladed[shared]')")
        for key in ("shared_credentials", "shared_tls_ca"):
            path = getattr(pr, key)
            if path and not os.access(path, os.R_OK):
                p.append(f"prefix.{key}: {path} is not a readable file")
        if not pr.shared_secret_file:
            p.append("prefix.shared_secret_file: the shared tier (prefix.shared_url) needs the fleet secret that "
                     "signs its values; name a file holding one (openssl rand -hex 32 > FILE; chmod 600 FILE)")
        else:
            try:
                read_shared_secrets(pr.shared_secret_file)
            except ValueError as e:
                p.append(f"prefix.shared_secret_file: {e}")
    if pr.shared_timeout_s <= 0:
        p.append(f"prefix.shared_timeout_s: must be positive, got {pr.shared_timeout_s}")
    m = cfg.metrics
    if m.listen.startswith("unix:"):
        if not m.listen[5:]:
            p.append("metrics.listen: unix: needs a path")
    else:
        _host, sep, port = m.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            p.append(f"metrics.listen: expected HOST:PORT or unix:PATH, got {m.listen!r}")
    if cfg.log.level not in LOG_LEVELS:
        p.append(f"log.level: must be one of {', '.join(LOG_LEVELS)}, got {cfg.log.level!r}")
    if cfg.log.format not in LOG_FORMATS:
        p.append(f"log.format: must be one of {', '.join(LOG_FORMATS)}, got {cfg.log.format!r}")
    return p


def read_shared_secrets(path: str) -> list[bytes]:
    """The fleet secrets in ``prefix.shared_secret_file``: ``[current]`` or ``[current, previous]`` (its non-blank
    lines, stripped); ValueError (one line: the cause and the fix) if the file cannot serve."""
    fix = "openssl rand -hex 32 > FILE; chmod 600 FILE"
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}; create it ({fix}) or fix its permissions") from None
    if mode & 0o007:
        # any local user could forge values every box would serve
        raise ValueError(f"{path} is open to every user (mode {oct(mode & 0o777)}); chmod 600 it (640 for a group)")
    lines = [ln.strip() for ln in raw.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path} holds no secret; put one on its first line ({fix})")
    if len(lines) > 2:
        raise ValueError(f"{path} has {len(lines)} lines; it holds the current secret and at most the previous one")
    short = [i + 1 for i, ln in enumerate(lines) if len(ln) < MIN_SECRET_CHARS]
    if short:
        raise ValueError(f"{path}: line {short[0]} is shorter than {MIN_SECRET_CHARS} characters; use a random "
                         f"secret ({fix})")
    return lines


def group_id(group: str) -> int:
    """A gid from a group name or a numeric string (KeyError if unknown)."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except ValueError:      # a name no group can have (an embedded NUL)
        raise KeyError(group) from None


def validate_device(cfg: Config, *, lba_size: int, capacity_blocks: int, path: str) -> list[str]:
    """Problems between the configuration and the opened device's geometry."""
    p = []
    d = cfg.device
    if d.lba_size and d.backend != "file" and d.lba_size != lba_size:
        p.append(f"device.lba_size: {path} has {lba_size}-byte LBAs but the configuration requires "
                 f"{d.lba_size} (reformat the namespace, e.g. `bladectl ns setup --format`, or change lba_size)")
    if d.region_start_lba >= capacity_blocks:
        p.append(f"device.region_start_lba: {d.region_start_lba} is past the end of {path} "
                 f"({capacity_blocks} blocks of {lba_size} bytes)")
    elif d.region_start_lba + d.region_blocks > capacity_blocks:
        p.append(f"device.region_blocks: region [{d.region_start_lba}, {d.region_start_lba + d.region_blocks}) "
                 f"runs past the end of {path} ({capacity_blocks} blocks of {lba_size} bytes)")
    return p


def region_of(cfg: Config, capacity_blocks: int) -> tuple[int, int]:
    """(start LBA, blocks) of the configured region on a device of ``capacity_blocks``."""
    start = cfg.device.region_start_lba
    blocks = cfg.device.region_blocks or max(0, capacity_blocks - start)
    return start, blocks


#: where the shipped configuration and the systemd unit put the socket
SYSTEM_SOCKET = "/run/bladed/bladed.sock"


@dataclass(frozen=True)
class SocketLocation:
    """Where a client looks for bladed, why there, and what to do when nothing listens there."""

    path: str
    #: where the path came from, e.g. ``from $BLADED_SOCKET``
    origin: str
    #: what to do if no bladed listens there
    fix: str

    def __str__(self) -> str:
        return self.path

    @property
    def why(self) -> str:
        """``origin; fix``, the parenthesis of every "no bladed socket" message."""
        return f"{self.origin}; {self.fix}"


def find_socket(explicit: str | None = None, *, config: str | None = None, given_as: str = "socket_path",
                system_config: str = SYSTEM_CONFIG, cwd: str | None = None) -> SocketLocation:
    """The socket a client connects to: the one rule of ``bladectl``, the client library, the
    runner and ``bladed.hf`` (docs/configuration.md, "Where clients find the socket").

    1. ``explicit`` (``--socket``, ``Client(socket_path=...)``; ``given_as`` names it);
    2. ``socket.path`` of ``config`` (``bladectl -c``);
    3. ``$BLADED_SOCKET``;
    4. ``socket.path`` of ``system_config`` (``/etc/bladed/bladed.toml``), if it exists;
    5. the embedded default's socket under ``cwd`` (``./var/bladed/bladed.sock``: a bladed
       started there without options), if that socket exists;
    6. :data:`SYSTEM_SOCKET`.

    Raises ConfigError if ``config`` (or an existing ``system_config``) is invalid.
    """
    if explicit:
        return SocketLocation(explicit, f"given as {given_as}",
                              "start bladed there or give the path of its socket")
    if config:
        return SocketLocation(_config_socket(config), f"socket.path of {config}",
                              f"start bladed with --config {config}")
    env = os.environ.get("BLADED_SOCKET")
    if env:
        return SocketLocation(env, "from $BLADED_SOCKET",
                              "start bladed there or point BLADED_SOCKET at its socket")
    if os.path.exists(system_config):
        return SocketLocation(_config_socket(system_config), f"socket.path of {system_config}",
                              "start bladed (systemctl start bladed) or set BLADED_SOCKET")
    here = os.path.abspath(cwd or os.getcwd())
    embedded = os.path.join(here, EMBEDDED_STATE_DIR, SocketConfig.path)
    if os.path.exists(embedded):
        return SocketLocation(embedded, f"the embedded default of a bladed started in {here}",
                              "start it there again (python -m bladed.server) or set BLADED_SOCKET")
    return SocketLocation(SYSTEM_SOCKET, "the system default", "start bladed or set BLADED_SOCKET")


def _config_socket(path: str) -> str:
    try:
        return load_config(path).socket_path
    except OSError as e:  # FileNotFoundError is a ConfigError already
        raise ConfigError([f"cannot read {path} ({e.strerror}) to find bladed's socket; "
                           "set BLADED_SOCKET or give the socket path"], path) from None
