/*
 * bladed_codec_fused.h - the AVX2 + F16C build's single-pass loops for the default block of 32 values: each
 * block goes from the float side to its bytes (and back) in registers, with no float32 staging and no
 * per-chunk passes (bladed_codec_kernels.h stages chunks of any block size through a float32 scratch; the
 * compiler cannot keep a block in registers there; docs/kv-formats.md has both paths' rates).  Included by
 * bladed_codec.c inside its `#pragma GCC target("avx2,f16c")` region.
 *
 * The arithmetic is bladed_codec_kernels.h's, op for op (and so the torch encoder's, bit for bit): the same
 * integer keys for a block's minimum and maximum (on the fp16 bits themselves for fp16 input: the same order),
 * the same scale and minimum steps (eight blocks' side by side in one vector), the same products, clamps and
 * round-to-nearest-even.  tests/test_kvformat_codec*.py hold both builds to the reference.
 */

#define FUSED_BLOCK 32
#define FUSED_GROUP 8                /* blocks whose scales are computed side by side */
#define KEY16_INF 0x7C00             /* fused_key16(+inf) */
#define KEY16_NEG_INF (-31745)       /* fused_key16(-inf), 0x83FF */

/* eight values of the float side as float32 */
INLINE __m256 fused_load8(int elem, const char *p)
{
    if (elem == BD_CODEC_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (elem == BD_CODEC_F32)
        return _mm256_loadu_ps((const float *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the inverse: eight float32 into the float side (bf16: f32_to_bf16_n's rounding, NaN as 0x7FC0) */
INLINE void fused_store8(int elem, char *p, __m256 v)
{
    if (elem == BD_CODEC_F16) {
        _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, F16C_ROUND));
    } else if (elem == BD_CODEC_F32) {
        _mm256_storeu_ps((float *)p, v);
    } else {
        const __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        r = _mm256_srli_epi32(r, 16);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(r));
    }
}

/* f32_key on eight lanes of bits (its own inverse) */
INLINE __m256i fused_key8i(__m256i i)
{
    return _mm256_xor_si256(i, _mm256_srli_epi32(_mm256_srai_epi32(i, 31), 1));
}

INLINE __m256i fused_key8(__m256 v)
{
    return fused_key8i(_mm256_castps_si256(v));
}

/* fused_key16 on eight lanes */
INLINE __m128i fused_key16_128(__m128i h)
{
    return _mm_xor_si128(h, _mm_srli_epi16(_mm_srai_epi16(h, 15), 1));
}

/* a block's smallest and largest key (f32_key) */
INLINE void fused_block_keys(int elem, const char *x, int32_t *lo, int32_t *hi)
{
    __m256i kmin = _mm256_set1_epi32(INT32_MAX), kmax = _mm256_set1_epi32(INT32_MIN);
    for (int p = 0; p < 4; p++) {
        const __m256i k = fused_key8(fused_load8(elem, x + p * 8 * elem_size(elem)));
        kmin = _mm256_min_epi32(kmin, k);
        kmax = _mm256_max_epi32(kmax, k);
    }
    __m128i a = _mm_min_epi32(_mm256_castsi256_si128(kmin), _mm256_extracti128_si256(kmin, 1));
    __m128i b = _mm_max_epi32(_mm256_castsi256_si128(kmax), _mm256_extracti128_si256(kmax, 1));
    a = _mm_min_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    b = _mm_max_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    a = _mm_min_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    b = _mm_max_epi32(b, _mm_shuffle_epi32(b, 0xB1));
    *lo = _mm_cvtsi128_si32(a);
    *hi = _mm_cvtsi128_si32(b);
}

/* f32_key's fp16 twin: fp16 bits as int16 that order as the values do (its own inverse too) */
INLINE __m256i fused_key16(__m256i h)
{
    return _mm256_xor_si256(h, _mm256_srli_epi16(_mm256_srai_epi16(h, 15), 1));
}

/* an fp16 block's smallest and largest value, as fp16 bits: comparing fp16 keys orders as comparing the
 * float32 values does (fp16 -> float32 is exact and monotonic), on twice the lanes; phminposuw finds the
 * smallest of eight unsigned words (the keys biased by 0x8000; the largest: the smallest complement) */
INLINE void fused_block_range16(const char *x, uint16_t *lo, uint16_t *hi)
{
    const __m256i k0 = fused_key16(_mm256_loadu_si256((const __m256i *)x));
    const __m256i k1 = fused_key16(_mm256_loadu_si256((const __m256i *)(x + 32)));
    const __m256i mn = _mm256_min_epi16(k0, k1), mx = _mm256_max_epi16(k0, k1);
    const __m128i a = _mm_min_epi16(_mm256_castsi256_si128(mn), _mm256_extracti128_si256(mn, 1));
    const __m128i b = _mm_max_epi16(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    const __m128i bias = _mm_set1_epi16((short)0x8000), flip = _mm_set1_epi16(0x7FFF);
    /* keys still (fused_group_range turns them back); minpos's index bits 16-18 fall off the cast */
    *lo = (uint16_t)(_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(a, bias))) ^ 0x8000);
    *hi = (uint16_t)(_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(b, flip))) ^ 0x7FFF);
}

/* the smallest and largest value of each of a group's n blocks at x (lanes n.. zero) as float32, and the lanes
 * whose block holds a NaN (all ones): a NaN's key lies beyond +-inf's */
INLINE __m256 fused_group_range(int elem, const char *x, int n, __m256 *lo, __m256 *hi)
{
    const int64_t xb = FUSED_BLOCK * elem_size(elem);
    if (elem == BD_CODEC_F16) {
        uint16_t lk[FUSED_GROUP] = {0}, hk[FUSED_GROUP] = {0};
        for (int k = 0; k < n; k++)
            fused_block_range16(x + k * xb, &lk[k], &hk[k]);
        const __m256i l = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)lk));
        const __m256i h = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)hk));
        const __m128i lb = fused_key16_128(_mm_loadu_si128((const __m128i *)lk));
        const __m128i hb = fused_key16_128(_mm_loadu_si128((const __m128i *)hk));
        *lo = _mm256_cvtph_ps(lb);
        *hi = _mm256_cvtph_ps(hb);
        return _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(h, _mm256_set1_epi32(KEY16_INF)),
                                                   _mm256_cmpgt_epi32(_mm256_set1_epi32(KEY16_NEG_INF), l)));
    }
    int32_t lk[FUSED_GROUP] = {0}, hk[FUSED_GROUP] = {0};
    for (int k = 0; k < n; k++)
        fused_block_keys(elem, x + k * xb, &lk[k], &hk[k]);
    const __m256i l = _mm256_loadu_si256((const __m256i *)lk), h = _mm256_loadu_si256((const __m256i *)hk);
    *lo = _mm256_castsi256_ps(fused_key8i(l));
    *hi = _mm256_castsi256_ps(fused_key8i(h));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(h, _mm256_set1_epi32(KEY_INF)),
                                               _mm256_cmpgt_epi32(_mm256_set1_epi32(KEY_NEG_INF), l)));
}

/* four vectors of eight int32 codes (each within int8) as 32 bytes in order */
INLINE __m256i fused_pack32(const __m256i c[4])
{
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* y clamped to [lo, hi] and rounded to the nearest integer, ties to even (round_even) */
INLINE __m256i fused_round(__m256 y, __m256 lo, __m256 hi)
{
    y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
    return _mm256_cvttps_epi32(_mm256_round_ps(y, F16C_ROUND));
}

/* the end of eight blocks' scale chains, shared by q8 and q4: t clamped to fp16's largest and rounded to fp16,
 * stored (d16: the quiet NaN where the block holds a NaN) and its reciprocal as the codes use it (inv: 0 where
 * the scale is not positive or the block holds a NaN); the NaN lanes as 16-bit masks */
INLINE __m128i fused_scale_out(__m256 t, __m256 nan, uint16_t d16[FUSED_GROUP], float inv[FUSED_GROUP])
{
    const __m256 max = _mm256_set1_ps(FP16_MAX);
    t = _mm256_blendv_ps(t, max, _mm256_cmp_ps(t, max, _CMP_GT_OQ));
    const __m128i t16 = _mm256_cvtps_ph(t, F16C_ROUND);
    t = _mm256_cvtph_ps(t16);
    const __m256 none = _mm256_or_ps(nan, _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_NGT_UQ));  /* !(t > 0) */
    _mm256_storeu_ps(inv, _mm256_andnot_ps(none, _mm256_div_ps(_mm256_set1_ps(1.0f), t)));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_castps_si256(nan)),
                                          _mm256_extracti128_si256(_mm256_castps_si256(nan), 1));
    _mm_storeu_si128((__m128i *)d16, _mm_blendv_epi8(t16, _mm_set1_epi16((short)FP16_QNAN), nan16));
    return nan16;
}

/* encode_blocks' q8 scales for eight blocks: d = max(hi, -lo) / 127 clamped, as fp16; inv = 1 / d, 0 where d is
 * not positive or the block holds a NaN (whose d is written as the quiet NaN) */
INLINE void fused_q8_scales(__m256 lo, __m256 hi, __m256 nan, uint16_t d16[FUSED_GROUP], float inv[FUSED_GROUP])
{
    const __m256 neg = _mm256_xor_ps(lo, _mm256_set1_ps(-0.0f));
    const __m256 amax = _mm256_blendv_ps(hi, neg, _mm256_cmp_ps(hi, neg, _CMP_LT_OQ));   /* hi < neg ? neg : hi */
    fused_scale_out(_mm256_div_ps(amax, _mm256_set1_ps(127.0f)), nan, d16, inv);
}

/* nb blocks of 32 values at x (contiguous) into q8 blocks at q, eight blocks at a time: their keys, then their
 * scales side by side in one vector (a block's scale is a chain of two divisions and two conversions; eight
 * chains at once keep the divider busy), then their codes */
INLINE void fused_q8_encode(int elem, const char *x, int64_t nb, uint8_t *restrict q)
{
    const int64_t xb = FUSED_BLOCK * elem_size(elem), qb = 2 + FUSED_BLOCK;
    const __m256 lo127 = _mm256_set1_ps(-127.0f), hi127 = _mm256_set1_ps(127.0f);
    for (int64_t g = 0; g < nb; g += FUSED_GROUP) {
        const int n = nb - g < FUSED_GROUP ? (int)(nb - g) : FUSED_GROUP;
        __m256 lo, hi;
        const __m256 nan = fused_group_range(elem, x, n, &lo, &hi);
        float inv[FUSED_GROUP];
        uint16_t d16[FUSED_GROUP];
        fused_q8_scales(lo, hi, nan, d16, inv);
        for (int k = 0; k < n; k++, x += xb, q += qb) {
            put16(q, d16[k]);
            if (inv[k] == 0.0f) {                               /* zeros, NaN: codes 0 */
                memset(q + 2, 0, FUSED_BLOCK);
                continue;
            }
            const __m256 s = _mm256_set1_ps(inv[k]);
            __m256i c[4];
            for (int p = 0; p < 4; p++)
                c[p] = fused_round(_mm256_mul_ps(fused_load8(elem, x + p * 8 * elem_size(elem)), s), lo127, hi127);
            _mm256_storeu_si256((__m256i *)(q + 2), fused_pack32(c));
        }
    }
}

/* nb q8 blocks at q into 32 values each at x */
INLINE void fused_q8_decode(int elem, char *x, int64_t nb, const uint8_t *restrict q)
{
    for (int64_t k = 0; k < nb; k++, x += FUSED_BLOCK * elem_size(elem), q += 2 + FUSED_BLOCK) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(get16(q)));
        for (int p = 0; p < 4; p++) {
            const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 2 + 8 * p)));
            fused_store8(elem, x + p * 8 * elem_size(elem), _mm256_mul_ps(_mm256_cvtepi32_ps(c), d));
        }
    }
}

/* encode_blocks' q4 parameters for eight blocks: m = lo clamped to fp16's range, rounded down to fp16; d = (hi -
 * m) / 15 clamped, as fp16; inv = 1 / d, 0 where d is not positive or the block holds a NaN (whose d and m are
 * written as the quiet NaN) */
INLINE void fused_q4_params(__m256 lo, __m256 hi, __m256 nan, uint16_t d16[FUSED_GROUP], uint16_t m16[FUSED_GROUP],
                            float mf[FUSED_GROUP], float inv[FUSED_GROUP])
{
    const __m256 max = _mm256_set1_ps(FP16_MAX);
    lo = _mm256_blendv_ps(lo, _mm256_set1_ps(-FP16_MAX), _mm256_cmp_ps(lo, _mm256_set1_ps(-FP16_MAX), _CMP_LT_OQ));
    lo = _mm256_blendv_ps(lo, max, _mm256_cmp_ps(lo, max, _CMP_GT_OQ));
    __m128i m = _mm256_cvtps_ph(lo, F16C_ROUND);
    /* where m rounded up, one fp16 step down (f16_next_down: +-0 -> 0x8001, else one unit towards -inf) */
    const __m256i above = _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtph_ps(m), lo, _CMP_GT_OQ));
    const __m128i up = _mm_packs_epi32(_mm256_castsi256_si128(above), _mm256_extracti128_si256(above, 1));
    const __m128i zero = _mm_cmpeq_epi16(_mm_and_si128(m, _mm_set1_epi16(0x7FFF)), _mm_setzero_si128());
    const __m128i one = _mm_set1_epi16(1), neg = _mm_srai_epi16(m, 15);      /* all ones where the sign is set */
    __m128i down = _mm_blendv_epi8(_mm_sub_epi16(m, one), _mm_add_epi16(m, one), neg);
    down = _mm_blendv_epi8(down, _mm_set1_epi16((short)0x8001), zero);
    m = _mm_blendv_epi8(m, down, up);
    const __m256 mv = _mm256_cvtph_ps(m);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(hi, mv), _mm256_set1_ps(15.0f));
    const __m128i nan16 = fused_scale_out(t, nan, d16, inv);
    _mm256_storeu_ps(mf, mv);
    _mm_storeu_si128((__m128i *)m16, _mm_blendv_epi8(m, _mm_set1_epi16((short)FP16_QNAN), nan16));
}

/* nb blocks of 32 values at x into q4 blocks at q, eight at a time (as fused_q8_encode) */
INLINE void fused_q4_encode(int elem, const char *x, int64_t nb, uint8_t *restrict q)
{
    const int64_t xb = FUSED_BLOCK * elem_size(elem), qb = 4 + FUSED_BLOCK / 2;
    const __m256 zero = _mm256_setzero_ps(), fifteen = _mm256_set1_ps(15.0f);
    for (int64_t g = 0; g < nb; g += FUSED_GROUP) {
        const int n = nb - g < FUSED_GROUP ? (int)(nb - g) : FUSED_GROUP;
        __m256 lo, hi;
        const __m256 nan = fused_group_range(elem, x, n, &lo, &hi);
        float inv[FUSED_GROUP], mf[FUSED_GROUP];
        uint16_t d16[FUSED_GROUP], m16[FUSED_GROUP];
        fused_q4_params(lo, hi, nan, d16, m16, mf, inv);
        for (int k = 0; k < n; k++, x += xb, q += qb) {
            put16(q, d16[k]);
            put16(q + 2, m16[k]);
            if (inv[k] == 0.0f) {                               /* zeros, NaN, all -inf: codes 0 */
                memset(q + 4, 0, FUSED_BLOCK / 2);
                continue;
            }
            const __m256 s = _mm256_set1_ps(inv[k]), m = _mm256_set1_ps(mf[k]);
            __m256i c[4];
            for (int p = 0; p < 4; p++) {
                const __m256 y = _mm256_sub_ps(fused_load8(elem, x + p * 8 * elem_size(elem)), m);
                c[p] = fused_round(_mm256_mul_ps(y, s), zero, fifteen);
            }
            const __m256i codes = fused_pack32(c);             /* value i in the low nibble, i + 16 in the high */
            const __m128i low = _mm256_castsi256_si128(codes), high = _mm256_extracti128_si256(codes, 1);
            _mm_storeu_si128((__m128i *)(q + 4), _mm_or_si128(low, _mm_slli_epi16(high, 4)));
        }
    }
}

/* nb q4 blocks at q into 32 values each at x: q * d, then + m (two roundings) */
INLINE void fused_q4_decode(int elem, char *x, int64_t nb, const uint8_t *restrict q)
{
    const int64_t es = elem_size(elem);
    const __m128i mask = _mm_set1_epi8(15);
    for (int64_t k = 0; k < nb; k++, x += FUSED_BLOCK * es, q += 4 + FUSED_BLOCK / 2) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(get16(q))), m = _mm256_set1_ps(_cvtsh_ss(get16(q + 2)));
        const __m128i p = _mm_loadu_si128((const __m128i *)(q + 4));
        const __m128i half[2] = {_mm_and_si128(p, mask), _mm_and_si128(_mm_srli_epi16(p, 4), mask)};
        for (int i = 0; i < 4; i++) {
            const __m128i c = i & 1 ? _mm_srli_si128(half[i / 2], 8) : half[i / 2];
            const __m256 y = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
            fused_store8(elem, x + i * 8 * es, _mm256_add_ps(_mm256_mul_ps(y, d), m));
        }
    }
}

INLINE void fused_stretch(int kind, int decode, int elem, char *x, int64_t nb, uint8_t *q)
{
    if (kind == BD_CODEC_Q8 && decode)
        fused_q8_decode(elem, x, nb, q);
    else if (kind == BD_CODEC_Q8)
        fused_q8_encode(elem, x, nb, q);
    else if (decode)
        fused_q4_decode(elem, x, nb, q);
    else
        fused_q4_encode(elem, x, nb, q);
}

/* rows [r0, r1) of a job of blocks of 32, a stretch of whole blocks at a time: a head, or a row where its heads
 * follow one another, or all the rows where they do too (K(rows) collapses its runs alike) */
INLINE void fused_rows_elem(const struct bd_codec_job *j, int decode, int64_t r0, int64_t r1, int elem)
{
    const int64_t es = elem_size(elem), bb = j->kind == BD_CODEC_Q8 ? 2 + FUSED_BLOCK : 4 + FUSED_BLOCK / 2;
    const int64_t nb = j->head_dim / FUSED_BLOCK, row_bytes = j->heads * nb * bb;
    const int heads_joined = j->heads == 1 || j->x_head == j->head_dim * es;
    if (heads_joined && j->x_row == j->heads * j->head_dim * es && j->q_row == row_bytes) {
        fused_stretch(j->kind, decode, elem, (char *)j->x + r0 * j->x_row, (r1 - r0) * j->heads * nb,
                      j->q + r0 * j->q_row);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        char *x = (char *)j->x + r * j->x_row;
        uint8_t *q = j->q + r * j->q_row;
        if (heads_joined)
            fused_stretch(j->kind, decode, elem, x, j->heads * nb, q);
        else
            for (int64_t h = 0; h < j->heads; h++)
                fused_stretch(j->kind, decode, elem, x + h * j->x_head, nb, q + h * nb * bb);
    }
}

/* the job's rows [r0, r1) on this path (blocks of 32), the element type a constant in each copy */
static void fused_rows(const struct bd_codec_job *j, int decode, int64_t r0, int64_t r1)
{
    if (j->elem == BD_CODEC_F16)
        fused_rows_elem(j, decode, r0, r1, BD_CODEC_F16);
    else if (j->elem == BD_CODEC_F32)
        fused_rows_elem(j, decode, r0, r1, BD_CODEC_F32);
    else
        fused_rows_elem(j, decode, r0, r1, BD_CODEC_BF16);
}
