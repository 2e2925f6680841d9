/*
 * bladed_codec.h - the q8 / q4 KV row codec on the CPU: bladed.kvformat's Q8Format / Q4Format in C.
 *
 * Built alone as bladed._codec (libc and pthreads only, no liburing: an inference process loads it). The
 * rows are bit for bit what the formats' torch encoder writes (docs/kv-formats.md, "The CPU codec", says
 * where they may differ: NaN payloads and the sign of a zero scale or minimum) and decode bit for bit as its
 * decoder does. Plain C loops that gcc -O3 vectorises; on x86-64 a second build of the same loops for
 * AVX2 + F16C is picked at run time where the CPU has them (the wheel stays baseline x86-64), with single-pass
 * loops for the default block of 32 (bladed_codec_fused.h).
 *
 * This file is read twice: by the C compiler, and (between the CDEF markers) by cffi.
 */
#ifndef BLADED_CODEC_H
#define BLADED_CODEC_H
#include <stdint.h>

/* CDEF-BEGIN */
enum bd_codec_kind {
    BD_CODEC_Q8 = 8,              /* blocks {fp16 d; int8 q[block]}, x = q*d (ggml's block_q8_0) */
    BD_CODEC_Q4 = 4               /* blocks {fp16 d; fp16 m; u8 qs[block/2]}, x = q*d + m (block_q4_1) */
};
enum bd_codec_elem {              /* the elements of the float side */
    BD_CODEC_F32 = 0,
    BD_CODEC_F16 = 1,
    BD_CODEC_BF16 = 2
};
enum bd_codec_isa {               /* which build of the loops runs */
    BD_CODEC_PORTABLE = 0,        /* baseline: SSE2 on x86-64, NEON on aarch64 */
    BD_CODEC_AVX2 = 1             /* x86-64 with AVX2 and F16C */
};

/* rows x heads x head_dim values.  The float side: value (r, h, i) at x + r*x_row + h*x_head + i*(element
 * size), each head's head_dim values contiguous.  The encoded side: row r at q + r*q_row, its blocks one
 * after another, head by head (a block never spans two heads: block divides head_dim). */
struct bd_codec_job {
    int kind;                     /* enum bd_codec_kind */
    int block;                    /* values per block: even, 2..4096, divides head_dim */
    int elem;                     /* enum bd_codec_elem */
    int isa;                      /* enum bd_codec_isa: at most bd_codec_best_isa() */
    int64_t rows;
    int64_t heads;
    int64_t head_dim;
    void *x;                      /* elements aligned to their size */
    int64_t x_row;                /* bytes */
    int64_t x_head;               /* bytes */
    uint8_t *q;
    int64_t q_row;                /* bytes */
};
/* Encode the float side into the rows (decode: the rows into the float side), on `threads` threads, each
 * a range of rows (1: the caller's thread alone).  0, or -EINVAL for a job outside the above. */
int bd_codec_encode(const struct bd_codec_job *job, int threads);
int bd_codec_decode(const struct bd_codec_job *job, int threads);
int bd_codec_best_isa(void);      /* the fastest enum bd_codec_isa this CPU runs */
/* CDEF-END */

#endif
