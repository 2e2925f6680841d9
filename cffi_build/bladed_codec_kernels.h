/*
 * bladed_codec_kernels.h - the codec's loops, included twice by bladed_codec.c: once for the baseline ISA
 * and, on x86-64, once more under `#pragma GCC target("avx2,f16c")`.  Before each inclusion K(name) names
 * that build's functions and K(f16_to_f32_n) / K(f32_to_f16_n) convert runs of fp16 (the only part that
 * differs between the builds).
 *
 * Every step is the torch encoder's (bladed/kvformat.py), one float32 operation for one torch op, in the
 * same order, so the rows are the same bit for bit: the compiler must not contract a*b+c into an FMA
 * (-ffp-contract=off) nor reassociate (no -ffast-math).
 */

/* values [v, v + n) of a run (struct run), as float32, into buf */
static inline void K(load)(float *restrict buf, int elem, const char *x, const struct run *u, int64_t v, int64_t n)
{
    while (n > 0) {
        int64_t r = v / u->row_elems, w = v - r * u->row_elems, h = w / u->hd, off = w - h * u->hd;
        int64_t len = u->hd - off < n ? u->hd - off : n;
        const char *src = x + r * u->x_row + h * u->x_head + off * elem_size(elem);
        if (elem == BD_CODEC_F32)
            memcpy(buf, src, (size_t)len * 4);
        else if (elem == BD_CODEC_F16)
            K(f16_to_f32_n)((const uint16_t *)src, buf, len);
        else
            bf16_to_f32_n((const uint16_t *)src, buf, len);
        buf += len, v += len, n -= len;
    }
}

/* the inverse: float32 buf into values [v, v + n) of the run */
static inline void K(store)(const float *restrict buf, int elem, char *x, const struct run *u, int64_t v, int64_t n)
{
    while (n > 0) {
        int64_t r = v / u->row_elems, w = v - r * u->row_elems, h = w / u->hd, off = w - h * u->hd;
        int64_t len = u->hd - off < n ? u->hd - off : n;
        char *dst = x + r * u->x_row + h * u->x_head + off * elem_size(elem);
        if (elem == BD_CODEC_F32)
            memcpy(dst, buf, (size_t)len * 4);
        else if (elem == BD_CODEC_F16)
            K(f32_to_f16_n)(buf, (uint16_t *)dst, len);
        else
            f32_to_bf16_n(buf, (uint16_t *)dst, len);
        buf += len, v += len, n -= len;
    }
}

/* nb blocks of b values staged in s->x, encoded into q (always inlined: b == 32 becomes a constant) */
static inline __attribute__((always_inline)) void K(encode_blocks)(struct scratch *restrict s, int64_t nb, int b,
                                                                   int kind, uint8_t *restrict q)
{
    /* each block's minimum and maximum as integer keys: integer min/max vectorise where float ones, with
     * NaN and -0 as C defines them, do not; -0 sorts below +0, NaNs beyond +-inf */
    for (int64_t k = 0; k < nb; k++) {
        const float *x = s->x + k * b;
        int32_t lo = INT32_MAX, hi = INT32_MIN;
        for (int i = 0; i < b; i++) {
            int32_t key = f32_key(x[i]);
            lo = key < lo ? key : lo;
            hi = key > hi ? key : hi;
        }
        s->nan[k] = hi > KEY_INF || lo < KEY_NEG_INF;
        s->lo[k] = key_f32(lo);
        s->hi[k] = key_f32(hi);
    }
    /* the scales, across blocks (torch: over all blocks at once, op by op) */
    if (kind == BD_CODEC_Q8) {
        for (int64_t k = 0; k < nb; k++) {           /* torch.maximum(amax, -amin) / 127, clamp, half */
            float neg = -s->lo[k], hi = s->hi[k];
            float amax = hi < neg ? neg : hi;        /* a tie (-0 vs +0) keeps amax, as torch.maximum does */
            float t = amax / 127.0f;
            s->t[k] = t > FP16_MAX ? FP16_MAX : t;
        }
    } else {
        for (int64_t k = 0; k < nb; k++) {           /* m = amin clamped to fp16's range, rounded down */
            float lo = s->lo[k];
            lo = lo < -FP16_MAX ? -FP16_MAX : lo;
            s->lo[k] = lo > FP16_MAX ? FP16_MAX : lo;
        }
        K(f32_to_f16_n)(s->lo, s->m16, nb);
        K(f16_to_f32_n)(s->m16, s->mf, nb);
        for (int64_t k = 0; k < nb; k++)
            s->m16[k] = s->mf[k] > s->lo[k] ? f16_next_down(s->m16[k]) : s->m16[k];
        K(f16_to_f32_n)(s->m16, s->mf, nb);
        for (int64_t k = 0; k < nb; k++) {           /* d = (amax - m) / 15, clamp, half */
            float t = (s->hi[k] - s->mf[k]) / 15.0f;
            s->t[k] = t > FP16_MAX ? FP16_MAX : t;
        }
    }
    K(f32_to_f16_n)(s->t, s->d16, nb);
    K(f16_to_f32_n)(s->d16, s->t, nb);
    for (int64_t k = 0; k < nb; k++) {               /* a NaN block decodes to NaN whatever its codes */
        float t = s->t[k], inv = 1.0f / t;
        int nan = s->nan[k];
        s->inv[k] = nan || !(t > 0.0f) ? 0.0f : inv;
        s->d16[k] = nan ? FP16_QNAN : s->d16[k];
        s->m16[k] = nan ? FP16_QNAN : s->m16[k];
    }
    /* the codes; inv == 0 (all zeros, NaN, q4's all -inf) leaves no code but 0 (torch: x * 0, or NaN cast) */
    if (kind == BD_CODEC_Q8) {
        for (int64_t k = 0; k < nb; k++) {
            const float *x = s->x + k * b, inv = s->inv[k];
            uint8_t *o = q + k * (2 + b);
            put16(o, s->d16[k]);
            int8_t *c = (int8_t *)(o + 2);
            if (inv == 0.0f) {
                memset(c, 0, (size_t)b);
                continue;
            }
            for (int i = 0; i < b; i++) {            /* round(x * inv).clamp(-127, 127): clamped first, equal */
                float y = x[i] * inv;
                y = y < -127.0f ? -127.0f : y;
                y = y > 127.0f ? 127.0f : y;
                c[i] = (int8_t)round_even(y);
            }
        }
    } else {
        const int h = b / 2;
        for (int64_t k = 0; k < nb; k++) {
            const float *x = s->x + k * b, inv = s->inv[k], m = s->mf[k];
            uint8_t *o = q + k * (4 + h);
            put16(o, s->d16[k]);
            put16(o + 2, s->m16[k]);
            if (inv == 0.0f) {
                memset(o + 4, 0, (size_t)h);
                continue;
            }
            for (int i = 0; i < h; i++) {            /* value i in the low nibble, value i + b/2 in the high */
                float y0 = (x[i] - m) * inv, y1 = (x[i + h] - m) * inv;
                y0 = y0 < 0.0f ? 0.0f : y0;
                y0 = y0 > 15.0f ? 15.0f : y0;
                y1 = y1 < 0.0f ? 0.0f : y1;
                y1 = y1 > 15.0f ? 15.0f : y1;
                o[4 + i] = (uint8_t)(round_even(y0) | round_even(y1) << 4);
            }
        }
    }
}

/* nb blocks at q decoded into s->x */
static inline __attribute__((always_inline)) void K(decode_blocks)(struct scratch *restrict s, int64_t nb, int b,
                                                                   int kind, const uint8_t *restrict q)
{
    const int64_t bb = kind == BD_CODEC_Q8 ? 2 + b : 4 + b / 2;
    for (int64_t k = 0; k < nb; k++)
        s->d16[k] = get16(q + k * bb);
    K(f16_to_f32_n)(s->d16, s->t, nb);
    if (kind == BD_CODEC_Q8) {
        for (int64_t k = 0; k < nb; k++) {           /* x = q * d */
            const int8_t *c = (const int8_t *)(q + k * bb + 2);
            float *x = s->x + k * b, d = s->t[k];
            for (int i = 0; i < b; i++)
                x[i] = (float)c[i] * d;
        }
        return;
    }
    for (int64_t k = 0; k < nb; k++)
        s->m16[k] = get16(q + k * bb + 2);
    K(f16_to_f32_n)(s->m16, s->mf, nb);
    const int h = b / 2;
    for (int64_t k = 0; k < nb; k++) {               /* x = q * d + m: two roundings, as torch's mul_ and add_ */
        const uint8_t *p = q + k * bb + 4;
        float *x = s->x + k * b, d = s->t[k], m = s->mf[k];
        for (int i = 0; i < h; i++) {
            x[i] = (float)(p[i] & 15) * d + m;
            x[i + h] = (float)(p[i] >> 4) * d + m;
        }
    }
}

/* `total` values of a run at x <-> their blocks, one after another at q */
static void K(run)(const struct bd_codec_job *j, int decode, char *x, const struct run *u, int64_t total, uint8_t *q,
                   struct scratch *s)
{
    const int b = j->block;
    const int64_t bb = j->kind == BD_CODEC_Q8 ? 2 + b : 4 + b / 2;
    const int64_t per = chunk_blocks(b) * b;
    for (int64_t v = 0; v < total; v += per) {
        int64_t nv = total - v < per ? total - v : per, nb = nv / b;
        uint8_t *qv = q + v / b * bb;
        if (decode) {
            if (b == 32)
                K(decode_blocks)(s, nb, 32, j->kind, qv);
            else
                K(decode_blocks)(s, nb, b, j->kind, qv);
            K(store)(s->x, j->elem, x, u, v, nv);
        } else {
            K(load)(s->x, j->elem, x, u, v, nv);
            if (b == 32)
                K(encode_blocks)(s, nb, 32, j->kind, qv);
            else
                K(encode_blocks)(s, nb, b, j->kind, qv);
        }
    }
}

/* rows [r0, r1) of the job: one run where the rows' blocks follow one another (a chunk then spans rows: a row
 * of a few blocks would otherwise pay the per-chunk steps for each), else a run per row */
static void K(rows)(const struct bd_codec_job *j, int decode, int64_t r0, int64_t r1)
{
    struct scratch s;
    const int64_t es = elem_size(j->elem), b = j->block, re = j->heads * j->head_dim;
    const int64_t row_bytes = re / b * (j->kind == BD_CODEC_Q8 ? 2 + b : 4 + b / 2);
    struct run u = {re, j->x_row, j->head_dim, j->x_head};
    if (j->heads == 1 || j->x_head == j->head_dim * es)     /* contiguous heads: a row is one stretch */
        u.hd = re;
    if (u.hd == re && j->x_row == re * es)                   /* contiguous rows too: all is one stretch */
        u.row_elems = u.hd = (r1 - r0) * re;
    char *x = (char *)j->x + r0 * j->x_row;
    if (j->q_row == row_bytes || r1 - r0 == 1) {
        K(run)(j, decode, x, &u, (r1 - r0) * re, j->q + r0 * j->q_row, &s);
        return;
    }
    for (int64_t r = r0; r < r1; r++)
        K(run)(j, decode, x + (r - r0) * j->x_row, &u, re, j->q + r * j->q_row, &s);
}
