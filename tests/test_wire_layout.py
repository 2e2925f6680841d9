"""One source for the wire: the C side is compiled from bladed.protocol's WIRE-LAYOUT section, and says so.

The structs and codes of ``bladed_wire_layout.h`` are generated from ``bladed/protocol.py`` at build time
(``cffi_build/wire_layout.py``).  Here the compiled extension reports what the C compiler made of them
(``ffi.offsetof``/``ffi.sizeof``, ``lib.BD_*``: cffi asks the compiler) and each is held to the Python
struct it came from, field by field; a stale build is refused at import; and the lane's latency histogram
has as many bounds in C as ``bladed.server.metrics`` gives it.
"""

from __future__ import annotations

import errno
import pathlib
import runpy
import struct
import subprocess
import sys
import textwrap
import types

import pytest

from bladed import _uring, _wire, protocol
from bladed.protocol import IO_RANGE, IO_RANGE_FIELDS, WIRE_CODES, WIRE_RECORDS, IORange, RangeResult
from bladed.server.metrics import LATENCY_BOUNDS_NS, LATENCY_BUCKETS

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: the build's own generator, from the source tree (run by path, as the build does: no bytecode in cffi_build/)
wire_layout = types.SimpleNamespace(**runpy.run_path(str(ROOT / "cffi_build" / "wire_layout.py")))


def laid_out(fields: tuple[tuple[str, str], ...]) -> dict[str, tuple[int, int]]:
    """Python's ``name -> (offset, bytes)`` of a record's named fields, from the struct module."""
    out, offset = {}, 0
    for name, code in fields:
        size = struct.calcsize("<" + code)
        if name:
            out[name] = (offset, size)
        offset += size
    return out


@pytest.mark.parametrize("record", sorted(WIRE_RECORDS))
def test_every_record_is_laid_out_in_c_as_in_python_field_by_field(record: str) -> None:
    fields = WIRE_RECORDS[record]
    ffi = _wire.ffi
    ctype = ffi.typeof(f"struct bd_{record}")
    assert ffi.sizeof(ctype) == struct.calcsize("<" + "".join(c for _, c in fields))
    c_fields = {name: (f.offset, ffi.sizeof(f.type)) for name, f in ctype.fields}
    assert c_fields == laid_out(fields)


def test_the_python_structs_are_the_records() -> None:
    """What protocol packs with is what the C side was generated from (the names bladed.protocol exports)."""
    for record, s in [("frame_header", protocol.HEADER), ("io_request", protocol.IO_REQUEST),
                      ("io_range", protocol.IO_RANGE), ("io_reply", protocol.IO_REPLY),
                      ("io_result", protocol.IO_RESULT)]:
        assert s.format == "<" + "".join(c for _, c in WIRE_RECORDS[record]), record
    # IORange packs positionally (encode_io_request): its fields are IO_RANGE's, in order
    assert IORange._fields == tuple(name for name, _ in IO_RANGE_FIELDS if name)
    r = IORange(protocol.IOOp.READ, 7, 3, 2, 4096)
    assert IO_RANGE.unpack(IO_RANGE.pack(*r)) == tuple(r)
    assert RangeResult().ok


def test_every_code_compiled_into_c_is_python_s() -> None:
    lib = _wire.lib
    assert {name: getattr(lib, f"BD_{name}") for name in WIRE_CODES} == WIRE_CODES
    assert lib.BD_WIRE_LAYOUT_ID == protocol.WIRE_LAYOUT_ID
    assert WIRE_CODES["MAGIC_LE16"].to_bytes(2, "little") == protocol.MAGIC
    assert (WIRE_CODES["WIRE_OP_WRITE"], WIRE_CODES["WIRE_OP_READ"]) == (protocol.IOOp.WRITE, protocol.IOOp.READ)
    # a result's path code decodes to the name it was encoded from
    for name, code in protocol.PATH_CODES.items():
        assert protocol._PATH_NAMES[code] == name


def test_the_build_reads_the_section_alone_and_gets_what_the_module_has() -> None:
    """The WIRE-LAYOUT section runs without the rest of protocol.py (the build cannot import the package)."""
    ns = wire_layout.spec()
    assert ns["WIRE_RECORDS"] == WIRE_RECORDS and ns["WIRE_CODES"] == WIRE_CODES
    assert ns["WIRE_LAYOUT_ID"] == protocol.WIRE_LAYOUT_ID
    header = wire_layout.c_header(ns)
    assert f"#define BD_WIRE_LAYOUT_ID {protocol.WIRE_LAYOUT_ID}u" in header
    assert "_Static_assert(offsetof(struct bd_io_range, slot_offset) == 16" in header


def test_an_edited_layout_changes_the_id_and_the_header(tmp_path: pathlib.Path) -> None:
    """Widening one field moves the offsets after it in the generated C, and the layout id with them."""
    text = (ROOT / "bladed" / "protocol.py").read_text()
    edited = text.replace('("tensor_id", "I")', '("tensor_id", "Q")', 1)
    assert edited != text
    (tmp_path / "protocol.py").write_text(edited)
    ns = wire_layout.spec(tmp_path / "protocol.py")
    assert ns["WIRE_LAYOUT_ID"] != protocol.WIRE_LAYOUT_ID
    header = wire_layout.c_header(ns)
    assert "uint64_t tensor_id;" in header and "offsetof(struct bd_io_range, slot_offset) == 20" in header


def test_a_stale_extension_is_refused_at_import() -> None:
    """An editable install whose C was built from another layout does not load: it would misread every frame."""
    code = textwrap.dedent("""
        import sys, types
        import bladed._wire as real
        fake = types.ModuleType("bladed._wire")
        fake.ffi = real.ffi
        fake.lib = types.SimpleNamespace(BD_WIRE_LAYOUT_ID=real.lib.BD_WIRE_LAYOUT_ID ^ 1)
        sys.modules["bladed._wire"] = fake
        try:
            import bladed.protocol
        except ImportError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.startswith("refused: bladed._wire was built from another wire layout"), out


def test_the_lane_histogram_has_the_metrics_bounds() -> None:
    """The C counters' shape is BD_LANE_BOUNDS; the lane copies metrics.LATENCY_BOUNDS_NS into it (a shorter
    list would leave zero bounds behind, silently)."""
    lib, ffi = _uring.lib, _uring.ffi
    assert lib.BD_LANE_BOUNDS == len(LATENCY_BOUNDS_NS) == len(LATENCY_BUCKETS)
    lane = ffi.new("struct bd_lane *")
    assert len(lane.bounds_ns) == lib.BD_LANE_BOUNDS
    counters = ffi.new("struct bd_lane_counters *")
    assert len(counters.buckets[0][0]) == lib.BD_LANE_BOUNDS + 1
    assert list(LATENCY_BOUNDS_NS) == sorted(LATENCY_BOUNDS_NS)


def test_the_daemon_extension_shares_the_client_s_frame_types() -> None:
    """bladed._uring includes bladed._wire's declarations: the lane's stream is the type FrameStream drives."""
    lane = _uring.ffi.new("struct bd_lane *")
    lane.stream.fd = -1
    stream = _uring.ffi.addressof(lane, "stream")
    assert _wire.ffi.typeof(stream) is _wire.ffi.typeof("struct bd_stream *")
    assert _wire.lib.bd_stream_read(stream, 0) == -errno.EBADF      # taken as the client's own type
