"""``bladed``: the command line of the daemon (``python -m bladed.server``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from bladed import __version__
from bladed.config import ConfigError, format_size, load_config, region_of
from bladed.protocol import PROTOCOL_VERSION
from bladed.server.daemon import Daemon
from bladed.server.lifecycle import open_store_device
from bladed.server.state import StateLockedError
from bladed.server.systemd import setup_logging

log = logging.getLogger("bladed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bladed", description="Dual-path NVMe-direct KV-cache daemon (Dual-Blade).")
    p.add_argument("--config", "-c", metavar="PATH", help="TOML configuration (default: the embedded default)")
    p.add_argument("--state-dir", metavar="DIR", help="override daemon.state_dir")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration and the device, print the result and exit")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    p.add_argument("--version", action="version", version=f"bladed {__version__} (protocol {PROTOCOL_VERSION})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, state_dir=args.state_dir)
    except ConfigError as e:
        print(f"bladed: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_toml())
        return 0
    setup_logging(cfg)
    if args.check_config:
        try:
            os.makedirs(cfg.state_dir, exist_ok=True)
            dev = open_store_device(cfg)
        except ConfigError as e:
            print(f"bladed: {e}", file=sys.stderr)
            return 2
        start, blocks = region_of(cfg, dev.capacity_blocks)
        print(f"configuration OK: {dev.kind} {dev.path}, {dev.lba_size}-byte LBAs, region [{start}, {start + blocks})"
              f" = {format_size(blocks * dev.lba_size)}, socket {cfg.socket_path}")
        dev.close()
        return 0
    daemon = Daemon(cfg)
    daemon.install_signals()
    try:
        daemon.start()
    except ConfigError as e:
        log.error("%s", e)
        print(f"bladed: {e}", file=sys.stderr)
        return 2
    except StateLockedError as e:
        log.error("%s", e)
        return 1
    try:
        daemon.serve_forever()
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
