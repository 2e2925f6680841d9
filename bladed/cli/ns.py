"""``bladectl ns``: the NVMe namespaces, partitions and store files bladed can use (``list``),
whether it can use one (``check``), and a config for one (``setup``).

They work without a daemon.  Which backend a path is and whether something uses it are in
:mod:`bladed.cli.storage`, the checks in :mod:`bladed.cli.checks`.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import click

from bladed.cli.checks import Check, run_checks
from bladed.cli.common import EXIT_FAILED, EXIT_USAGE, SIZE, Failure, Group, emit, global_options, settings, size
from bladed.cli.storage import StorageError, in_use, target_backend
from bladed.config import SYSTEM_CONFIG, SYSTEM_SOCKET, config_from_dict, load_config

NVME_IOCTL_ADMIN_CMD = 0xC0484E41
NVME_ADMIN_FORMAT_NVM = 0x80
#: struct nvme_passthru_cmd (<linux/nvme_ioctl.h>, 72 bytes)
PASSTHRU = struct.Struct("<BBHIIIQQIIIIIIIIII")


@click.group(cls=Group)
@global_options
def ns() -> None:
    """NVMe namespaces, partitions and files bladed can use: list, check, setup."""


@ns.command("list")
@global_options
@click.option("--no-identify", is_flag=True, help="Use sysfs only; never open a device.")
def ns_list(no_identify: bool) -> None:
    """NVMe controllers and namespaces: char devices, LBA formats, MDTS, capacity."""
    from bladed.io import discovery

    ctrls = discovery.list_controllers(identify=not no_identify)
    listed = {ns.char_device for c in ctrls for ns in c.namespaces}
    orphans = [n for n in discovery.list_namespaces(identify=not no_identify) if n.char_device not in listed]
    formats = {n.char_device: _lba_formats(n.char_device) for c in ctrls for n in c.namespaces}
    formats.update({n.char_device: _lba_formats(n.char_device) for n in orphans})
    data = {"controllers": [dict(discovery.as_dict(c), namespaces=[
        dict(discovery.as_dict(n), lba_formats=formats[n.char_device]) for n in c.namespaces]) for c in ctrls],
        "namespaces_without_controller": [dict(discovery.as_dict(n), lba_formats=formats[n.char_device])
                                          for n in orphans]}

    def human(d: dict[str, Any]) -> None:
        if not d["controllers"] and not d["namespaces_without_controller"]:
            click.echo("no NVMe controllers found (use the block or file backend, or the NVMe VM for tests)")
            return
        for c in d["controllers"]:
            click.echo(f"{c['name']}  {c['model']}  serial {c['serial']}  fw {c['firmware']}  "
                       f"{c['transport']} {c['address']}")
            for n in c["namespaces"]:
                _print_ns(n)
        for n in d["namespaces_without_controller"]:
            _print_ns(n)

    emit(data, human)


def _print_ns(n: dict[str, Any]) -> None:
    mdts = "?" if n["mdts_bytes"] is None else ("unlimited" if n["mdts_bytes"] == 0 else size(n["mdts_bytes"]))
    fmts = ", ".join(f"{'*' if f['current'] else ''}{f['lba_size']}" + (f"+{f['metadata']}m" if f["metadata"] else "")
                     for f in n["lba_formats"]) or "?"
    click.echo(f"  {n['char_device']}  nsid {n['nsid']}  block {n['block_device'] or '-'}  "
               f"LBA {n['lba_size']}  formats [{fmts}]  MDTS {mdts}  capacity {size(n['capacity_bytes'])}")


def _lba_formats(char_device: str) -> list[dict[str, Any]]:
    from bladed.io.nvme import NvmeDevice

    try:
        dev = NvmeDevice(char_device)
    except (OSError, ValueError):
        return []
    ident = dev.identity
    dev.close()
    return [{"index": i, "lba_size": lba, "metadata": ms, "current": i == ident.current_format}
            for i, (lba, ms) in enumerate(ident.lba_formats) if lba]


def free_target(path: str, backend: str, size_bytes: int) -> str:
    """The backend of ``path`` once it is known to be a store bladed may take; StorageError if not."""
    kind = target_backend(path, backend)
    if not os.path.exists(path):
        if not size_bytes:
            raise StorageError(f"{path} does not exist; give --size to have it created (e.g. --size 64G)",
                               "no_size", usage=True)
        return kind
    why = in_use(path, kind)
    if why:
        fix = ("stop that bladed first to set its store up again" if why.startswith("in use by bladed")
               else "give bladed a device nothing else uses (`bladectl ns list`)")
        raise StorageError(f"{path} is {why}; {fix}", "in_use")
    return kind


def _unusable(path: str, checks: list[Check]) -> str:
    failed = [c for c in checks if c.status == "fail"]
    return f"{path} is NOT usable by bladed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)


def _print_checks(checks: list[Check]) -> None:
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    for c in checks:
        click.echo(f"[{marks[c.status]}] {c.name}: {c.detail}")


def _backend_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--backend", type=click.Choice(["auto", "file", "block", "nvme"]), default="auto",
                        show_default=True, help="auto: a char device is nvme, a block device block, else file.")(f)


@ns.command("check")
@global_options
@click.argument("device")
@_backend_option
@click.option("--region-start", type=click.IntRange(min=0), default=0, help="First LBA of the region.")
@click.option("--region-blocks", type=click.IntRange(min=0), default=0, help="Blocks in the region (0: to the end).")
@click.option("--size", "size_bytes", type=SIZE, default="0", help="Store size for a file that does not exist yet.")
def ns_check(device: str, backend: str, region_start: int, region_blocks: int, size_bytes: int) -> None:
    """Can bladed use DEVICE: not in use, LBA size, alignment, permissions, kernel features.

    DEVICE is an NVMe namespace (/dev/ngXnY), a block device or partition, or a store file
    (created by `ns setup` if missing and --size is given).  Exit status 1 if bladed cannot use it.
    """
    kind = free_target(device, backend, size_bytes)
    checks = run_checks(device, kind, size_bytes=size_bytes, region_start=region_start, region_blocks=region_blocks)
    usable = all(c.status != "fail" for c in checks)
    data: dict[str, Any] = {"ok": usable, "device": device, "backend": kind, "usable": usable,
                            "checks": [c.to_dict() for c in checks]}
    if not usable:
        data["error"] = {"code": "unusable", "message": _unusable(device, checks)}

    def human(_: Any) -> None:
        _print_checks(checks)
        click.echo(f"{device}: usable by bladed" if usable else _unusable(device, checks))

    emit(data, human)
    if not usable:
        click.get_current_context().exit(EXIT_FAILED)


def format_namespace(char_device: str, lba_size: int) -> int:
    """NVMe Format NVM to the LBA format of ``lba_size`` bytes without metadata; returns its index.

    Destroys every byte of the namespace.  The kernel revalidates the
    namespace afterwards (the command's effects include an LBA format change).
    """
    from bladed.io.nvme import NvmeDevice

    dev = NvmeDevice(char_device)
    ident, nsid, fd = dev.identity, dev.nsid, os.dup(dev.fd)
    dev.close()
    try:
        index = next((i for i, (lba, ms) in enumerate(ident.lba_formats) if lba == lba_size and ms == 0), None)
        if index is None:
            raise Failure(f"{char_device} offers no {lba_size}-byte LBA format without metadata (formats: "
                          f"{ident.lba_formats}); pick one of those with --format-lba", "no_such_format", EXIT_USAGE)
        cdw10 = (index & 0xF) | ((index >> 4) & 0x3) << 12   # LBAF bits 3:0 and LBAFU bits 13:12; SES = 0
        cmd = bytearray(PASSTHRU.pack(NVME_ADMIN_FORMAT_NVM, 0, 0, nsid, 0, 0, 0, 0, 0, 0,
                                      cdw10, 0, 0, 0, 0, 0, 600_000, 0))
        ret = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, cmd, True)
        if ret != 0:
            raise Failure(f"Format NVM of {char_device} failed with NVMe status 0x{ret:x}", "format_failed")
        return index
    finally:
        os.close(fd)


@ns.command("setup")
@global_options
@click.argument("target")
@_backend_option
@click.option("--size", "size_bytes", type=SIZE, default="0", help="File backend: size of the store file (e.g. 64G).")
@click.option("--region-start", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--region-blocks", type=click.IntRange(min=0), default=0, help="0: to the end of the device.")
@click.option("--state-dir", default="/var/lib/bladed", show_default=True)
@click.option("--socket-path", default=SYSTEM_SOCKET, show_default=True)
@click.option("--pagecache-dir", default="pagecache", show_default=True, help="Relative to --state-dir.")
@click.option("--format-lba", type=click.Choice(["512", "4096"]), default=None,
              help="NVMe only: reformat the namespace to this LBA size first (erases it; asks to confirm).")
@click.option("--yes", "-y", is_flag=True, help="Confirm --format-lba without asking.")
@click.option("--output", "-o", default=SYSTEM_CONFIG, show_default=True,
              help="Where to write the config ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing config file.")
def ns_setup(target: str, backend: str, size_bytes: int, region_start: int, region_blocks: int,
             state_dir: str, socket_path: str, pagecache_dir: str, format_lba: str | None, yes: bool,
             output: str, force: bool) -> None:
    """Write (and validate) a bladed config for a namespace, partition or file.

    Runs the checks of `ns check` first and writes nothing if TARGET is in use or unusable.
    """
    kind = free_target(target, backend, size_bytes)
    if output != "-" and os.path.exists(output) and not force:
        raise Failure(f"{output} exists; add --force to overwrite it", "exists")
    formatted = None
    if format_lba:
        if kind != "nvme":
            raise Failure(f"--format-lba only applies to an NVMe namespace (/dev/ngXnY); {target} is {kind}",
                          "usage", EXIT_USAGE)
        if not yes:
            click.confirm(f"Format {target} to {format_lba}-byte LBAs? EVERY BYTE ON IT IS LOST", abort=True, err=True)
        formatted = format_namespace(target, int(format_lba))
    checks = run_checks(target, kind, size_bytes=size_bytes, region_start=region_start, region_blocks=region_blocks)
    if any(c.status == "fail" for c in checks):
        if not settings().json:
            _print_checks(checks)
        raise Failure(_unusable(target, checks) + "; nothing written", "unusable",
                      extra={"checks": [c.to_dict() for c in checks]})
    device: dict[str, Any] = {"backend": kind, "path": os.path.abspath(target) if kind == "file" else target,
                              "region_start_lba": region_start, "region_blocks": region_blocks}
    if kind == "file":
        device["size"] = size_bytes
    lba = next((int(c.detail.split()[0]) for c in checks if c.name == "LBA size"), 0)
    if kind != "file" and lba:
        device["lba_size"] = lba  # the daemon refuses to start if the device changes under it
    cfg = config_from_dict({"daemon": {"state_dir": state_dir}, "device": device,
                            "pagecache": {"directory": pagecache_dir}, "socket": {"path": socket_path}},
                           source=output)
    text = f"# written by bladectl ns setup on {time.strftime('%Y-%m-%d %H:%M:%S')}\n" + cfg.to_toml()
    if output == "-":
        click.echo(text, nl=False)
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            f.write(text)
    except OSError as e:
        raise Failure(f"cannot write {output}: {e.strerror}; run as root or give another -o PATH",
                      "os_error") from None
    load_config(output)  # what the daemon will read back
    dropin = device_dropin(target) if kind != "file" else ""
    result = {"config": output, "backend": kind, "device": device, "formatted_lba_format": formatted,
              "systemd_dropin": dropin, "checks": [c.to_dict() for c in checks]}

    def human(d: dict[str, Any]) -> None:
        click.echo(f"wrote {output}: {kind} {target}, region LBA {region_start} + {region_blocks or 'rest'}; "
                   f"start bladed with --config {output}")
        if os.path.abspath(output) != SYSTEM_CONFIG:
            click.echo(f"clients find its socket with `bladectl -c {output}` or BLADED_SOCKET={cfg.socket_path}")
        if dropin:
            click.echo("write to /etc/systemd/system/bladed.service.d/device.conf (replaces the shipped "
                       "systemd/dropins/nvme-device.conf):\n" + dropin)

    emit(result, human)


def systemd_escape_path(path: str) -> str:
    """``systemd-escape --path``: the unit-name form of a device path (``/dev/bladed/kv`` -> ``dev-bladed-kv``)."""
    parts = [p for p in os.path.normpath(path).split("/") if p]
    out = []
    for part in parts:
        esc = "".join(c if (c.isascii() and (c.isalnum() or c in ":_.")) else f"\\x{ord(c):02x}" for c in part)
        out.append(("\\x2e" + esc[1:]) if esc.startswith(".") else esc)
    return "-".join(out)


def device_dropin(target: str) -> str:
    """The drop-in that lets the hardened unit open ``target`` (the shape of systemd/dropins/nvme-device.conf)."""
    unit = systemd_escape_path(target) + ".device"
    return (f"[Unit]\nBindsTo={unit}\nAfter={unit}\n\n[Service]\nPrivateDevices=no\nDevicePolicy=closed\n"
            f"DeviceAllow=\nDeviceAllow={target} rw\n")

