/*
 * bladed_lane.h - the request loop of a data connection, in C at both ends.
 *
 * Measured in Python, one one-token page-cache round trip cost 4.4x a framed
 * ping-pong between two processes: each Python step of framing, checking,
 * counting and replying costs microseconds on an edge CPU (docs/benchmarks.md,
 * "The page-cache lane").  So the mechanics live here and the policy stays in
 * Python:
 *
 *   - bd_stream: frame reads (one recv per frame when the peer sent it whole),
 *     used by the daemon's data connections and by the client's DataChannel;
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

/* CDEF-BEGIN */
enum bd_stream_status {       /* bd_stream_read / bd_lane_run: -errno, or minus one of these */
    BD_STREAM_CLOSED = 1000,      /* the peer closed at a frame boundary */
    BD_STREAM_TRUNCATED = 1001,   /* closed in the middle of a frame; detail = bytes of it received */
    BD_STREAM_BAD_MAGIC = 1002,   /* detail = the two bytes, little-endian */
    BD_STREAM_BAD_FORMAT = 1003,  /* detail = the format byte */
    BD_STREAM_TOO_LARGE = 1004,   /* detail = the body length announced */
    BD_STREAM_TIMEOUT = 1005      /* nothing arrived within timeout_ms */
};

/* Frames on one socket.  The caller provides buf (cap bytes, at least the
 * frame header + max_bytes) and zeroes start/end; bytes beyond the frame just
 * read (a pipelined request) stay for the next read. */
struct bd_stream {
    int fd;
    uint32_t max_bytes;
    uint8_t *buf;
    uint32_t cap;
    uint32_t start;               /* first byte not yet handed out */
    uint32_t end;                 /* one past the last byte received */
    uint32_t fmt;                 /* the last frame read: format, */
    uint32_t at;                  /* its body's offset in buf, */
    uint32_t len;                 /* its body's length */
    uint64_t detail;              /* what was wrong (enum bd_stream_status) */
};
/* The next frame into s->fmt/at/len.  timeout_ms < 0: wait as long as it takes
 * (a socket with a timeout is non-blocking underneath: then poll).  0 or minus
 * errno / enum bd_stream_status. */
int bd_stream_read(struct bd_stream *s, int timeout_ms);
int bd_send_all(int fd, const void *buf, uint64_t len);          /* 0 or -errno */

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
    uint64_t buckets[2][2][19];   /* latency histogram: BD_LANE_BOUNDS bounds + overflow */
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

#define BD_LANE_BOUNDS 18
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
    uint64_t bounds_ns[18];       /* latency histogram bounds (bladed.server.metrics.LATENCY_BUCKETS) */
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
/* CDEF-END */

#endif
