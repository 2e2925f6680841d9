"""Retained prefixes on the NVMe passthrough path (QEMU's controller, inside the NVMe VM): an entry on the
namespace's extent is found again bit for bit, survives a clean restart (verified by its crc32c), and once
evicted its blocks are deallocated and read back as zeroes.

Kept to two daemon starts: under TCG every Python start-up costs seconds.
"""

from __future__ import annotations

import os
import sys

import pytest
from nvmevm import NG_PATH, VMConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemon_util import DaemonProcess, short_tmpdir
from test_prefix import GEO, assert_session_reads_zeroes, expected, key, prompt, read_kv, retain_prompt

from bladed.client import Client

pytestmark = pytest.mark.nvme_vm

TIMEOUT = 600.0


def test_a_retained_prefix_on_the_namespace(vm_config: VMConfig) -> None:
    lba = vm_config.lba_size
    cfg = {"device": {"backend": "nvme", "path": NG_PATH, "region_blocks": (4 << 20) // lba, "lba_size": lba},
           "budget": {"override": 0},
           "prefix": {"block_tokens": 16, "pagecache_bytes": 0, "device_bytes": "2M"}}
    tokens = prompt(48)
    with short_tmpdir() as tmp, DaemonProcess(tmp, cfg) as d:
        d.start(timeout=TIMEOUT)
        with Client(d.socket_path, timeout=TIMEOUT) as c:
            entry = retain_prompt(c, tokens, "vm")["entry"]
            (listed,) = c.prefixes()["prefixes"]
            assert listed["pagecache_bytes"] == 0 and listed["device_bytes"] > 0   # all of it on the namespace
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert (s.prefix_tokens, s.prefix_entry) == (48, entry)
                assert read_kv(s, 48) == expected("vm", 48)
        assert d.stop(TIMEOUT) == 0
        d.start(timeout=TIMEOUT)
        d.wait_event("prefix_restore", TIMEOUT, kept="1")       # what the (re)start itself does, once
        with Client(d.socket_path, timeout=TIMEOUT) as c:
            with c.open_session(GEO, channels=1, prefix=key(tokens)) as s:
                assert s.prefix_tokens == 48
                assert read_kv(s, 48) == expected("vm", 48)
            assert c.evict_prefixes() == [entry]
            # a session over most of the region: nothing of the entry is readable any more
            assert_session_reads_zeroes(c, 512)
        assert d.stop(TIMEOUT) == 0
