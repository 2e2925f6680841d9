"""Find the NVMe controllers and namespaces of this host.

Walks udev's view of sysfs with :mod:`pyudev` (subsystems ``nvme`` for
controllers, ``nvme-generic`` for the ``/dev/ngXnY`` char devices that the
NVMe-direct path uses, ``block`` for the ``nvmeXnY`` disks) and, where the
node can be opened, asks the controller itself (Identify) for MDTS and the
namespace geometry.  A kernel before 5.13 makes no generic char devices: a
namespace is then found by its block disk, and its node is ``/dev/nvmeXnY``
(the NVMe backend takes it for ioctl passthrough; ``node`` says which).  Without the right to open the device (it is
``root:root 0600`` by default) the geometry still comes from sysfs and the
Identify-only fields are ``None``.  A host without NVMe gives empty lists.

Used by ``bladectl`` to list candidate namespaces; the daemon itself opens
the namespace it is configured with (:class:`bladed.io.nvme.NvmeDevice`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import pyudev

from bladed._uring import lib
from bladed.io.nvme import CNS_CONTROLLER, CNS_NAMESPACE, NamespaceIdentity, identify, parse_identity

log = logging.getLogger(__name__)

SECTOR = 512  # sysfs "size" is in 512-byte sectors, whatever the LBA size
_GENERIC_NAME = re.compile(r"ng(\d+)n(\d+)")
_BLOCK_NAME = re.compile(r"nvme(\d+)n(\d+)")    # a namespace's disk (not a partition, not a hidden path nvmeXcYnZ)
_NODE_NAME = re.compile(r"(?:ng|nvme)(\d+)n(\d+)")


@dataclass(frozen=True)
class NvmeNamespaceInfo:
    """One NVMe namespace, as bladed would address it."""

    char_device: str                 # what the NVMe backend opens: /dev/ngXnY, or /dev/nvmeXnY (see node)
    block_device: str | None         # nvmeXnY (name under /sys/block), None if the kernel made no disk
    controller: str | None           # nvmeX; None for a multipath head reached through several
    nsid: int | None                 # None only without a disk and without the right to open the device
    lba_size: int | None             # bytes per logical block
    capacity_blocks: int | None
    capacity_bytes: int | None
    mdts: int | None                 # Identify Controller MDTS field (0 = no limit); None: not identified
    mdts_bytes: int | None           # 2^MDTS * 4 KiB; 0 = no limit; None: not identified
    max_hw_sectors_kb: int | None    # the kernel's per-command cap (follows MDTS)
    max_segments: int | None         # pages (or contiguous runs) one command may span
    discard_max_hw_bytes: int | None  # largest single deallocate range (from DMRSL)
    model: str
    serial: str
    firmware: str
    identified: bool                 # geometry and MDTS came from Identify (else sysfs only)
    node: str = "generic"            # "generic": char_device is /dev/ngXnY; "block": the kernel makes no
                                     # generic node (before 5.13), char_device is the block node /dev/nvmeXnY


@dataclass(frozen=True)
class NvmeControllerInfo:
    """One NVMe controller and the namespaces reached through it."""

    name: str                        # nvmeX
    device: str | None               # /dev/nvmeX (admin char device)
    model: str
    serial: str
    firmware: str
    transport: str                   # pcie, tcp, rdma, fc, loop
    address: str                     # PCI address for pcie
    namespaces: tuple[NvmeNamespaceInfo, ...]


def block_name_for(generic_name: str) -> str | None:
    """``nvme0n1`` for ``ng0n1``: the kernel numbers both after the same
    controller (or subsystem) instance and namespace head."""
    m = _GENERIC_NAME.fullmatch(generic_name)
    return f"nvme{m.group(1)}n{m.group(2)}" if m else None


def _attr_str(dev: pyudev.Device | None, name: str) -> str:
    if dev is None:
        return ""
    try:
        return dev.attributes.asstring(name).strip()
    except (KeyError, UnicodeDecodeError, OSError):
        return ""


def _attr_int(dev: pyudev.Device | None, name: str) -> int | None:
    text = _attr_str(dev, name)
    try:
        return int(text, 0) if text else None
    except ValueError:
        return None


def _identify(char_device: str, nsid: int | None) -> NamespaceIdentity | None:
    """Identify Namespace + Controller through the char device, or None if it cannot be opened."""
    try:
        fd = os.open(char_device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENXIO, errno.ENODEV):
            log.warning("%s: cannot open for Identify: %s", char_device, e)
        return None
    try:
        if nsid is None:
            nsid = lib.bd_nvme_ns_id(fd)
            if nsid < 0:
                log.debug("%s: NVME_IOCTL_ID failed: %s", char_device, os.strerror(-nsid))
                return None
        ident = parse_identity(nsid, identify(fd, nsid, CNS_NAMESPACE), identify(fd, 0, CNS_CONTROLLER))
    except OSError as e:   # EACCES/EPERM without CAP_SYS_ADMIN on older kernels
        log.debug("%s: Identify failed: %s", char_device, e)
        return None
    except (IndexError, ValueError) as e:
        log.warning("%s: unreadable Identify data: %s", char_device, e)
        return None
    finally:
        os.close(fd)
    if ident.nsze == 0 or ident.lba_size == 0:
        # an all-zero answer: the controller refused the command
        log.warning("%s: Identify returned no namespace data", char_device)
        return None
    return ident


def _namespace(ctx: pyudev.Context, gen: pyudev.Device, do_identify: bool) -> NvmeNamespaceInfo | None:
    """The namespace of a generic char device ``ngXnY``, with its disk ``nvmeXnY`` if the kernel made one."""
    name = gen.sys_name
    if not _GENERIC_NAME.fullmatch(name):
        return None
    blk: pyudev.Device | None = None
    bname = block_name_for(name)
    if bname:
        try:
            blk = pyudev.Devices.from_name(ctx, "block", bname)
        except pyudev.DeviceNotFoundError:
            blk = None
    return _info(gen.device_node or f"/dev/{name}", "generic", gen.parent, blk, do_identify)


def _block_namespace(blk: pyudev.Device, do_identify: bool) -> NvmeNamespaceInfo | None:
    """The namespace of a disk ``nvmeXnY`` that has no generic char device (kernels before 5.13)."""
    if not _BLOCK_NAME.fullmatch(blk.sys_name):
        return None
    return _info(blk.device_node or f"/dev/{blk.sys_name}", "block", blk.parent, blk, do_identify)


def _info(node_path: str, node: str, parent: pyudev.Device | None, blk: pyudev.Device | None,
          do_identify: bool) -> NvmeNamespaceInfo:
    controller = parent.sys_name if parent is not None and parent.subsystem == "nvme" else None
    nsid = _attr_int(blk, "nsid")   # the name's "nY" is the head instance, not always the nsid

    lba_size = _attr_int(blk, "queue/logical_block_size")
    sectors = _attr_int(blk, "size")
    capacity_bytes = sectors * SECTOR if sectors is not None else None
    ident = _identify(node_path, nsid) if do_identify else None
    if ident is not None:
        nsid = ident.nsid
        lba_size = ident.lba_size
        capacity_bytes = ident.nsze * ident.lba_size
    capacity_blocks = capacity_bytes // lba_size if capacity_bytes is not None and lba_size else None

    # model/serial: the controller's, or the subsystem's for a multipath head
    info_dev = parent
    return NvmeNamespaceInfo(
        char_device=node_path,
        block_device=blk.sys_name if blk is not None else None,
        controller=controller,
        nsid=nsid,
        lba_size=lba_size,
        capacity_blocks=capacity_blocks,
        capacity_bytes=capacity_bytes,
        mdts=ident.mdts if ident is not None else None,
        mdts_bytes=ident.mdts_bytes if ident is not None else None,
        max_hw_sectors_kb=_attr_int(blk, "queue/max_hw_sectors_kb"),
        max_segments=_attr_int(blk, "queue/max_segments"),
        discard_max_hw_bytes=_attr_int(blk, "queue/discard_max_hw_bytes"),
        model=_attr_str(info_dev, "model") or (ident.model if ident else ""),
        serial=_attr_str(info_dev, "serial") or (ident.serial if ident else ""),
        firmware=_attr_str(info_dev, "firmware_rev"),
        identified=ident is not None,
        node=node,
    )


def _context(context: pyudev.Context | None) -> pyudev.Context:
    return context if context is not None else pyudev.Context()


def _sort_key(ns: NvmeNamespaceInfo) -> tuple[int, ...]:
    # by controller, then NSID: the Y of ngXnY is the order the kernel found the namespace in, which
    # need not be NSID order (Linux 6.12 scans a controller's namespaces concurrently)
    m = _NODE_NAME.fullmatch(os.path.basename(ns.char_device))
    if not m:
        return (1 << 30,)
    return (int(m.group(1)), ns.nsid if ns.nsid is not None else 1 << 30, int(m.group(2)))


def list_namespaces(*, identify: bool = True, context: pyudev.Context | None = None) -> list[NvmeNamespaceInfo]:
    """Every NVMe namespace, by controller and NSID: through its generic char device, or through its
    disk where it has none (kernels before 5.13).

    ``identify=False`` never opens a device (sysfs only; MDTS is then None).
    """
    ctx = _context(context)
    out = []
    for gen in ctx.list_devices(subsystem="nvme-generic"):
        ns = _namespace(ctx, gen, identify)
        if ns is not None:
            out.append(ns)
    with_generic = {ns.block_device for ns in out}
    for blk in ctx.list_devices(subsystem="block"):
        if blk.sys_name not in with_generic:
            ns = _block_namespace(blk, identify)
            if ns is not None:
                out.append(ns)
    return sorted(out, key=_sort_key)


def list_controllers(*, identify: bool = True,
                     context: pyudev.Context | None = None) -> list[NvmeControllerInfo]:
    """Every NVMe controller with the namespaces whose char device hangs off it."""
    ctx = _context(context)
    namespaces = list_namespaces(identify=identify, context=ctx)
    out = []
    for dev in ctx.list_devices(subsystem="nvme"):
        name = dev.sys_name
        out.append(NvmeControllerInfo(
            name=name,
            device=dev.device_node,
            model=_attr_str(dev, "model"),
            serial=_attr_str(dev, "serial"),
            firmware=_attr_str(dev, "firmware_rev"),
            transport=_attr_str(dev, "transport"),
            address=_attr_str(dev, "address"),
            namespaces=tuple(ns for ns in namespaces if ns.controller == name),
        ))
    return sorted(out, key=lambda c: int(c.name[4:]) if c.name[4:].isdigit() else 1 << 30)


def find_namespace(char_device: str, *, identify: bool = True,
                   context: pyudev.Context | None = None) -> NvmeNamespaceInfo | None:
    """The namespace behind ``char_device`` (``/dev/ngXnY``, its block node ``/dev/nvmeXnY``, or a
    link to either), or None."""
    want = os.path.realpath(char_device)
    for ns in list_namespaces(identify=identify, context=context):
        if want in (os.path.realpath(ns.char_device),
                    os.path.realpath(f"/dev/{ns.block_device}") if ns.block_device else None):
            return ns
    return None


def as_dict(ns: NvmeNamespaceInfo | NvmeControllerInfo) -> dict[str, Any]:
    """A JSON-ready dict (for ``bladectl`` output)."""
    return asdict(ns)
