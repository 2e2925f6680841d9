/*
 * bladed_uring.c - submit/reap engine and syscall shims for bladed.
 *
 * Built against the system liburing (2.3 on Debian 12).  liburing 2.3 has no
 * io_uring_prep_uring_cmd / io_uring_prep_cmd_discard, so the NVMe
 * passthrough and block-discard SQEs are filled by hand here.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/falloc.h>
#include <linux/nvme_ioctl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "bladed_uring.h"

#ifndef BLOCK_URING_CMD_DISCARD
#define BLOCK_URING_CMD_DISCARD _IO(0x12, 0)   /* kernel 6.12+ */
#endif
#ifndef IORING_URING_CMD_FIXED
#define IORING_URING_CMD_FIXED (1U << 0)
#endif
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif

#define NVME_CMD_WRITE 0x01
#define NVME_CMD_READ 0x02
#define NVME_CMD_WRITE_ZEROES 0x08
#define NVME_CMD_DSM 0x09
#define NVME_DSM_ATTR_DEALLOCATE (1U << 2)
#define DSM_MAX_NLB 0xffffffffu            /* a DSM range's NLB is 32 bits, 1-based */
#define HUGE_2M (2u << 20)
#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << MAP_HUGE_SHIFT)   /* log2(2 MiB) in the size field (linux/mman.h) */
#endif

struct bd_dsm_range {                       /* NVMe DSM range: nlb is 1-based */
    uint32_t cattr;
    uint32_t nlb;
    uint64_t slba;
};

struct bd_slot {                            /* one in-flight command */
    struct bd_xfer *x;
    uint64_t slba;
    uint64_t len;                           /* payload bytes expected */
    uint64_t off;                           /* Eq. 11: byte offset into x->buf */
    uint32_t nlb;                           /* 0-based blocks (Eq. 10) */
    struct bd_dsm_range dsm;
    int next_free;
    int next_job;                           /* portable engine: work or done list link */
    int res;                                /* portable engine: what a CQE's res would say */
};

/* The portable engine: the same slots, run by a small pool of threads with
 * positional syscalls and ioctls instead of SQEs (no io_uring: seccomp,
 * io_uring_disabled, gVisor, kernels without io_uring_cmd). */
struct bd_pool {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    int work_head, work_tail;               /* slots to run, FIFO */
    int done_head, done_tail;               /* slots run, FIFO */
    unsigned nthreads, idle, max_threads;
    int stopping;
    int no_io64;                            /* NVME_IOCTL_IO64_CMD refused: use NVME_IOCTL_IO_CMD */
    pthread_t threads[BD_PORTABLE_MAX_THREADS];
};

struct bd_ring {
    struct io_uring ring;                   /* BD_ENGINE_URING */
    struct bd_pool *pool;                   /* BD_ENGINE_PORTABLE */
    int engine;
    unsigned depth;
    int big_sqe;
    struct bd_slot *slots;
    int free_head;
    unsigned inflight;
    struct bd_xfer *sub_head, *sub_tail;    /* transfers with chunks left to submit */
    struct bd_xfer *done_head, *done_tail;  /* completed, not yet handed out */
    unsigned outstanding;                   /* queued + in flight + done-not-returned */
    unsigned ndone;                         /* length of the done list */
    uint64_t read_window;                   /* most read bytes in flight at once, 0 = no limit */
    uint64_t read_piece;                    /* largest read command under a window: read_window / 2 */
    uint64_t reads_inflight;                /* read payload bytes in flight */
    struct iovec *bufs;
    unsigned nbufs;
    uint64_t n_submitted, n_completed, max_inflight, n_waits;
};

uint64_t bd_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *pool_worker(void *arg);

static void pool_free(struct bd_pool *p)
{
    unsigned i;

    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (i = 0; i < p->nthreads; i++)
        pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static struct bd_pool *pool_new(unsigned queue_depth)
{
    struct bd_pool *p = calloc(1, sizeof(*p));

    if (!p)
        return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    p->work_head = p->work_tail = p->done_head = p->done_tail = -1;
    /* threads start when work finds none idle, up to one per queue slot */
    p->max_threads = queue_depth < BD_PORTABLE_MAX_THREADS ? queue_depth : BD_PORTABLE_MAX_THREADS;
    return p;
}

struct bd_ring *bd_ring_new(unsigned queue_depth, int big_sqe, int engine, int *err)
{
    struct bd_ring *r;
    struct io_uring_params p;
    unsigned i;
    int ret;

    if (queue_depth == 0 || queue_depth > 4096 || (engine != BD_ENGINE_URING && engine != BD_ENGINE_PORTABLE)) {
        *err = -EINVAL;
        return NULL;
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    r->engine = engine;
    if (engine == BD_ENGINE_URING) {
        memset(&p, 0, sizeof(p));
        if (big_sqe)
            p.flags |= IORING_SETUP_SQE128 | IORING_SETUP_CQE32;
        ret = io_uring_queue_init_params(queue_depth, &r->ring, &p);
        if (ret < 0) {
            free(r);
            *err = ret;
            return NULL;
        }
    } else if (!(r->pool = pool_new(queue_depth))) {
        free(r);
        *err = -ENOMEM;
        return NULL;
    }
    r->depth = queue_depth;
    r->big_sqe = big_sqe;
    r->slots = calloc(queue_depth, sizeof(*r->slots));
    if (!r->slots) {
        bd_ring_free(r);
        *err = -ENOMEM;
        return NULL;
    }
    for (i = 0; i < queue_depth; i++)
        r->slots[i].next_free = (i + 1 < queue_depth) ? (int)(i + 1) : -1;
    r->free_head = 0;
    *err = 0;
    return r;
}

void bd_ring_free(struct bd_ring *r)
{
    if (!r)
        return;
    if (r->engine == BD_ENGINE_URING)
        io_uring_queue_exit(&r->ring);
    else
        pool_free(r->pool);
    free(r->bufs);
    free(r->slots);
    free(r);
}

int bd_ring_engine(struct bd_ring *r) { return r->engine; }

int bd_uring_probe(int opcode)
{
    struct io_uring ring;
    struct io_uring_probe *probe;
    int ret = io_uring_queue_init(1, &ring, 0);

    if (ret < 0)
        return ret;
    probe = io_uring_get_probe_ring(&ring);
    ret = probe ? io_uring_opcode_supported(probe, opcode) != 0 : 0;
    if (probe)
        io_uring_free_probe(probe);
    io_uring_queue_exit(&ring);
    return ret;
}

unsigned bd_ring_depth(struct bd_ring *r) { return r->depth; }

int bd_ring_register_buffers(struct bd_ring *r, void **addrs, uint64_t *lens, unsigned n)
{
    struct iovec *iov;
    unsigned i;
    int ret;

    if (r->engine != BD_ENGINE_URING)
        return -EOPNOTSUPP;   /* threads pass plain addresses: nothing to register */
    if (r->nbufs)
        return -EBUSY;
    iov = calloc(n ? n : 1, sizeof(*iov));
    if (!iov)
        return -ENOMEM;
    for (i = 0; i < n; i++) {
        iov[i].iov_base = addrs[i];
        iov[i].iov_len = lens[i];
    }
    ret = io_uring_register_buffers(&r->ring, iov, n);
    if (ret < 0) {
        free(iov);
        return ret;
    }
    r->bufs = iov;
    r->nbufs = n;
    return 0;
}

int bd_ring_unregister_buffers(struct bd_ring *r)
{
    int ret;

    if (!r->nbufs)
        return 0;
    if (r->inflight)
        return -EBUSY;
    ret = io_uring_unregister_buffers(&r->ring);
    free(r->bufs);
    r->bufs = NULL;
    r->nbufs = 0;
    return ret;
}

int bd_ring_buffer_index(struct bd_ring *r, const void *buf, uint64_t len)
{
    uintptr_t a = (uintptr_t)buf;
    unsigned i;

    for (i = 0; i < r->nbufs; i++) {
        uintptr_t b = (uintptr_t)r->bufs[i].iov_base;
        uint64_t size = r->bufs[i].iov_len;
        if (a >= b && a - b <= size && len <= size - (a - b))   /* no a + len: it could wrap */
            return (int)i;
    }
    return -1;
}

unsigned bd_outstanding(struct bd_ring *r) { return r->outstanding; }

void bd_ring_set_read_window(struct bd_ring *r, uint64_t bytes)
{
    r->read_window = bytes;
    r->read_piece = bytes / 2;
}

uint64_t bd_ring_read_window(struct bd_ring *r) { return r->read_window; }

void bd_ring_stats(struct bd_ring *r, uint64_t *out4)
{
    out4[0] = r->n_submitted;
    out4[1] = r->n_completed;
    out4[2] = r->max_inflight;
    out4[3] = r->n_waits;
}

/* ---------------------------------------------------------- validation -- */

static int is_rw(int op) { return op == BD_OP_READ || op == BD_OP_WRITE; }

/* The target and op alone: enum bd_bad. */
static int target_why(const struct bd_target *t, int op)
{
    if (!t || (t->kind != BD_KIND_FILE && t->kind != BD_KIND_BLOCK && t->kind != BD_KIND_NVME))
        return BD_BAD_TARGET;
    if (op < BD_OP_READ || op > BD_OP_WRITE_ZEROES)
        return BD_BAD_OP;
    /* checked before any shift by lba_shift: shifting by >= 64 is undefined */
    if (t->lba_shift < BD_LBA_SHIFT_MIN || t->lba_shift > BD_LBA_SHIFT_MAX)
        return BD_BAD_LBA_SHIFT;
    if (is_rw(op) && (t->max_chunk_bytes >> t->lba_shift) == 0)
        return BD_BAD_CHUNK;
    return BD_BAD_NONE;
}

/* [slba, slba + nbytes/LBA) on a valid target: enum bd_bad, *err = -errno. */
static int extent_why(const struct bd_target *t, uint64_t slba, uint64_t nbytes, int *err)
{
    uint64_t blocks, limit;

    if (nbytes & ((1ull << t->lba_shift) - 1)) {
        *err = -EINVAL;
        return BD_BAD_LENGTH;
    }
    blocks = nbytes >> t->lba_shift;
    /* NVMe addresses 64-bit LBAs; files and block devices take a byte offset
     * (loff_t, signed 64-bit), so there the end byte must stay below 2^63 */
    limit = t->kind == BD_KIND_NVME ? UINT64_MAX : (uint64_t)INT64_MAX >> t->lba_shift;
    if (blocks > limit || slba > limit - blocks) {
        *err = -EOVERFLOW;
        return BD_BAD_LBA_RANGE;
    }
    return BD_BAD_NONE;
}

static int xfer_why(const struct bd_xfer *x, int *err)
{
    int why = target_why(x->target, x->op);

    *err = -EINVAL;
    if (why)
        return why;
    why = extent_why(x->target, x->slba, x->nbytes, err);
    if (why)
        return why;
    if (is_rw(x->op) && x->nbytes) {
        if (!x->buf)
            return BD_BAD_BUFFER;
        if ((uintptr_t)x->buf > UINTPTR_MAX - x->nbytes) {
            *err = -EOVERFLOW;
            return BD_BAD_BUFFER_RANGE;
        }
    }
    return BD_BAD_NONE;
}

/* ------------------------------------------------ chunk math, Eq. 7-11 -- */

uint64_t bd_chunk_cap(const struct bd_target *t, int op)
{
    uint64_t blocks, rw_max;

    if (target_why(t, op))
        return 0;
    if (is_rw(op)) {
        /* Eq. 7: chunk = align_down(MDTS, LBA), in blocks (n_maxBlocks of Eq. 8) */
        blocks = t->max_chunk_bytes >> t->lba_shift;
        /* a file/block read or write moves at most MAX_RW_COUNT (cqe->res is an int) */
        rw_max = (uint64_t)BD_RW_MAX_BYTES >> t->lba_shift;
        if (t->kind != BD_KIND_NVME && blocks > rw_max)
            blocks = rw_max;
    } else {
        uint32_t limit = op == BD_OP_DISCARD ? t->max_discard_blocks : t->max_zeroes_blocks;
        blocks = limit ? limit : DSM_MAX_NLB;
    }
    /* NVMe Read, Write and Write Zeroes carry a 16-bit 0-based NLB whatever MDTS allows */
    if (t->kind == BD_KIND_NVME && op != BD_OP_DISCARD && blocks > (uint64_t)BD_NVME_MAX_NLB)
        blocks = BD_NVME_MAX_NLB;
    return blocks << t->lba_shift;
}

int bd_chunk_at(const struct bd_target *t, int op, uint64_t slba, uint64_t nbytes, uint64_t off,
                struct bd_chunk *c)
{
    uint64_t chunk, len;
    int err = -EINVAL;

    memset(c, 0, sizeof(*c));
    c->why = target_why(t, op);
    if (!c->why)
        c->why = extent_why(t, slba, nbytes, &err);
    if (c->why)
        return err;
    chunk = bd_chunk_cap(t, op);
    c->count = nbytes / chunk + (nbytes % chunk != 0);        /* Eq. 8, ceil without nbytes + chunk - 1 */
    if ((off & ((1ull << t->lba_shift) - 1)) || off >= nbytes) {
        c->why = BD_BAD_OFFSET;
        return -EINVAL;
    }
    /* chunk N starts at off = (N-1)·chunk: extent_why bounds slba + off/LBA */
    len = nbytes - off < chunk ? nbytes - off : chunk;         /* min(n_maxBlocks, n_remains) */
    c->slba = slba + (off >> t->lba_shift);                    /* Eq. 9 */
    c->nlb = (uint32_t)((len >> t->lba_shift) - 1);            /* Eq. 10, 0-based */
    c->buf_off = off;                                          /* Eq. 11 */
    c->len = len;
    return 0;
}

/* ---------------------------------------------------------------- queue -- */

static void done_push(struct bd_ring *r, struct bd_xfer *x)
{
    x->t_done_ns = bd_monotonic_ns();
    if (!x->t_submit_ns)
        x->t_submit_ns = x->t_done_ns;
    x->next = NULL;
    if (r->done_tail)
        r->done_tail->next = x;
    else
        r->done_head = x;
    r->done_tail = x;
    r->ndone++;
}

static void fail(struct bd_xfer *x, int kind, int value, uint64_t slba)
{
    if (x->err_kind == BD_OK) {
        x->err_kind = kind;
        x->err_value = value;
        x->err_slba = slba;
    }
}

int bd_enqueue(struct bd_ring *r, struct bd_xfer *x)
{
    int err, why;

    if (x->queued)
        return -EBUSY;     /* in flight: its fields belong to the engine */
    why = xfer_why(x, &err);
    x->err_kind = why ? BD_ERR_INVALID : BD_OK;
    x->err_value = why;
    x->err_slba = why ? x->slba : 0;
    x->n_chunks = 0;
    x->t_submit_ns = 0;
    x->t_done_ns = 0;
    x->next_off = 0;
    x->inflight = 0;
    x->next = NULL;
    if (why)
        return err;       /* nothing queued; x says why */
    x->queued = 1;
    r->outstanding++;
    if (x->nbytes == 0) {
        done_push(r, x);
        return 0;
    }
    if (r->sub_tail)
        r->sub_tail->next = x;
    else
        r->sub_head = x;
    r->sub_tail = x;
    return 0;
}

/* The NVMe command of slot s (an I/O command set command), for either engine. */
struct bd_nvme_io {
    uint8_t opcode;
    uint64_t addr;
    uint32_t data_len, cdw10, cdw11, cdw12;
};

static void nvme_command(struct bd_slot *s, struct bd_xfer *x, struct bd_nvme_io *c)
{
    memset(c, 0, sizeof(*c));
    switch (x->op) {
    case BD_OP_READ:
    case BD_OP_WRITE:
        c->opcode = x->op == BD_OP_READ ? NVME_CMD_READ : NVME_CMD_WRITE;
        c->addr = (uint64_t)(uintptr_t)((char *)x->buf + s->off);      /* Eq. 11 */
        c->data_len = (uint32_t)s->len;
        c->cdw10 = (uint32_t)(s->slba & 0xffffffffu);                  /* Eq. 9 */
        c->cdw11 = (uint32_t)(s->slba >> 32);
        c->cdw12 = s->nlb;                              /* Eq. 10, <= 0xffff (bd_chunk_cap) */
        break;
    case BD_OP_WRITE_ZEROES:
        c->opcode = NVME_CMD_WRITE_ZEROES;
        c->cdw10 = (uint32_t)(s->slba & 0xffffffffu);
        c->cdw11 = (uint32_t)(s->slba >> 32);
        c->cdw12 = s->nlb;
        break;
    case BD_OP_DISCARD:
        s->dsm.cattr = 0;
        s->dsm.nlb = s->nlb + 1;                       /* 1-based here, <= 0xffffffff */
        s->dsm.slba = s->slba;
        c->opcode = NVME_CMD_DSM;
        c->addr = (uint64_t)(uintptr_t)&s->dsm;
        c->data_len = sizeof(s->dsm);
        c->cdw10 = 0;                                                   /* one range, 0-based */
        c->cdw11 = NVME_DSM_ATTR_DEALLOCATE;
        break;
    }
}

static void prep_nvme(struct io_uring_sqe *sqe, struct bd_slot *s, struct bd_xfer *x)
{
    const struct bd_target *t = x->target;
    struct nvme_uring_cmd *cmd = (struct nvme_uring_cmd *)sqe->cmd;
    struct bd_nvme_io c;

    nvme_command(s, x, &c);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = t->fd;
    sqe->cmd_op = NVME_URING_CMD_IO;
    cmd->opcode = c.opcode;
    cmd->nsid = t->nsid;
    cmd->timeout_ms = t->timeout_ms;
    cmd->addr = c.addr;
    cmd->data_len = c.data_len;
    cmd->cdw10 = c.cdw10;
    cmd->cdw11 = c.cdw11;
    cmd->cdw12 = c.cdw12;
    if (is_rw(x->op) && x->buf_index >= 0) {
        sqe->uring_cmd_flags = IORING_URING_CMD_FIXED;
        sqe->buf_index = (uint16_t)x->buf_index;
    }
}

static void prep_rw(struct io_uring_sqe *sqe, struct bd_slot *s, struct bd_xfer *x)
{
    const struct bd_target *t = x->target;
    uint64_t dev_off = s->slba << t->lba_shift;
    void *p = (char *)x->buf + s->off;

    switch (x->op) {
    case BD_OP_READ:
        if (x->buf_index >= 0)
            io_uring_prep_read_fixed(sqe, t->fd, p, s->len, dev_off, x->buf_index);
        else
            io_uring_prep_read(sqe, t->fd, p, s->len, dev_off);
        break;
    case BD_OP_WRITE:
        if (x->buf_index >= 0)
            io_uring_prep_write_fixed(sqe, t->fd, p, s->len, dev_off, x->buf_index);
        else
            io_uring_prep_write(sqe, t->fd, p, s->len, dev_off);
        break;
    case BD_OP_WRITE_ZEROES:
        io_uring_prep_fallocate(sqe, t->fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, dev_off, s->len);
        break;
    case BD_OP_DISCARD:
        if (t->kind == BD_KIND_BLOCK) {
            /* io_uring_prep_cmd_discard() of newer liburing, by hand */
            io_uring_prep_rw(IORING_OP_URING_CMD, sqe, t->fd, NULL, 0, 0);
            sqe->cmd_op = BLOCK_URING_CMD_DISCARD;
            sqe->addr = dev_off;
            sqe->addr3 = s->len;
        } else {
            io_uring_prep_fallocate(sqe, t->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, dev_off, s->len);
        }
        break;
    }
}

/* ------------------------------------------------------ portable engine -- */

/* Run slot s synchronously; the result is what the io_uring CQE would carry: bytes moved or 0, a positive NVMe
 * status, or -errno. */
static int run_slot(struct bd_pool *p, struct bd_slot *s)
{
    struct bd_xfer *x = s->x;
    const struct bd_target *t = x->target;
    uint64_t dev_off = s->slba << t->lba_shift;
    struct iovec iov = {(char *)x->buf + s->off, s->len};
    ssize_t n;
    int ret;

    if (t->kind == BD_KIND_NVME) {
        struct bd_nvme_io c;
        /* the two ioctl structs share these fields; only the result's width differs */
#define BD_PASSTHRU(cmd) do {                                                   \
            memset(&(cmd), 0, sizeof(cmd));                                     \
            (cmd).opcode = c.opcode;                                            \
            (cmd).nsid = t->nsid;                                               \
            (cmd).addr = c.addr;                                                \
            (cmd).data_len = c.data_len;                                        \
            (cmd).cdw10 = c.cdw10;                                              \
            (cmd).cdw11 = c.cdw11;                                              \
            (cmd).cdw12 = c.cdw12;                                              \
            (cmd).timeout_ms = t->timeout_ms;                                   \
        } while (0)
        nvme_command(s, x, &c);
        if (!__atomic_load_n(&p->no_io64, __ATOMIC_RELAXED)) {
            struct nvme_passthru_cmd64 cmd64;
            BD_PASSTHRU(cmd64);
            ret = ioctl(t->fd, NVME_IOCTL_IO64_CMD, &cmd64);
            if (ret >= 0 || errno != ENOTTY)
                return ret < 0 ? -errno : ret;
            __atomic_store_n(&p->no_io64, 1, __ATOMIC_RELAXED);     /* a kernel before the 64-bit result */
        }
        struct nvme_passthru_cmd cmd;
        BD_PASSTHRU(cmd);
#undef BD_PASSTHRU
        ret = ioctl(t->fd, NVME_IOCTL_IO_CMD, &cmd);
        return ret < 0 ? -errno : ret;
    }
    switch (x->op) {
    case BD_OP_READ:
    case BD_OP_WRITE:
        do
            n = x->op == BD_OP_READ ? preadv2(t->fd, &iov, 1, (off_t)dev_off, 0)
                                    : pwritev2(t->fd, &iov, 1, (off_t)dev_off, 0);
        while (n < 0 && errno == EINTR);
        return n < 0 ? -errno : (int)n;   /* s->len <= BD_RW_MAX_BYTES fits an int */
    case BD_OP_WRITE_ZEROES:
        return bd_fallocate(t->fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, dev_off, s->len);
    case BD_OP_DISCARD:
        return t->kind == BD_KIND_BLOCK ? bd_blkdiscard(t->fd, dev_off, s->len)
                                        : bd_fallocate(t->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                                       dev_off, s->len);
    }
    return -EINVAL;
}

static void *pool_worker(void *arg)
{
    struct bd_ring *r = arg;
    struct bd_pool *p = r->pool;

    pthread_mutex_lock(&p->mu);
    for (;;) {
        int idx;
        struct bd_slot *s;

        while (p->work_head < 0 && !p->stopping) {
            p->idle++;
            pthread_cond_wait(&p->work_cv, &p->mu);
            p->idle--;
        }
        if (p->work_head < 0)
            break;                                  /* stopping, and nothing left */
        idx = p->work_head;
        s = &r->slots[idx];
        p->work_head = s->next_job;
        if (p->work_head < 0)
            p->work_tail = -1;
        pthread_mutex_unlock(&p->mu);
        s->res = run_slot(p, s);
        pthread_mutex_lock(&p->mu);
        s->next_job = -1;
        if (p->done_tail >= 0)
            r->slots[p->done_tail].next_job = idx;
        else
            p->done_head = idx;
        p->done_tail = idx;
        pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* Hand the slots on list [head..tail] (linked by next_job) to the pool; start a thread when none is idle. */
static int pool_submit(struct bd_ring *r, int head, int tail, unsigned n)
{
    struct bd_pool *p = r->pool;
    int ret = 0;

    pthread_mutex_lock(&p->mu);
    if (p->work_tail >= 0)
        r->slots[p->work_tail].next_job = head;
    else
        p->work_head = head;
    p->work_tail = tail;
    while (p->idle < n && p->nthreads < p->max_threads) {
        ret = pthread_create(&p->threads[p->nthreads], NULL, pool_worker, r);
        if (ret) {
            ret = p->nthreads ? 0 : -ret;          /* the threads there will do the work */
            break;
        }
        p->nthreads++;
        n--;
    }
    if (n > 1)
        pthread_cond_broadcast(&p->work_cv);
    else
        pthread_cond_signal(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    return ret;
}

/* Fill free slots from the submit list: SQEs on io_uring, jobs for the pool on the portable engine.  Returns the
 * number of commands prepared (io_uring: not yet submitted), or -errno if the pool cannot start a thread. */
static int fill(struct bd_ring *r)
{
    unsigned n = 0;
    int jobs_head = -1, jobs_tail = -1;

    while (r->sub_head && r->free_head >= 0) {
        struct bd_xfer *x = r->sub_head;
        struct io_uring_sqe *sqe = NULL;
        struct bd_slot *s;
        struct bd_chunk c;
        int idx, ret;

        if (x->err_kind != BD_OK || x->next_off >= x->nbytes) {
            /* nothing more to submit for x: it completes when its chunks drain */
            r->sub_head = x->next;
            if (!r->sub_head)
                r->sub_tail = NULL;
            x->next = NULL;
            if (x->inflight == 0)
                done_push(r, x);
            continue;
        }
        /* block discard through the ioctl is synchronous: on io_uring, do it here (the portable engine's
         * threads run it like any other command) */
        if (r->engine == BD_ENGINE_URING && x->op == BD_OP_DISCARD && x->target->kind == BD_KIND_BLOCK &&
            x->target->discard_mode == BD_DISCARD_IOCTL) {
            uint64_t off = (x->slba << x->target->lba_shift) + x->next_off;
            if (!x->t_submit_ns)
                x->t_submit_ns = bd_monotonic_ns();
            ret = bd_blkdiscard(x->target->fd, off, x->nbytes - x->next_off);
            x->n_chunks++;
            if (ret < 0)
                fail(x, BD_ERR_ERRNO, -ret, x->slba);
            x->next_off = x->nbytes;
            continue;
        }
        /* Eq. 8-11: the command that starts at next_off (validated at enqueue;
         * checked again because the target is caller memory) */
        ret = bd_chunk_at(x->target, x->op, x->slba, x->nbytes, x->next_off, &c);
        if (ret < 0) {
            fail(x, BD_ERR_ERRNO, -ret, x->slba);
            continue;
        }
        if (x->op == BD_OP_READ && r->read_window) {
            /* A device serves its queue in order, so a small write submitted
             * now (on any ring of the device) waits behind every read command
             * already queued.  Under a read window a read moves in pieces of
             * at most half the window, and at most the window is in flight:
             * the device always has the next piece queued, and a write never
             * finds more than the window of reads ahead of it. */
            uint64_t lba = 1ull << x->target->lba_shift;
            uint64_t piece = r->read_piece & ~(lba - 1);
            if (piece < lba)
                piece = lba;
            if (c.len > piece) {
                c.len = piece;
                c.nlb = (uint32_t)((piece >> x->target->lba_shift) - 1);
            }
            if (r->reads_inflight && r->reads_inflight + c.len > r->read_window)
                break;
        }
        if (r->engine == BD_ENGINE_URING) {
            sqe = io_uring_get_sqe(&r->ring);
            if (!sqe)
                break;
            memset(sqe, 0, r->big_sqe ? 128 : 64);     /* every byte of a 128-byte SQE */
        }
        idx = r->free_head;
        s = &r->slots[idx];
        r->free_head = s->next_free;
        s->x = x;
        s->len = c.len;
        s->slba = c.slba;
        s->nlb = c.nlb;
        s->off = x->next_off;
        if (sqe) {
            if (x->target->kind == BD_KIND_NVME)
                prep_nvme(sqe, s, x);
            else
                prep_rw(sqe, s, x);
            io_uring_sqe_set_data64(sqe, (uint64_t)idx);
        } else {
            s->next_job = -1;
            if (jobs_tail >= 0)
                r->slots[jobs_tail].next_job = idx;
            else
                jobs_head = idx;
            jobs_tail = idx;
        }
        if (!x->t_submit_ns)
            x->t_submit_ns = bd_monotonic_ns();
        x->next_off += c.len;
        if (x->op == BD_OP_READ)
            r->reads_inflight += c.len;
        x->inflight++;
        x->n_chunks++;
        r->inflight++;
        r->n_submitted++;
        if (r->inflight > r->max_inflight)
            r->max_inflight = r->inflight;
        n++;
    }
    if (jobs_head >= 0) {
        int ret = pool_submit(r, jobs_head, jobs_tail, n);
        if (ret < 0)
            return ret;
    }
    return (int)n;
}

/* Slot idx finished with res (a CQE's res: bytes or 0, > 0 NVMe status, -errno). */
static void complete(struct bd_ring *r, int idx, int res)
{
    struct bd_slot *s = &r->slots[idx];
    struct bd_xfer *x = s->x;

    if (x->target->kind == BD_KIND_NVME) {
        /* res == 0 success, > 0 NVMe status, < 0 -errno */
        if (res > 0)
            fail(x, BD_ERR_NVME, res, s->slba);
        else if (res < 0)
            fail(x, BD_ERR_ERRNO, -res, s->slba);
    } else if (res < 0) {
        fail(x, BD_ERR_ERRNO, -res, s->slba);
    } else if ((x->op == BD_OP_READ || x->op == BD_OP_WRITE) && (uint64_t)res != s->len) {
        fail(x, BD_ERR_SHORT, res, s->slba);
    }
    if (x->op == BD_OP_READ)
        r->reads_inflight -= s->len;
    s->x = NULL;
    s->next_free = r->free_head;
    r->free_head = idx;
    r->inflight--;
    r->n_completed++;
    x->inflight--;
    if (x->inflight == 0 && (x->err_kind != BD_OK || x->next_off >= x->nbytes)) {
        /* Only the head of the submit list can have commands in flight: fill()
         * takes a transfer off the list once it has nothing more to submit, and
         * never starts the next one before that.  So x is either still the head
         * (failed, or its last chunk went out when the queue filled) or already
         * off the list. */
        if (r->sub_head == x) {
            r->sub_head = x->next;
            if (!r->sub_head)
                r->sub_tail = NULL;
            x->next = NULL;
        }
        done_push(r, x);
    }
}

/* Complete what has finished; with wait, first block until something has. */
static unsigned reap(struct bd_ring *r, int wait)
{
    unsigned n = 0;

    if (r->engine == BD_ENGINE_URING) {
        struct io_uring_cqe *cqe;
        unsigned head;

        io_uring_for_each_cqe(&r->ring, head, cqe) {
            complete(r, (int)io_uring_cqe_get_data64(cqe), cqe->res);
            n++;
        }
        io_uring_cq_advance(&r->ring, n);
    } else {
        struct bd_pool *p = r->pool;
        int idx;

        pthread_mutex_lock(&p->mu);
        while (wait && p->done_head < 0)
            pthread_cond_wait(&p->done_cv, &p->mu);
        idx = p->done_head;                         /* take the whole list, complete it unlocked */
        p->done_head = p->done_tail = -1;
        pthread_mutex_unlock(&p->mu);
        while (idx >= 0) {
            int next = r->slots[idx].next_job;
            complete(r, idx, r->slots[idx].res);
            idx = next;
            n++;
        }
    }
    return n;
}

int bd_progress(struct bd_ring *r, unsigned min_done, struct bd_xfer **done, unsigned max_done)
{
    unsigned out = 0;

    if (min_done > max_done)
        min_done = max_done;
    for (;;) {
        int prepared = fill(r);
        int ret;

        if (prepared < 0)
            return prepared;
        if (r->ndone >= min_done || (r->inflight == 0 && !r->sub_head)) {
            if (prepared && r->engine == BD_ENGINE_URING) {
                ret = io_uring_submit(&r->ring);
                if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY)
                    return ret;
            }
            break;
        }
        if (r->inflight == 0)
            continue;   /* everything left was synchronous or already finished */
        r->n_waits++;
        if (r->engine == BD_ENGINE_URING) {
            ret = io_uring_submit_and_wait(&r->ring, 1);
            if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME)
                return ret;
            reap(r, 0);
        } else {
            reap(r, 1);
        }
    }
    reap(r, 0);
    while (out < max_done && r->done_head) {
        struct bd_xfer *x = r->done_head;
        r->done_head = x->next;
        if (!r->done_head)
            r->done_tail = NULL;
        x->next = NULL;
        x->queued = 0;
        r->ndone--;
        r->outstanding--;
        done[out++] = x;
    }
    return (int)out;
}

int bd_run(struct bd_ring *r, struct bd_xfer *xfers, unsigned n)
{
    struct bd_xfer *done[64];
    unsigned i, left = n;
    int ret;

    for (i = 0; i < n; i++) {
        ret = bd_enqueue(r, &xfers[i]);
        if (ret < 0)
            return ret;
    }
    while (left) {
        ret = bd_progress(r, 1, done, 64);
        if (ret < 0)
            return ret;
        if (ret == 0)
            return -EIO;   /* cannot happen: outstanding transfers always complete */
        left -= (unsigned)ret;
    }
    return 0;
}

/* ------------------------------------------------------- syscalls, ioctls -- */

int bd_nvme_ns_id(int fd)
{
    int ret = ioctl(fd, NVME_IOCTL_ID);
    return ret < 0 ? -errno : ret;
}

int bd_nvme_identify(int fd, uint32_t nsid, uint32_t cns, void *buf4096)
{
    struct nvme_admin_cmd cmd;
    int ret;

    memset(&cmd, 0, sizeof(cmd));
    cmd.opcode = 0x06;
    cmd.nsid = nsid;
    cmd.addr = (uint64_t)(uintptr_t)buf4096;
    cmd.data_len = 4096;
    cmd.cdw10 = cns;
    ret = ioctl(fd, NVME_IOCTL_ADMIN_CMD, &cmd);
    if (ret < 0)
        return -errno;
    return ret;   /* > 0: the NVMe status of a refused command */
}

int bd_block_geometry(int fd, uint64_t *size_bytes, uint32_t *logical_block)
{
    int lbs = 0;

    if (ioctl(fd, BLKGETSIZE64, size_bytes) < 0)
        return -errno;
    if (ioctl(fd, BLKSSZGET, &lbs) < 0)
        return -errno;
    *logical_block = (uint32_t)lbs;
    return 0;
}

int bd_blkdiscard(int fd, uint64_t off, uint64_t len)
{
    uint64_t range[2] = {off, len};
    return ioctl(fd, BLKDISCARD, range) < 0 ? -errno : 0;
}

int bd_fallocate(int fd, int mode, uint64_t off, uint64_t len)
{
    return fallocate(fd, mode, (off_t)off, (off_t)len) < 0 ? -errno : 0;
}

int bd_cachestat(int fd, uint64_t off, uint64_t len, uint64_t *out5)
{
    /* struct cachestat_range { u64 off, len }; struct cachestat { u64 x5 } */
    uint64_t range[2] = {off, len};
    long ret = syscall(__NR_cachestat, fd, range, out5, 0);
    return ret < 0 ? -errno : 0;
}

int64_t bd_pwrite_full(int fd, uint64_t addr, uint64_t len, uint64_t off)
{
    /* the page-cache path's write: one call per range, short writes resumed here, not in Python; pieces of at
     * most BD_PAGECACHE_WRITE_CHUNK, each ending on a multiple of it, so new folios stay small (why: the enum) */
    uint64_t done = 0;
    while (done < len) {
        uint64_t piece = BD_PAGECACHE_WRITE_CHUNK - (off + done) % BD_PAGECACHE_WRITE_CHUNK;
        if (piece > len - done)
            piece = len - done;
        ssize_t n = pwrite(fd, (const char *)(uintptr_t)addr + done, piece, (off_t)(off + done));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0)
            return -EIO;
        done += (uint64_t)n;
    }
    return (int64_t)done;
}

int bd_sync_file_range(int fd, uint64_t off, uint64_t len, unsigned flags)
{
    return sync_file_range(fd, (off64_t)off, (off64_t)len, flags) < 0 ? -errno : 0;
}

void *bd_staging_alloc(uint64_t len, int *how)
{
    void *p;
    size_t span;
    uintptr_t a, aligned;

    *how = 0;
    if (len == 0 || len > SIZE_MAX - HUGE_2M)   /* len + HUGE_2M below must not wrap */
        return NULL;
    if (len % HUGE_2M == 0) {
        /* 2 MiB pages by name: the default huge page is 32 MiB / 512 MiB on 16 / 64 KiB-page arm64 kernels,
         * and a mapping of those could neither be freed by munmap(p, len) nor be what HUGE_2M means */
        p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_HUGE_2MB, -1, 0);
        if (p != MAP_FAILED) {
            *how = 2;
            return p;
        }
    }
    if (len < HUGE_2M) {
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    /* over-map, trim to a 2 MiB boundary, ask for transparent huge pages */
    span = len + HUGE_2M;
    p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    a = (uintptr_t)p;
    aligned = (a + HUGE_2M - 1) & ~((uintptr_t)HUGE_2M - 1);
    if (aligned > a)
        munmap(p, aligned - a);
    if (a + span > aligned + len)
        munmap((void *)(aligned + len), a + span - (aligned + len));
    if (madvise((void *)aligned, len, MADV_HUGEPAGE) == 0)
        *how = 1;
    return (void *)aligned;
}

void bd_staging_free(void *p, uint64_t len)
{
    if (p)
        munmap(p, len);
}
