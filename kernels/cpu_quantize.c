/* Round-to-nearest weight quantization at load, one pass per group, and its inverse: kernels/wq_reference.py's
 * quantize_int4, quantize_int8 and dequantize, bit for bit.
 *
 * Why native code: the torch reference makes five to eight elementwise passes over every weight (min, max,
 * subtract, divide, round, clamp, pack), each a kernel launch over a cache-sized slice; on a 1B-parameter
 * model that was most of a first start (tens of seconds on 2 cores). Here each group of a row is read once
 * into registers and written once, rows split between torch's OpenMP threads.
 *
 * Exactness: the same IEEE float32 operations in the same order as the reference (no -ffast-math, no
 * contraction: see the pragma), scales and mins rounded to float16 to nearest even, q rounded half to even
 * (nearbyintf in the default rounding mode, as torch.round). Inputs are float32 or bfloat16 (widened exactly).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h" /* the entry points, as ctypes calls them */

#pragma GCC optimize("fp-contract=off") /* a * b + c must not become one fused rounding */

/* Row r's k values widened to float32 in out: from float32 (bf16 == 0) or bfloat16 bits. */
static void widen_row(const void *w, int bf16, int64_t r, int64_t k, float *out)
{
    if (!bf16) {
        const float *src = (const float *)w + r * k;
        for (int64_t c = 0; c < k; c++)
            out[c] = src[c];
        return;
    }
    const uint16_t *src = (const uint16_t *)w + r * k;
    for (int64_t c = 0; c < k; c++) {
        const uint32_t bits = (uint32_t)src[c] << 16;
        float f;
        __builtin_memcpy(&f, &bits, sizeof f);
        out[c] = f;
    }
}

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* One int4 group of g values x: its float16 scale and min, q packed two per byte into out (scalar). */
static void quantize_int4_group(const float *x, int64_t g, uint8_t *out, _Float16 *scale, _Float16 *min)
{
    float lo = x[0], hi = x[0];
    for (int64_t c = 1; c < g; c++) {
        lo = x[c] < lo ? x[c] : lo;
        hi = x[c] > hi ? x[c] : hi;
    }
    const _Float16 s16 = (_Float16)((hi - lo) / 15.0f), m16 = (_Float16)lo;
    *scale = s16, *min = m16;
    const float m = (float)m16, s = (float)s16 == 0.0f ? 1.0f : (float)s16;
    for (int64_t c = 0; c < g; c += 2) {
        const uint8_t even = (uint8_t)clampf(nearbyintf((x[c] - m) / s), 0.0f, 15.0f);
        const uint8_t odd = (uint8_t)clampf(nearbyintf((x[c + 1] - m) / s), 0.0f, 15.0f);
        out[c / 2] = (uint8_t)(even | (odd << 4));
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* `quantize_int4_group` for g a multiple of 16, sixteen values per vector: the same IEEE operations on each
 * value (subtract, divide, round half to even, clamp), so the same bits. Groups where the scalar's
 * comparisons could pick between values vectors do not tell apart (a NaN, an infinity, a signed zero at the
 * min or max) go to the scalar code. An 8192 x 2048 weight on 2 cores: 15 ms against 48-53 (a 1B model's
 * first start spent 4-8 s in the scalar pass). */
static void quantize_int4_group_vectors(const float *x, int64_t g, uint8_t *out, _Float16 *scale, _Float16 *min)
{
    __m512 lo = _mm512_loadu_ps(x), hi = lo;
    __mmask16 nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q);
    for (int64_t c = 16; c < g; c += 16) {
        const __m512 v = _mm512_loadu_ps(x + c);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        lo = _mm512_min_ps(lo, v), hi = _mm512_max_ps(hi, v);
    }
    const float low = _mm512_reduce_min_ps(lo), high = _mm512_reduce_max_ps(hi);
    if (nan || !isfinite(low) || !isfinite(high) || low == 0.0f || high == 0.0f) {
        quantize_int4_group(x, g, out, scale, min);
        return;
    }
    const _Float16 s16 = (_Float16)((high - low) / 15.0f), m16 = (_Float16)low;
    *scale = s16, *min = m16;
    const __m512 m = _mm512_set1_ps((float)m16), s = _mm512_set1_ps((float)s16 == 0.0f ? 1.0f : (float)s16);
    const __m512 zero = _mm512_setzero_ps(), fifteen = _mm512_set1_ps(15.0f);
    const __m512i nibble = _mm512_set1_epi64(15), high_nibble = _mm512_set1_epi64(0xF0);
    for (int64_t c = 0; c < g; c += 16) {
        __m512 q = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + c), m), s);
        q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, zero), fifteen));
        /* 64-bit lane i holds values 2i (low half) and 2i + 1 (high half): one byte of two nibbles */
        const __m512i pairs = _mm512_or_si512(_mm512_and_si512(v, nibble),
                                              _mm512_and_si512(_mm512_srli_epi64(v, 28), high_nibble));
        _mm_storel_epi64((__m128i *)(out + c / 2), _mm512_cvtepi64_epi8(pairs));
    }
}
#endif

/* Asymmetric int4 per group of g: scale = fp16((max - min) / 15), min = fp16(min), q = round((w - min) / scale)
 * in 0..15 (scale 0 divides by 1), packed two per byte (even k in the low nibble). g even, k % g == 0. */
void quantize_int4(const void *w, int bf16, int64_t n, int64_t k, int64_t g, uint8_t *packed, _Float16 *scales,
                   _Float16 *mins)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float row[k];
        widen_row(w, bf16, r, k, row);
        for (int64_t j = 0; j < k / g; j++) {
            const int64_t at = r * (k / g) + j;
            uint8_t *out = packed + (r * k + j * g) / 2;
#ifdef __AVX512F__
            if (g % 16 == 0) {
                quantize_int4_group_vectors(row + j * g, g, out, scales + at, mins + at);
                continue;
            }
#endif
            quantize_int4_group(row + j * g, g, out, scales + at, mins + at);
        }
    }
}

#ifdef __AVX512F__
/* The scalar loop's max |x| of a group of g values (g % 16 == 0), or -1 where one is NaN or infinite (the scalar
 * code's comparisons decide those). */
static float group_absmax_vectors(const float *x, int64_t g)
{
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __m512 top = _mm512_setzero_ps();
    __mmask16 odd = 0;
    for (int64_t c = 0; c < g; c += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + c));
        odd |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a, inf, _CMP_EQ_OQ);
        top = _mm512_max_ps(top, a);
    }
    return odd ? -1.0f : _mm512_reduce_max_ps(top);
}

/* The scalar loop's q = clamp(round(x / s), -bound, bound) of g finite values (g % 16 == 0), sixteen at once. */
static void round_int8_vectors(const float *x, int64_t g, float s, float bound, int8_t *out)
{
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(bound), lo = _mm512_set1_ps(-bound);
    for (int64_t c = 0; c < g; c += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + c), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        _mm_storeu_si128((__m128i *)(out + c), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
    }
}
#endif

/* Symmetric int8 per group of g: scale = max|w| / bound (float32 where g == k, else rounded to float16),
 * q = round(w / scale) in -bound..bound (scale 0 divides by 1). k % g == 0. Groups of finite values whose
 * size is a multiple of 16 take the AVX-512 loops: the same operations, the same bits (a 1B model's
 * calibrated int8 weights: ~1 s of its first start in the scalar ones on 2 cores; an 8192 x 2048 weight per
 * channel: 6-11 ms against 16-29). */
void quantize_int8(const void *w, int bf16, int64_t n, int64_t k, int64_t g, float bound, int8_t *q,
                   float *scales32, _Float16 *scales16)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        float row[k];
        widen_row(w, bf16, r, k, row);
        for (int64_t j = 0; j < k / g; j++) {
            const float *x = row + j * g;
            float top = -1.0f;
#ifdef __AVX512F__
            if (g % 16 == 0)
                top = group_absmax_vectors(x, g);
#endif
            const int vectors = top >= 0.0f;
            if (!vectors) {
                top = 0.0f;
                for (int64_t c = 0; c < g; c++)
                    top = fabsf(x[c]) > top ? fabsf(x[c]) : top;
            }
            float s = top / bound;
            if (scales16) {
                const _Float16 s16 = (_Float16)s;
                scales16[r * (k / g) + j] = s16;
                s = (float)s16;
            } else {
                scales32[r * (k / g) + j] = s;
            }
            s = s == 0.0f ? 1.0f : s;
            int8_t *out = q + r * k + j * g;
#ifdef __AVX512F__
            if (vectors) {
                round_int8_vectors(x, g, s, bound, out);
                continue;
            }
#endif
            for (int64_t c = 0; c < g; c++)
                out[c] = (int8_t)clampf(nearbyintf(x[c] / s), -bound, bound);
        }
    }
}

/* w = q * scale (+ min) per group of g, in float32: q int4 (packed two per byte, 0..15) or int8 (signed);
 * scales and mins (NULL: none) float32 [n, k / g]. Two roundings (product, then sum), as the reference. */
#ifdef __AVX512F__
/* The first g - g % 32 values of an int4 group (16 bytes per 32 values) into w: each byte's two nibbles
 * widened to int32 lanes, put in k order (low nibble first) by one two-source permute each, converted (exact),
 * times s, plus m where the format has mins. Returns how many values it wrote. */
static int64_t dequantize_int4_vectors(const uint8_t *p, int64_t g, float s, float m, int with_min, float *w)
{
    const __m512i nibble = _mm512_set1_epi32(15);
    /* lanes 0..15 of a permute index pick from the first source (low nibbles), 16..31 from the second */
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
    int64_t c = 0;
    for (; c + 32 <= g; c += 32) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + c / 2)));
        const __m512i low = _mm512_and_si512(bytes, nibble), high = _mm512_srli_epi32(bytes, 4);
        __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(low, first, high)), vs);
        __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(low, second, high)), vs);
        if (with_min)
            a = _mm512_add_ps(a, vm), b = _mm512_add_ps(b, vm);
        _mm512_storeu_ps(w + c, a);
        _mm512_storeu_ps(w + c + 16, b);
    }
    return c;
}
#endif

void dequantize(const void *q, int bits, int64_t n, int64_t k, int64_t g, const float *scales, const float *mins,
                float *out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t j = 0; j < k / g; j++) {
            const float s = scales[r * (k / g) + j], m = mins ? mins[r * (k / g) + j] : 0.0f;
            float *w = out + r * k + j * g;
            if (bits == 4) {
                const uint8_t *p = (const uint8_t *)q + (r * k + j * g) / 2;
                int64_t c = 0;
#ifdef __AVX512F__
                c = dequantize_int4_vectors(p, g, s, m, mins != NULL, w);
#endif
                for (; c < g; c += 2) {
                    const float even = (float)(p[c / 2] & 15) * s, odd = (float)(p[c / 2] >> 4) * s;
                    w[c] = mins ? even + m : even;
                    w[c + 1] = mins ? odd + m : odd;
                }
            } else {
                const int8_t *p = (const int8_t *)q + r * k + j * g;
                for (int64_t c = 0; c < g; c++)
                    w[c] = mins ? (float)p[c] * s + m : (float)p[c] * s;
            }
        }
    }
}

int quantize_available(void) { return 1; }
