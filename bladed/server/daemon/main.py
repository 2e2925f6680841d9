"""``bladed``: the command line of the daemon (``python -m bladed.server``).

Every failure an operator can cause ends in one line naming the configuration
key (or flag), what is wrong and the fix, with the exit status below; a
traceback only for a bug, and only with ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from bladed import __version__
from bladed.config import Config, ConfigError, load_config
from bladed.protocol import PROTOCOL_VERSION
from bladed.server.daemon.core import Daemon
from bladed.server.daemon.preflight import check_device, check_paths
from bladed.server.daemon.systemd import report_error, setup_logging
from bladed.server.storage.journal import StateLockedError

log = logging.getLogger("bladed")

#: exit statuses (also in ``bladed --help`` and docs/operations.md)
EXIT_OK = 0
EXIT_BUSY = 1          # another bladed holds the state directory
EXIT_CONFIG = 2        # bad usage, configuration, or what it names (paths, device, addresses)
EXIT_BUG = 70          # an unexpected error: a bug (EX_SOFTWARE)
EXIT_INTERRUPTED = 130

#: (status, meaning) for ``bladed --help`` and the table in docs/operations.md
EXIT_STATUSES = (
    (EXIT_OK, "stopped cleanly (SIGTERM/SIGINT: sessions drained, extents TRIMmed)"),
    (EXIT_BUSY, "another bladed holds the state directory"),
    (EXIT_CONFIG, "bad usage or configuration: the message names the key, the problem and the fix"),
    (EXIT_BUG, "an unexpected error (a bug): rerun with --debug for the traceback and report it"),
    (EXIT_INTERRUPTED, "interrupted before start-up finished (Ctrl-C)"),
)

EPILOG = "exit status:\n" + "".join(f"  {n:<4} {what}\n" for n, what in EXIT_STATUSES)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bladed", description="Dual-path NVMe-direct KV-cache daemon (Dual-Blade).",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", metavar="PATH", help="TOML configuration (default: the embedded default)")
    p.add_argument("--state-dir", metavar="DIR", help="override daemon.state_dir")
    p.add_argument("--check-config", action="store_true",
                   help="check the configuration and everything start-up needs (directories, socket, metrics "
                        "address, device), print the result and exit; changes nothing on disk")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
    p.add_argument("--version", action="version", version=f"bladed {__version__} (protocol {PROTOCOL_VERSION})")
    return p


def _say(message: str) -> None:
    """One line on stderr: ``bladed: ...`` at a terminal, an error record under journald (once, not twice)."""
    report_error(message)


def check_config(cfg_path: str | None, state_dir: str | None) -> int:
    """``--check-config``: what start-up would refuse, without creating, binding or preallocating anything."""
    cfg = load_config(cfg_path, state_dir=state_dir)
    device_problems, what = check_device(cfg)
    problems = check_paths(cfg) + device_problems
    if problems:
        raise ConfigError(problems, cfg.source)
    metrics = f", metrics on {cfg.metrics.listen}" if cfg.metrics.enabled else ""
    print(f"configuration OK: {what}, socket {cfg.socket_path}, state {cfg.state_dir}{metrics}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.check_config:
            return check_config(args.config, args.state_dir)
        cfg = load_config(args.config, state_dir=args.state_dir)
        if args.print_config:
            print(cfg.to_toml())
            return EXIT_OK
        setup_logging(cfg)
        return _run(cfg)
    except ConfigError as e:
        _say(str(e))
        return EXIT_CONFIG
    except StateLockedError as e:
        _say(f"{e}; stop it first, or give this one another daemon.state_dir")
        return EXIT_BUSY
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        _say(f"unexpected error: {type(e).__name__}: {e} (a bug: rerun with --debug for the traceback and report "
             "it)")
        return EXIT_BUG


def _run(cfg: Config) -> int:
    daemon = Daemon(cfg)
    daemon.install_signals()
    daemon.start()          # ConfigError / StateLockedError: nothing is left behind
    try:
        daemon.serve_forever()
    finally:
        daemon.stop()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
