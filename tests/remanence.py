"""The data-remanence round shared by tests/test_isolation.py (file and loop
backends) and tests/vm/test_faults_in_vm.py (NVMe): session A fills its
blocks and closes, session B gets the same blocks and reads before writing."""

from __future__ import annotations

from typing import Any

from daemon_util import DaemonProcess

from bladed.client import Client

#: 4096-byte token rows: aligned on 512- and 4096-byte LBAs
GEO = {"layers": 2, "batch": 2, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "max_tokens": 16}
KPU = 16 * 4096


def remanence_round(d: DaemonProcess, mode: str) -> dict[str, Any]:
    """Session A fills its extent/files and closes; session B gets the same blocks and reads before writing."""
    with Client(d.socket_path) as c:
        a = c.open_session(GEO, mode=mode, channels=1)
        ext_a = next(s for s in c.sessions() if s["session"] == a.id)["extent"]
        for layer in range(GEO["layers"]):
            for kind in "kv":
                a.slot(0)[:] = b"\xab" * KPU
                a.write(layer, kind, 0)
        a.close()
        b = c.open_session(GEO, mode=mode, channels=1)
        ext_b = next(s for s in c.sessions() if s["session"] == b.id)["extent"]
        assert ext_b == ext_a, "the test needs B to get A's blocks"
        for layer in range(GEO["layers"]):
            for kind in "kv":
                b.slot(0)[:] = b"\x11" * KPU
                b.read(layer, kind, 0)
                assert bytes(b.slot(0)) == bytes(KPU), f"session B read stale bytes in {kind}{layer} ({mode})"
                # a partial range too: Algorithm 2 on a never-written token range
                b.slot(0)[:] = b"\x11" * KPU
                b.read(layer, kind, 0, token_start=3, ntokens=5)
                assert bytes(b.slot(0)[3 * 4096:8 * 4096]) == bytes(5 * 4096)
        b.close()
        return c.stats()
