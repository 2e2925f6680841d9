/*
 * bladed_wire.c - frames on a stream socket (bladed_wire.h).
 *
 * The header's layout is struct bd_frame_header, generated from bladed.protocol (bladed_wire_layout.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bladed_wire.h"

#define FRAME_HEADER ((uint32_t)sizeof(struct bd_frame_header))

static int nonblocking(int fd)
{
    int flags = fcntl(fd, F_GETFL);
    return flags >= 0 && (flags & O_NONBLOCK);
}

/* make room: what is left of the current frame to the front of the buffer */
static void stream_compact(struct bd_stream *s)
{
    memmove(s->buf, s->buf + s->start, s->end - s->start);
    s->end -= s->start;
    s->start = 0;
}

static int stream_more(struct bd_stream *s, int timeout_ms, int at_boundary)
{
    if (s->end == s->cap)
        stream_compact(s);
    for (;;) {
        ssize_t n = recv(s->fd, s->buf + s->end, s->cap - s->end, 0);
        if (n > 0) {
            s->end += (uint32_t)n;
            return 0;
        }
        if (n == 0) {
            if (at_boundary && s->start == s->end)
                return -BD_STREAM_CLOSED;
            s->detail = s->end - s->start;
            return -BD_STREAM_TRUNCATED;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -errno;
        if (!nonblocking(s->fd))
            return -BD_STREAM_TIMEOUT;    /* a blocking socket's SO_RCVTIMEO ran out */
        struct pollfd p = {.fd = s->fd, .events = POLLIN};
        int r = poll(&p, 1, timeout_ms);
        if (r == 0)
            return -BD_STREAM_TIMEOUT;
        if (r < 0 && errno != EINTR)
            return -errno;
    }
}

int bd_stream_read(struct bd_stream *s, int timeout_ms)
{
    int r;
    if (s->start == s->end)
        s->start = s->end = 0;
    while (s->end - s->start < FRAME_HEADER)
        if ((r = stream_more(s, timeout_ms, 1)) < 0)
            return r;
    const struct bd_frame_header *h = (const void *)(s->buf + s->start);
    if (memcmp(h->magic, BD_MAGIC, sizeof(h->magic)) != 0) {
        s->detail = (uint64_t)h->magic[0] | (uint64_t)h->magic[1] << 8;
        return -BD_STREAM_BAD_MAGIC;
    }
    if (h->format != BD_JSON_FORMAT && h->format != BD_IO_FORMAT) {
        s->detail = h->format;
        return -BD_STREAM_BAD_FORMAT;
    }
    uint32_t len = h->length, fmt = h->format;
    if (len > s->max_bytes || len > s->cap - FRAME_HEADER) {
        s->detail = len;
        return -BD_STREAM_TOO_LARGE;
    }
    if (s->cap - s->start < FRAME_HEADER + len)
        stream_compact(s);        /* (h is stale from here on) */
    while (s->end - s->start < FRAME_HEADER + len)
        if ((r = stream_more(s, timeout_ms, 0)) < 0)
            return r;
    s->fmt = fmt;
    s->at = s->start + FRAME_HEADER;
    s->len = len;
    s->start += FRAME_HEADER + len;
    return 0;
}

int bd_send_all(int fd, const void *buf, uint64_t len)
{
    const uint8_t *p = buf;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) && nonblocking(fd)) {
                /* a Python socket with a timeout is non-blocking underneath: wait for room (a blocking
                 * socket's EAGAIN is its SO_SNDTIMEO running out: the daemon's io.send_timeout_s) */
                struct pollfd q = {.fd = fd, .events = POLLOUT};
                if (poll(&q, 1, -1) < 0 && errno != EINTR)
                    return -errno;
                continue;
            }
            return -errno;
        }
        p += n;
        len -= (uint64_t)n;
    }
    return 0;
}
