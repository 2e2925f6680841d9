/*
 * bladed_uring.h - the C surface of bladed's I/O engine.
 *
 * Only what must be C lives here: SQE preparation (including the NVMe
 * passthrough command that liburing 2.3 has no helper for), the submit/reap
 * loop that keeps the queue full across chunks and across consecutive
 * transfers, the chunk math it runs on (Eq. 7-11, the one implementation),
 * and the few syscalls/ioctls that Python cannot reach cleanly.  The entry
 * points refuse shifts, sizes and ranges that would overflow or wrap; policy
 * and error text are Python.
 *
 * This file is read twice: by the C compiler, and (between the CDEF markers)
 * by cffi as the declarations of the extension module.
 */
#ifndef BLADED_URING_H
#define BLADED_URING_H
#include <stdint.h>

/* CDEF-BEGIN */
enum bd_op {
    BD_OP_READ = 0,
    BD_OP_WRITE = 1,
    BD_OP_DISCARD = 2,        /* NVMe DSM deallocate / block discard / punch hole */
    BD_OP_WRITE_ZEROES = 3    /* NVMe Write Zeroes / fallocate ZERO_RANGE */
};

enum bd_kind {
    BD_KIND_FILE = 0,         /* regular file, O_DIRECT */
    BD_KIND_BLOCK = 1,        /* block device, O_DIRECT */
    BD_KIND_NVME = 2          /* NVMe generic char device, io_uring_cmd */
};

enum bd_err_kind {
    BD_OK = 0,
    BD_ERR_ERRNO = 1,         /* err_value = positive errno */
    BD_ERR_NVME = 2,          /* err_value = NVMe status (sct << 8 | sc, + CRD/M/DNR bits) */
    BD_ERR_SHORT = 3,         /* err_value = bytes actually transferred by the chunk */
    BD_ERR_INVALID = 4        /* refused by bd_enqueue: err_value = enum bd_bad */
};

/* Why a transfer or a chunk query was refused (nothing was submitted).  The
 * errno that goes with it is EOVERFLOW for BD_BAD_LBA_RANGE and
 * BD_BAD_BUFFER_RANGE, EINVAL for the others. */
enum bd_bad {
    BD_BAD_NONE = 0,
    BD_BAD_TARGET = 1,        /* NULL target or unknown kind */
    BD_BAD_OP = 2,            /* unknown op */
    BD_BAD_LBA_SHIFT = 3,     /* lba_shift outside BD_LBA_SHIFT_MIN..BD_LBA_SHIFT_MAX */
    BD_BAD_CHUNK = 4,         /* read/write: max_chunk_bytes below one LBA */
    BD_BAD_LENGTH = 5,        /* nbytes not a multiple of the LBA */
    BD_BAD_LBA_RANGE = 6,     /* the LBA range (or its byte offsets) does not fit 64 bits: EOVERFLOW */
    BD_BAD_BUFFER = 7,        /* read/write: NULL buffer */
    BD_BAD_BUFFER_RANGE = 8,  /* read/write: buffer + nbytes wraps the address space */
    BD_BAD_OFFSET = 9         /* bd_chunk_at: off not an LBA multiple or not below nbytes */
};

enum {
    BD_LBA_SHIFT_MIN = 9,     /* 512-byte LBAs */
    BD_LBA_SHIFT_MAX = 16,    /* 64 KiB LBAs */
    BD_NVME_MAX_NLB = 65536,  /* NVMe CDW12 NLB: 16 bits, 0-based (Read, Write, Write Zeroes) */
    BD_RW_MAX_BYTES = 0x7ffff000,  /* Linux MAX_RW_COUNT: most bytes one read/write moves */
    /* the page-cache path writes at most this much per pwrite: the kernel sizes a new page-cache folio by the
     * bytes left in the call (2 MiB for a KPU written whole, 64 KiB here), and in a VM whose free memory is
     * reported to the host, first touching fresh large folios costs 1.4x what small ones do
     * (docs/benchmarks.md, "The page-cache path at the page cache's speed") */
    BD_PAGECACHE_WRITE_CHUNK = 65536
};

/* Which engine drives a ring: io_uring (SQEs, io_uring_cmd passthrough), or the portable one (a small pool of
 * threads doing preadv2/pwritev2, fallocate, ioctl(BLKDISCARD) and NVMe passthrough ioctls), for boxes where
 * io_uring_setup is refused (seccomp, kernel.io_uring_disabled, gVisor) or io_uring_cmd is missing (< 5.19). */
enum bd_engine {
    BD_ENGINE_URING = 0,
    BD_ENGINE_PORTABLE = 1,
    BD_PORTABLE_MAX_THREADS = 8   /* threads of one portable ring: commands in flight at once */
};

enum bd_discard_mode {
    BD_DISCARD_URING_CMD = 0, /* BLOCK_URING_CMD_DISCARD (kernel 6.12+) */
    BD_DISCARD_IOCTL = 1      /* BLKDISCARD, synchronous, from the reaping thread */
};

struct bd_target {
    int fd;
    int kind;                     /* enum bd_kind */
    uint32_t nsid;                /* NVMe namespace id */
    uint32_t lba_shift;           /* log2(LBA size) */
    uint32_t max_chunk_bytes;     /* Eq. 7: per-command payload, LBA multiple */
    uint32_t max_discard_blocks;  /* per discard command (NVMe: DMRSL), 0 = no limit */
    uint32_t max_zeroes_blocks;   /* per write-zeroes command, 0 = no limit */
    uint32_t timeout_ms;          /* NVMe command timeout, 0 = driver default */
    int discard_mode;             /* enum bd_discard_mode (block only) */
};

struct bd_xfer {
    /* request, set by the caller */
    const struct bd_target *target;
    int op;                       /* enum bd_op */
    int buf_index;                /* registered buffer index, -1 = unregistered */
    uint64_t slba;                /* first LBA */
    uint64_t nbytes;              /* payload, a multiple of the LBA size */
    void *buf;                    /* host buffer (unused for discard/zeroes) */
    uint64_t tag;                 /* opaque to the engine */
    /* results, set by the engine */
    int err_kind;                 /* enum bd_err_kind; first failure wins */
    int err_value;
    uint64_t err_slba;            /* first LBA of the failing chunk */
    uint64_t n_chunks;            /* commands issued */
    uint64_t t_submit_ns;         /* CLOCK_MONOTONIC at the first submission */
    uint64_t t_done_ns;           /* CLOCK_MONOTONIC at the last completion */
    /* engine-private */
    uint64_t next_off;
    uint32_t inflight;
    int queued;
    struct bd_xfer *next;
};

struct bd_ring;

/* Ring lifecycle.  engine: enum bd_engine.  big_sqe != 0 sets SQE128|CQE32 (io_uring, needed for NVMe).  A
 * portable ring has no registered buffers (bd_ring_register_buffers: -EOPNOTSUPP) and starts its threads as
 * work needs them, at most min(queue_depth, BD_PORTABLE_MAX_THREADS). */
struct bd_ring *bd_ring_new(unsigned queue_depth, int big_sqe, int engine, int *err);
void bd_ring_free(struct bd_ring *r);
int bd_ring_engine(struct bd_ring *r);
/* Does io_uring support this IORING_OP_* opcode here?  1 yes, 0 no, -errno: io_uring_setup itself failed. */
int bd_uring_probe(int opcode);
unsigned bd_ring_depth(struct bd_ring *r);
int bd_ring_register_buffers(struct bd_ring *r, void **addrs, uint64_t *lens, unsigned n);
int bd_ring_unregister_buffers(struct bd_ring *r);
/* index of the registered buffer that holds [buf, buf+len), or -1 */
int bd_ring_buffer_index(struct bd_ring *r, const void *buf, uint64_t len);

/* Streaming interface: queue transfers, then drive the ring.  bd_progress
 * keeps up to queue_depth commands in flight (reads within the read window,
 * below), moving straight from one transfer's last chunk to the next
 * transfer's first, and returns when at
 * least min_done transfers have completed (fewer only if nothing is left).
 * Completed transfers are written to done[] (at most max_done; the rest stay
 * for the next call).  Returns the count, or -errno if the ring failed.
 * bd_enqueue validates x first and refuses it with -EINVAL or -EOVERFLOW,
 * err_kind = BD_ERR_INVALID and err_value = enum bd_bad (-EBUSY, x untouched,
 * if x is already queued). */
int bd_enqueue(struct bd_ring *r, struct bd_xfer *x);
int bd_progress(struct bd_ring *r, unsigned min_done, struct bd_xfer **done, unsigned max_done);
unsigned bd_outstanding(struct bd_ring *r);
/* The read window: at most `bytes` of read commands in flight on this ring
 * at once (one command always may go), each read command at most bytes / 2
 * rounded down to an LBA (at least one LBA), so that a write submitted on
 * the same device never queues behind more than `bytes` of this ring's
 * reads, while the next piece is always queued.  A windowed read then takes
 * more commands than Eq. 8 counts.  0 (the default) = no limit: commands of
 * Eq. 7 size, up to the queue depth. */
void bd_ring_set_read_window(struct bd_ring *r, uint64_t bytes);
uint64_t bd_ring_read_window(struct bd_ring *r);
/* Counters since the ring was made: out[0] commands submitted, out[1]
 * commands completed, out[2] highest number in flight at once, out[3]
 * io_uring_enter calls that waited. */
void bd_ring_stats(struct bd_ring *r, uint64_t *out4);
/* Convenience: enqueue n transfers and run them all to completion. */
int bd_run(struct bd_ring *r, struct bd_xfer *xfers, unsigned n);

/* The chunk math (paper Eq. 7-11): the engine sizes every command with
 * bd_chunk_at, and bladed.io.chunking wraps the same two functions.
 * bd_chunk_cap: Eq. 7, the most bytes one command of op may carry on t
 * (align_down(max_chunk_bytes, LBA) for read/write, the discard/zeroes limits
 * otherwise; NVMe NLB and MAX_RW_COUNT clamps applied); 0 if t or op is invalid.
 * bd_chunk_at: Eq. 8-11 for the command that starts at byte off of the
 * transfer (slba, nbytes), and the count; returns 0, or -EINVAL / -EOVERFLOW
 * with c->why set (c->count is set as soon as the target and extent are valid). */
struct bd_chunk {
    uint64_t count;               /* Eq. 8: n_chunks of the whole transfer */
    uint64_t slba;                /* Eq. 9: first LBA of this command */
    uint32_t nlb;                 /* Eq. 10: 0-based block count (NVMe CDW12) */
    uint64_t buf_off;             /* Eq. 11: dbuf - buf */
    uint64_t len;                 /* payload bytes of this command */
    int why;                      /* enum bd_bad when refused */
};
uint64_t bd_chunk_cap(const struct bd_target *t, int op);
int bd_chunk_at(const struct bd_target *t, int op, uint64_t slba, uint64_t nbytes, uint64_t off,
                struct bd_chunk *c);

/* Syscalls and ioctls.  All return 0 or -errno. */
int bd_nvme_ns_id(int fd);                              /* >0 nsid */
int bd_nvme_identify(int fd, uint32_t nsid, uint32_t cns, void *buf4096);  /* >0: NVMe status */
int bd_block_geometry(int fd, uint64_t *size_bytes, uint32_t *logical_block);
int bd_blkdiscard(int fd, uint64_t off, uint64_t len);
int bd_fallocate(int fd, int mode, uint64_t off, uint64_t len);
int bd_cachestat(int fd, uint64_t off, uint64_t len, uint64_t *out5);
int bd_sync_file_range(int fd, uint64_t off, uint64_t len, unsigned flags);
/* bytes, or -errno: len from addr at file offset off, BD_PAGECACHE_WRITE_CHUNK bytes per pwrite */
int64_t bd_pwrite_full(int fd, uint64_t addr, uint64_t len, uint64_t off);

/* Staging memory: page aligned, 2 MiB aligned and huge-page backed where the
 * size allows.  *how: 2 = hugetlbfs, 1 = THP advised, 0 = plain pages. */
void *bd_staging_alloc(uint64_t len, int *how);
void bd_staging_free(void *p, uint64_t len);
uint64_t bd_monotonic_ns(void);
/* CDEF-END */

#endif
