/*
 * bladed_codec.c - the q8 / q4 KV row codec on the CPU (bladed_codec.h).
 *
 * The loops are bladed_codec_kernels.h, compiled here once for the baseline ISA and, on x86-64, once more for
 * AVX2 + F16C (picked per job: bd_codec_best_isa()), where the default block of 32 takes the single-pass loops
 * of bladed_codec_fused.h instead.  fp16 <-> fp32 is c10's arithmetic (torch's scalar
 * conversion, exact round to nearest even with subnormals, inf and NaN) on baseline x86-64, F16C's
 * instructions in the AVX2 build and the compiler's _Float16 (FCVT, the same rounding) on aarch64.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#include "bladed_codec.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BD_CODEC_HAVE_AVX2 1
#include <immintrin.h>
#endif

#define FP16_MAX 65504.0f
#define FP16_QNAN 0x7E00u            /* the quiet NaN a NaN block's scale (and minimum) is written as */
#define KEY_INF ((int32_t)0x7F800000)           /* f32_key(+inf) */
#define KEY_NEG_INF ((int32_t)0x807FFFFFu)      /* f32_key(-inf) */
#define CHUNK 4096                   /* values staged at once (the largest block) */
#define CHUNK_BLOCKS 1024            /* blocks staged at once */
#define MAX_THREADS 64

/* a run of blocks staged as float32, and the blocks' parameters (on the stack: 41 KiB) */
struct scratch {
    float x[CHUNK];
    float lo[CHUNK_BLOCKS], hi[CHUNK_BLOCKS], t[CHUNK_BLOCKS], inv[CHUNK_BLOCKS], mf[CHUNK_BLOCKS];
    uint16_t d16[CHUNK_BLOCKS], m16[CHUNK_BLOCKS];
    uint8_t nan[CHUNK_BLOCKS];
};

/* where value v of a run of rows is: row v / row_elems (x_row bytes apart), head (v % row_elems) / hd (x_head
 * bytes apart), each head's hd values contiguous; contiguous heads or rows collapse into longer stretches */
struct run {
    int64_t row_elems, x_row, hd, x_head;
};

#define INLINE static inline __attribute__((always_inline))

INLINE int64_t chunk_blocks(int b)
{
    int64_t n = CHUNK / b;
    return n > CHUNK_BLOCKS ? CHUNK_BLOCKS : n;
}

INLINE int64_t elem_size(int elem)
{
    return elem == BD_CODEC_F32 ? 4 : 2;
}

INLINE uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

INLINE float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a float's bits as an int32 that orders as the floats do (-0 just below +0, NaNs beyond +-inf); an
 * involution, so key_f32 is the same map */
INLINE int32_t f32_key(float f)
{
    int32_t i = (int32_t)f32_bits(f);
    return i ^ (int32_t)((uint32_t)(i >> 31) >> 1);
}

INLINE float key_f32(int32_t k)
{
    return bits_f32((uint32_t)(k ^ (int32_t)((uint32_t)(k >> 31) >> 1)));
}

/* round to nearest even of |y| <= 2^22: adding 1.5 * 2^23 leaves the integer in the low mantissa bits */
INLINE int32_t round_even(float y)
{
    return (int32_t)(f32_bits(y + 12582912.0f) - 0x4B400000u);
}

INLINE void put16(uint8_t *p, uint16_t v)     /* little-endian, as ggml's blocks */
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

INLINE uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

/* torch.nextafter(h, -inf) of a finite fp16 */
INLINE uint16_t f16_next_down(uint16_t h)
{
    if ((h & 0x7FFF) == 0)
        return 0x8001;
    return h & 0x8000 ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
}

/* c10's fp16_ieee_to_fp32_value */
INLINE float f16_to_f32_1(uint16_t h)
{
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}

/* c10's fp16_ieee_from_fp32_value: round to nearest even; NaN -> 0x7E00 with its sign */
INLINE uint16_t f32_to_f16_1(float f)
{
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    float base = (bits_f32(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base), nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline void bf16_to_f32_n(const uint16_t *restrict s, float *restrict d, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        d[i] = bits_f32((uint32_t)s[i] << 16);
}

/* c10's round_to_nearest_even for bfloat16; NaN -> 0x7FC0 */
static inline void f32_to_bf16_n(const float *restrict s, uint16_t *restrict d, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = f32_bits(s[i]);
        d[i] = s[i] != s[i] ? 0x7FC0u : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

/* the baseline build */
#if defined(__aarch64__)
typedef _Float16 bd_f16 __attribute__((may_alias));

static inline void f16_to_f32_n_portable(const uint16_t *restrict s, float *restrict d, int64_t n)
{
    const bd_f16 *h = (const bd_f16 *)s;
    for (int64_t i = 0; i < n; i++)
        d[i] = (float)h[i];
}

static inline void f32_to_f16_n_portable(const float *restrict s, uint16_t *restrict d, int64_t n)
{
    bd_f16 *h = (bd_f16 *)d;
    for (int64_t i = 0; i < n; i++)
        h[i] = (bd_f16)s[i];
}
#else
static inline void f16_to_f32_n_portable(const uint16_t *restrict s, float *restrict d, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        d[i] = f16_to_f32_1(s[i]);
}

static inline void f32_to_f16_n_portable(const float *restrict s, uint16_t *restrict d, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        d[i] = f32_to_f16_1(s[i]);
}
#endif

#define K(name) name##_portable
#include "bladed_codec_kernels.h"
#undef K

#ifdef BD_CODEC_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#define F16C_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline void f16_to_f32_n_avx2(const uint16_t *restrict s, float *restrict d, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++)
        d[i] = _cvtsh_ss(s[i]);
}

static inline void f32_to_f16_n_avx2(const float *restrict s, uint16_t *restrict d, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), F16C_ROUND));
    for (; i < n; i++)
        d[i] = _cvtss_sh(s[i], F16C_ROUND);
}

#define K(name) name##_avx2
#include "bladed_codec_kernels.h"
#undef K
#include "bladed_codec_fused.h"
#pragma GCC pop_options
#endif

int bd_codec_best_isa(void)
{
#ifdef BD_CODEC_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return BD_CODEC_AVX2;
#endif
    return BD_CODEC_PORTABLE;
}

static int job_ok(const struct bd_codec_job *j)
{
    if (j->kind != BD_CODEC_Q8 && j->kind != BD_CODEC_Q4)
        return 0;
    if (j->elem != BD_CODEC_F32 && j->elem != BD_CODEC_F16 && j->elem != BD_CODEC_BF16)
        return 0;
    if (j->isa != BD_CODEC_PORTABLE && (j->isa != BD_CODEC_AVX2 || bd_codec_best_isa() != BD_CODEC_AVX2))
        return 0;
    if (j->block < 2 || j->block > CHUNK || j->block % 2 || j->head_dim <= 0 || j->head_dim % j->block)
        return 0;
    return j->rows >= 0 && j->heads > 0 && (j->rows == 0 || (j->x && j->q));
}

struct part {
    const struct bd_codec_job *job;
    int decode;
    int64_t r0, r1;
};

static void *part_run(void *arg)
{
    struct part *p = arg;
#ifdef BD_CODEC_HAVE_AVX2
    if (p->job->isa == BD_CODEC_AVX2) {
        if (p->job->block == FUSED_BLOCK)
            fused_rows(p->job, p->decode, p->r0, p->r1);
        else
            rows_avx2(p->job, p->decode, p->r0, p->r1);
        return NULL;
    }
#endif
    rows_portable(p->job, p->decode, p->r0, p->r1);
    return NULL;
}

/* the rows split evenly over `threads` threads, this one included; a thread that cannot be started leaves its
 * part to this one */
static int run(const struct bd_codec_job *j, int threads, int decode)
{
    if (!job_ok(j))
        return -EINVAL;
    if ((int64_t)threads > j->rows)
        threads = (int)j->rows;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    struct part parts[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 0; i < threads; i++)
        parts[i] = (struct part){j, decode, j->rows * i / threads, j->rows * (i + 1) / threads};
    if (threads > 1) {
        sigset_t all, old;                /* the workers take no signals: the caller's thread handles them */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (int i = 1; i < threads; i++)
            started[i] = pthread_create(&tid[i], NULL, part_run, &parts[i]) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    part_run(&parts[0]);
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            part_run(&parts[i]);
    }
    return 0;
}

int bd_codec_encode(const struct bd_codec_job *job, int threads)
{
    return run(job, threads, 0);
}

int bd_codec_decode(const struct bd_codec_job *job, int threads)
{
    return run(job, threads, 1);
}
