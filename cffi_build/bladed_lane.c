/*
 * bladed_lane.c - channel locks, KPU gates and the lane.
 *
 * The wire layouts and codes are bladed.protocol's, generated at build time as
 * the packed structs of bladed_wire_layout.h (struct bd_io_request, bd_io_range,
 * bd_io_reply, bd_io_result); the frames come through bladed_wire.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "bladed_lane.h"
#include "bladed_uring.h"

/* The kernel's page size (4, 16 or 64 KiB on arm64): cachestat and mincore count in its pages. */
static uint64_t kernel_page(void)
{
    static uint64_t page;
    uint64_t p = __atomic_load_n(&page, __ATOMIC_RELAXED);
    if (p == 0) {
        long v = sysconf(_SC_PAGESIZE);
        p = v > 0 ? (uint64_t)v : 4096u;
        __atomic_store_n(&page, p, __ATOMIC_RELAXED);
    }
    return p;
}

_Static_assert(sizeof(((struct bd_lane_counters *)0)->buckets[0][0]) / sizeof(uint64_t) == BD_LANE_BOUNDS + 1,
               "one bucket per bound and one past the last");

/* range i of a request body (the structs are packed: any address will do) */
static const struct bd_io_range *range_at(const uint8_t *body, uint32_t i)
{
    return (const struct bd_io_range *)(body + sizeof(struct bd_io_request)) + i;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* -- channels ------------------------------------------------------------------------------- */
struct bd_chan {
    pthread_mutex_t mu;
    struct bd_lane_counters counters;
};

struct bd_chan *bd_chan_new(void)
{
    struct bd_chan *c = calloc(1, sizeof(*c));
    if (c != NULL)
        pthread_mutex_init(&c->mu, NULL);
    return c;
}

void bd_chan_free(struct bd_chan *c)
{
    if (c != NULL) {
        pthread_mutex_destroy(&c->mu);
        free(c);
    }
}

void bd_chan_lock(struct bd_chan *c) { pthread_mutex_lock(&c->mu); }
int bd_chan_trylock(struct bd_chan *c) { return pthread_mutex_trylock(&c->mu) == 0 ? 0 : -EBUSY; }
void bd_chan_unlock(struct bd_chan *c) { pthread_mutex_unlock(&c->mu); }
struct bd_lane_counters *bd_chan_counters(struct bd_chan *c) { return &c->counters; }

/* -- gates ---------------------------------------------------------------------------------- */
static void futex_wait(uint32_t *word, uint32_t seen)
{
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake_all(uint32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

int bd_gate_open(struct bd_kpu_gate *g, uint32_t path, int fd, uint64_t base, uint64_t nbytes)
{
    if (path > BD_PATH_DIRECT || __atomic_load_n(&g->word, __ATOMIC_ACQUIRE) != BD_GATE_CLOSED)
        return -EBUSY;
    g->path = path;
    g->fd = fd;
    g->base = base;
    g->nbytes = nbytes;
    uint32_t closed = BD_GATE_CLOSED;
    return __atomic_compare_exchange_n(&g->word, &closed, 0, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED) ? 0 : -EBUSY;
}

void bd_gate_close(struct bd_kpu_gate *g)
{
    __atomic_fetch_or(&g->word, BD_GATE_CLOSED, __ATOMIC_ACQ_REL);
}

void bd_gate_drain(struct bd_kpu_gate *g)
{
    uint32_t v = __atomic_or_fetch(&g->word, BD_GATE_CLOSED, __ATOMIC_ACQ_REL);
    while (v != BD_GATE_CLOSED) {
        futex_wait(&g->word, v);
        v = __atomic_load_n(&g->word, __ATOMIC_ACQUIRE);
    }
}

static int gate_enter(struct bd_kpu_gate *g)
{
    uint32_t v = __atomic_load_n(&g->word, __ATOMIC_ACQUIRE);
    do {
        if (v & BD_GATE_CLOSED)
            return 0;
    } while (!__atomic_compare_exchange_n(&g->word, &v, v + 1, 1, __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE));
    return 1;
}

static void gate_leave(struct bd_kpu_gate *g)
{
    if (__atomic_sub_fetch(&g->word, 1, __ATOMIC_RELEASE) == BD_GATE_CLOSED)
        futex_wake_all(&g->word);     /* the last one out of a closed gate: a drain waits */
}

/* -- the lane ------------------------------------------------------------------------------- */
static int by_value(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The fraction of [off, off + n) resident, measured before the copy, as bytes (cachestat, else mincore). */
static uint64_t resident_bytes(const struct bd_kpu_gate *g, uint64_t off, uint64_t n)
{
    const uint64_t page = kernel_page();
    uint64_t first = off / page, pages = (off + n + page - 1) / page - first, cs[5], cached;
    if (pages == 0)
        return n;
    if (bd_cachestat(g->fd, off, n, cs) == 0) {
        cached = cs[0] < pages ? cs[0] : pages;
    } else {
        unsigned char vec[256];
        cached = 0;
        for (uint64_t p = 0; p < pages;) {
            uint64_t k = pages - p < sizeof(vec) ? pages - p : sizeof(vec);
            if (mincore((void *)(uintptr_t)(g->base + (first + p) * page), k * page, vec) != 0)
                return 0;
            for (uint64_t i = 0; i < k; i++)
                cached += vec[i] & 1;
            p += k;
        }
    }
    if (cached < pages) {         /* start reading the whole range now rather than fault by fault */
        uint64_t start = first * page;
        madvise((void *)(uintptr_t)(g->base + start), off + n - start, MADV_WILLNEED);
    }
    return (uint64_t)((double)cached / (double)pages * (double)n + 0.5);
}

static void observe(struct bd_lane_counters *c, const uint64_t *bounds, unsigned path, int write, uint64_t nbytes,
                    uint64_t ns)
{
    unsigned b = 0;
    while (b < BD_LANE_BOUNDS && bounds[b] < ns)
        b++;
    c->ops[path][write]++;
    c->bytes[path][write] += nbytes;
    c->latency_ns[path][write] += ns;
    c->buckets[path][write][b]++;
}

/* Check a request against the lane's rules; 1 if the lane may take it.  A pre-filter of the Python rulebook
 * (protocol.decode_io_request, then rules.check_ranges): it passes exactly the requests that accepts, and
 * everything else goes to Python, which refuses it with the exact error (tests/test_lane_rules.py). */
static int lane_checks(struct bd_lane *l, const uint8_t *body, uint32_t size, uint32_t *n_out)
{
    if (size < sizeof(struct bd_io_request))
        return 0;
    const struct bd_io_request *req = (const void *)body;
    uint32_t n = req->nranges;
    if (req->flags || n < 1 || n > l->limit || size != sizeof(*req) + n * sizeof(struct bd_io_range))
        return 0;
    const uint64_t tb = l->token_bytes;
    for (uint32_t i = 0; i < n; i++) {
        const struct bd_io_range *r = range_at(body, i);
        uint32_t op = r->op, tid = r->tensor_id;
        uint64_t t0 = r->token_start, nt = r->ntokens, so = r->slot_offset;
        if ((op != BD_WIRE_OP_WRITE && op != BD_WIRE_OP_READ) || tid >= l->ngates || nt < 1 ||
            t0 + nt > l->max_tokens)
            return 0;
        if (so == BD_MIRROR)
            so = t0 * tb;
        if (so > l->slot_bytes || nt * tb > l->slot_bytes - so)
            return 0;
        l->scratch[i] = so << 20 | i;             /* slot spans in order (slot_bytes < 2^44) */
        /* each KPU's ranges in token order (tid < 2 * MAX_LAYERS = 2^12, t0 < 2^32, i < MAX_RANGES = 2^12) */
        l->scratch[l->limit + i] = (uint64_t)tid << 52 | t0 << 20 | i;
    }
    if (n > 1) {                  /* one KPU's ranges apart in its tokens (protocol 6), slot spans apart */
        uint64_t *by_kpu = l->scratch + l->limit;
        qsort(by_kpu, n, sizeof(uint64_t), by_value);
        for (uint32_t i = 1; i < n; i++) {
            const struct bd_io_range *prev = range_at(body, (uint32_t)(by_kpu[i - 1] & 0xfffff));
            const struct bd_io_range *next = range_at(body, (uint32_t)(by_kpu[i] & 0xfffff));
            if (prev->tensor_id == next->tensor_id &&
                next->token_start < (uint64_t)prev->token_start + prev->ntokens)
                return 0;
        }
        qsort(l->scratch, n, sizeof(uint64_t), by_value);
        uint64_t prev_end = 0;
        for (uint32_t i = 0; i < n; i++) {
            const struct bd_io_range *r = range_at(body, (uint32_t)(l->scratch[i] & 0xfffff));
            uint64_t so = l->scratch[i] >> 20;
            if (i && so < prev_end)
                return 0;
            prev_end = so + (uint64_t)r->ntokens * tb;
        }
    }
    *n_out = n;
    return 1;
}

int bd_lane_check(struct bd_lane *l, const uint8_t *body, uint32_t size)
{
    uint32_t n;
    return lane_checks(l, body, size, &n) ? (int)n : 0;
}

/* May the lane run range r on gate g (counted in)?  Inside its KPU; a direct range needs the lane's ring and
 * a slot offset on an LBA (the KPU offset is one: the gate opens only for rows of whole LBAs), so that the
 * whole range moves by DMA between the slot and the device (Algorithm 2).  Else the general path says why. */
static int lane_may_run(const struct bd_lane *l, const struct bd_kpu_gate *g, const struct bd_io_range *r)
{
    uint64_t t0 = r->token_start, nt = r->ntokens, so = r->slot_offset;
    if ((t0 + nt) * l->token_bytes > g->nbytes)
        return 0;
    if (g->path != BD_PATH_DIRECT)
        return 1;
    return l->ring != NULL && (so == BD_MIRROR || so % l->lba_bytes == 0);
}

/* Queue range i's transfer on the channel's ring (the slot's span to or from the KPU's LBAs); 0 if the engine
 * refused it (x says why, nothing queued). */
static int lane_queue_direct(struct bd_lane *l, const struct bd_io_range *r, uint32_t i)
{
    const struct bd_kpu_gate *g = &l->gates[r->tensor_id];
    uint64_t off = (uint64_t)r->token_start * l->token_bytes, so = r->slot_offset;
    struct bd_xfer *x = &l->xfers[i];
    memset(x, 0, sizeof(*x));
    x->target = l->target;
    x->op = r->op == BD_WIRE_OP_WRITE ? BD_OP_WRITE : BD_OP_READ;
    x->slba = g->base + off / l->lba_bytes;      /* Algorithm 2, line 5: slba = start + offset / LBA */
    x->nbytes = (uint64_t)r->ntokens * l->token_bytes;
    x->buf = (void *)(uintptr_t)(l->slot + (so == BD_MIRROR ? off : so));
    x->buf_index = bd_ring_buffer_index(l->ring, x->buf, x->nbytes);
    x->tag = i;
    return bd_enqueue(l->ring, x) == 0;
}

/* Page-cache range i, by copy. */
static void lane_copy(struct bd_lane *l, const struct bd_io_range *r, struct bd_lane_row *row)
{
    const struct bd_kpu_gate *g = &l->gates[row->tensor_id];
    uint64_t off = (uint64_t)r->token_start * l->token_bytes, so = r->slot_offset;
    if (so == BD_MIRROR)
        so = off;
    row->started_ns = now_ns();
    if (r->op == BD_WIRE_OP_WRITE) {
        int64_t done = bd_pwrite_full(g->fd, l->slot + so, row->nbytes, off);
        row->hit = BD_NO_HIT;
        if (done < 0)
            row->err = (int32_t)-done;
    } else {
        row->hit = resident_bytes(g, off, row->nbytes);
        memcpy((void *)(uintptr_t)(l->slot + so), (const void *)(uintptr_t)(g->base + off), row->nbytes);
    }
    row->finished_ns = now_ns();
}

/* lane_run_ranges: a gate was closed or the general path must run a range; nothing was done */
#define LANE_TO_PYTHON INT32_MIN

/* Collect at least min_done of the direct transfers in flight; 0 or -errno (the ring failed). */
static int lane_reap(struct bd_lane *l, unsigned min_done, uint32_t *left)
{
    int got = bd_progress(l->ring, min_done, l->done, l->limit);
    if (got < 0)
        return got;
    if (got == 0 && min_done)
        return -EIO;              /* cannot happen: queued transfers always complete */
    for (int k = 0; k < got; k++)
        l->rows[l->done[k]->tag].finished_ns = l->done[k]->t_done_ns;
    *left -= (uint32_t)got;
    return 0;
}

/* Run a checked request under the channel lock; LANE_TO_PYTHON, -errno if the ring failed (the connection
 * ends: that ring is broken for either path), else the number of ranges that failed.  The direct ranges'
 * commands go to the device first, together (writes ahead of reads: an append must not wait behind a bulk
 * read's pieces), and the page-cache copies run while the device works. */
static int lane_run_ranges(struct bd_lane *l, const uint8_t *body, uint32_t n)
{
    struct bd_lane_counters *c = &l->chan->counters;
    const uint64_t tb = l->token_bytes;
    uint32_t i, failed = 0, ndirect = 0;
    int ring_err = 0;
    for (i = 0; i < n; i++) {
        const struct bd_io_range *r = range_at(body, i);
        struct bd_kpu_gate *g = &l->gates[r->tensor_id];
        if (!gate_enter(g))
            break;
        if (!lane_may_run(l, g, r)) {
            gate_leave(g);
            break;
        }
        struct bd_lane_row *row = &l->rows[i];
        row->tensor_id = r->tensor_id;
        row->path = g->path;
        row->nbytes = (uint64_t)r->ntokens * tb;
        row->err = 0;
        ndirect += g->path == BD_PATH_DIRECT;
    }
    if (i < n) {
        while (i--)
            gate_leave(&l->gates[l->rows[i].tensor_id]);
        return LANE_TO_PYTHON;
    }
    uint64_t busy0 = now_ns();
    if (ndirect) {
        for (int pass = 0; pass < 2; pass++)      /* writes, then reads */
            for (i = 0; i < n; i++) {
                const struct bd_io_range *r = range_at(body, i);
                if (l->rows[i].path == BD_PATH_DIRECT && (r->op == BD_WIRE_OP_WRITE) == (pass == 0)) {
                    l->rows[i].started_ns = busy0;
                    ndirect -= !lane_queue_direct(l, r, i);
                }
            }
        ring_err = lane_reap(l, 0, &ndirect);          /* submits them all now */
    }
    for (i = 0; i < n; i++)
        if (l->rows[i].path == BD_PATH_PAGECACHE)
            lane_copy(l, range_at(body, i), &l->rows[i]);
    while (ndirect && !ring_err)
        ring_err = lane_reap(l, 1, &ndirect);
    if (ring_err) {
        for (i = 0; i < n; i++)
            gate_leave(&l->gates[l->rows[i].tensor_id]);
        return ring_err;
    }
    for (i = 0; i < n; i++) {
        const struct bd_io_range *r = range_at(body, i);
        struct bd_lane_row *row = &l->rows[i];
        struct bd_kpu_gate *g = &l->gates[row->tensor_id];
        int write = r->op == BD_WIRE_OP_WRITE;
        if (row->path == BD_PATH_DIRECT) {
            row->hit = BD_NO_HIT;
            if (l->xfers[i].err_kind != BD_OK)
                row->err = 1;
            if (row->err)
                row->finished_ns = now_ns();
        }
        row->service_ns = row->finished_ns - row->started_ns;
        if (row->err) {
            c->errors[row->path][write]++;
            failed++;
            continue;
        }
        observe(c, l->bounds_ns, row->path, write, row->nbytes, row->service_ns);
        if (write) {
            uint32_t end = r->token_start + r->ntokens, f = __atomic_load_n(&g->filled, __ATOMIC_RELAXED);
            while (end > f && !__atomic_compare_exchange_n(&g->filled, &f, end, 1, __ATOMIC_RELAXED,
                                                           __ATOMIC_RELAXED))
                ;
        } else if (row->path == BD_PATH_PAGECACHE) {
            c->pagecache_read_bytes += row->nbytes;
            c->pagecache_hit_bytes += row->hit;
        }
    }
    c->busy_ns += now_ns() - busy0;
    c->channel_ops += n;
    for (i = 0; i < n; i++)
        gate_leave(&l->gates[l->rows[i].tensor_id]);
    return (int)failed;
}

/* The reply frame of a request whose every range was served, in l->reply; its length. */
static uint32_t pack_reply(struct bd_lane *l, uint32_t n)
{
    struct bd_frame_header *h = (void *)l->reply;
    struct bd_io_reply *reply = (void *)(h + 1);
    struct bd_io_result *res = (void *)(reply + 1);
    uint32_t len = (uint32_t)(sizeof(*reply) + n * sizeof(*res));
    memset(h, 0, sizeof(*h) + sizeof(*reply));
    memcpy(h->magic, BD_MAGIC, sizeof(h->magic));
    h->format = BD_IO_FORMAT;
    h->length = len;
    reply->request_id = l->req_id;
    reply->status = BD_STATUS_SERVED;
    reply->nresults = (uint16_t)n;
    for (uint32_t i = 0; i < n; i++, res++) {
        const struct bd_lane_row *row = &l->rows[i];
        memset(res, 0, sizeof(*res));
        res->status = BD_STATUS_SERVED;
        res->path = row->path == BD_PATH_DIRECT ? BD_WIRE_PATH_DIRECT : BD_WIRE_PATH_PAGECACHE;
        res->nbytes = row->nbytes;
        res->service_ns = row->service_ns;
        res->hit_bytes = row->hit;
        res->started_ns = row->started_ns;
        res->finished_ns = row->finished_ns;
    }
    return (uint32_t)sizeof(*h) + len;
}

int bd_lane_run(struct bd_lane *l)
{
    struct bd_stream *s = &l->stream;
    for (;;) {
        int r = bd_stream_read(s, -1);
        if (r < 0)
            return r;
        const uint8_t *body = s->buf + s->at;
        uint32_t n;
        if (s->fmt != BD_IO_FORMAT || !lane_checks(l, body, s->len, &n))
            return 0;
        bd_chan_lock(l->chan);
        int failed = lane_run_ranges(l, body, n);
        if (failed >= 0)
            l->chan->counters.requests++;
        bd_chan_unlock(l->chan);
        if (failed == LANE_TO_PYTHON)
            return 0;             /* a gate is closed: Python carries out what closed it */
        if (failed < 0)
            return failed;        /* the ring failed */
        l->req_id = ((const struct bd_io_request *)body)->request_id;
        l->nrows = n;
        if (failed > 0)
            return 1;
        if ((r = bd_send_all(s->fd, l->reply, pack_reply(l, n))) < 0)
            return r;
    }
}
