/*
 * bladed_wire.h - frames on a stream socket, in C: the one piece of C both ends of a data connection use.
 *
 * Built alone as bladed._wire (no liburing: a client process needs nothing but this to talk to the
 * socket), and compiled into bladed._uring as well, whose lane reads through the same struct bd_stream.
 * The frame's layout is bladed.protocol's, generated as bladed_wire_layout.h at build time.
 *
 * This file is read twice: by the C compiler, and (between the CDEF markers) by cffi.
 */
#ifndef BLADED_WIRE_H
#define BLADED_WIRE_H
#include <stdint.h>

#include "bladed_wire_layout.h"

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
/* CDEF-END */

#endif
