/*
 * bladed_lane.h - the request loop of a data connection, in C at both ends.
 *
 * Measured in Python, one one-token page-cache round trip cost 4.4x a framed
 * ping-pong between two processes: each Python step of framing, checking,
 * counting and replying costs microseconds on an edge CPU (docs/benchmarks.md,
 * "The page-cache lane").  So the mechanics live here and the policy stays in
 * Python:
 *
 *   - bd_stream (bladed_wire.h): frame reads (one recv per frame when the peer
 *     sent it whole), the same for the daemon's data connections and the
 *     client's DataChannel;
 *   - bd_lane: the daemon's loop for one data connection.  It serves the
 *     requests whose ranges all address KPUs whose gate is open (plain
 *     page-cache KPUs by copy; direct KPUs of whole-LBA token rows on the
 *     channel's ring, all of a request's commands submitted together), and
 *     hands every other frame to Python untouched;
 *   - bd_kpu_gate: per KPU, whether the lane may serve it, where, and how
 *     many lane requests are on it; Python closes a gate (a pending demotion,
 *     teardown) and waits for it to drain;
 *   - bd_chan: a channel's lock (shared by the lane and Python) and counters.
 *
 * This file is read twice: by the C compiler, and (between the CDEF markers)
 * by cffi.
 */
#ifndef BLADED_LANE_H
#define BLADED_LANE_H
#include <stdint.h>

#include "bladed_wire.h"

/* CDEF-BEGIN */
/* the lane's latency histogram: bounds (bladed.server.metrics.LATENCY_BOUNDS_NS, which tests/test_wire_layout.py
 * holds to this count) */
#define BD_LANE_BOUNDS 18
/* Where a gate's KPU lives: the index of the lane's counters per path. */
enum bd_gate_path {
    BD_PATH_PAGECACHE = 0,        /* a plain page-cache file, mapped */
    BD_PATH_DIRECT = 1            /* whole LBAs of the session's extent */
};
/* A channel: its lock and what the lane served on it.  Counters per path
 * (enum bd_gate_path) and op (index 0 read, 1 write).  Written under the
 * lock; read without it. */
struct bd_lane_counters {
    uint64_t ops[2][2];
    uint64_t bytes[2][2];
    uint64_t errors[2][2];
    uint64_t latency_ns[2][2];
    uint64_t buckets[2][2][BD_LANE_BOUNDS + 1];   /* latency histogram: one past the last bound too */
    uint64_t pagecache_read_bytes;
    uint64_t pagecache_hit_bytes;
    uint64_t requests;            /* requests the lane served */
    uint64_t channel_ops;         /* ranges run on the channel, by either path */
    uint64_t busy_ns;             /* time spent running them */
};
struct bd_chan;
struct bd_chan *bd_chan_new(void);
void bd_chan_free(struct bd_chan *c);
void bd_chan_lock(struct bd_chan *c);
int bd_chan_trylock(struct bd_chan *c);                          /* 0: taken */
void bd_chan_unlock(struct bd_chan *c);
struct bd_lane_counters *bd_chan_counters(struct bd_chan *c);

/* One KPU's gate.  word: bit 31 closed, low bits lane requests in flight.
 * Made closed (word = BD_GATE_CLOSED, fd = -1). */
struct bd_kpu_gate {
    uint32_t word;
    uint32_t filled;              /* tokens [0, filled) written through the lane */
    int32_t fd;                   /* page cache: the KPU's file (direct: -1) */
    uint32_t path;                /* enum bd_gate_path */
    uint64_t base;                /* page cache: its mapping; direct: its first LBA on the device */
    uint64_t nbytes;              /* the bytes a range may address */
};
#define BD_GATE_CLOSED 2147483648
/* open a drained gate: 0, or -EBUSY if it is open or still draining.  A
 * page-cache KPU: its file fd mapped at base; a direct KPU (fd -1): first LBA
 * base of the lane's device, token rows of whole LBAs. */
int bd_gate_open(struct bd_kpu_gate *g, uint32_t path, int fd, uint64_t base, uint64_t nbytes);
void bd_gate_close(struct bd_kpu_gate *g);                       /* new lane requests pass it by */
void bd_gate_drain(struct bd_kpu_gate *g);                       /* close, then wait for those in flight */

/* One range the lane served, or failed: err != 0, and then a page-cache
 * range's err is the errno and a direct range's failure is its transfer's
 * (bd_lane.xfers[i] for range i). */
struct bd_lane_row {
    uint64_t nbytes;
    uint64_t service_ns;
    uint64_t hit;                 /* resident bytes of a page-cache read; NO_HIT otherwise */
    uint64_t started_ns;
    uint64_t finished_ns;
    uint32_t tensor_id;
    int32_t err;
    uint32_t path;                /* enum bd_gate_path */
    uint32_t reserved;
};
struct bd_lane {
    struct bd_stream stream;
    struct bd_chan *chan;
    struct bd_kpu_gate *gates;
    uint32_t ngates;
    uint32_t token_bytes;
    uint32_t max_tokens;
    uint32_t limit;               /* most ranges per request it serves (rows, reply and scratch hold this many) */
    uint64_t slot;                /* the channel's staging slot */
    uint64_t slot_bytes;
    uint64_t bounds_ns[BD_LANE_BOUNDS];   /* latency histogram bounds, ascending */
    struct bd_lane_row *rows;     /* limit rows */
    uint8_t *reply;               /* a served reply's frame: room for limit results */
    uint64_t *scratch;            /* 2 * limit words */
    uint32_t nrows;               /* rows of the request bd_lane_run returned 1 for */
    uint32_t lba_bytes;           /* the device's LBA (direct ranges start on one in the slot) */
    uint64_t req_id;
    /* the direct path: NULL target and ring = no direct gate is served on this lane */
    const struct bd_target *target;  /* the channel's device, for its slot's memory */
    struct bd_ring *ring;         /* the channel's ring (used under the channel lock, like Python's) */
    struct bd_xfer *xfers;        /* limit transfers: range i's is xfers[i] */
    struct bd_xfer **done;        /* limit: completions handed back by bd_progress */
};
/* Serve requests until one needs Python.  Returns 0: a frame the lane does not
 * serve is in stream (fmt/at/len), untouched; 1: a request was run but some
 * of its ranges failed: rows/nrows/req_id hold the outcome and Python sends
 * the reply; negative: as bd_stream_read, a failed send or a failed ring
 * (-errno: the connection ends). */
int bd_lane_run(struct bd_lane *l);
/* The lane's request checks alone (what bd_lane_run applies to each frame before it takes the channel lock):
 * the number of ranges of the request body if the lane may take it, 0 if it goes to Python.  The checks are
 * the Python rulebook's (decode_io_request, then bladed.server.sessions.rules.check_ranges) as a pre-filter:
 * they pass exactly what it accepts (tests/test_lane_rules.py). */
int bd_lane_check(struct bd_lane *l, const uint8_t *body, uint32_t size);
/* CDEF-END */

#endif
