/* W4A8 GEMM for small decode steps (1..~16 rows) on CPUs with AVX-512 VNNI: int4 weights in groups of 32 with
 * a float16 scale and min each (w = q * scale + min, q in 0..15), packed once at load, times activations
 * quantized here to int8 per group of 32, in two parts: the int8 rounding, then the int8 rounding of what it
 * left (each with one float scale per group and row).
 *
 * Why: a small step reads every weight once and does almost nothing else, so it should run at memory
 * bandwidth. torch's int4 CPU kernel (bfloat16 activations) read an 8192 x 2048 weight at one row at
 * ~3 GB/s of a ~27 GB/s machine, and its time grows with the rows. Here each group of 32 weights of 32
 * output channels is 640 bytes read once, unpacked with two logic ops and multiplied with vpdpbusd (weights
 * as the unsigned operand: no zero point), the rows of a step sharing each load. Why two parts: one int8
 * rounding per group cost SmolLM2 +1.1% perplexity (most of it in down_proj, whose inputs have outliers that
 * set their group's step); the second part's products cost arithmetic a step of a few rows has to spare
 * while it waits on memory, and take the activations' error to about 1/127 of that.
 *
 * Arithmetic, per row and output channel: y = sum over groups g of s_g * (a_g * sum_k xq_k q_k + b_g *
 * sum_k rq_k q_k) + m_g * (sum_k x_k), where a_g = max|x| / 127 over the group (1 where that is 0),
 * xq = rint(x / a_g), r = x - xq a_g (rounded once to float), b_g and rq the same of r, and the integer sums
 * are exact (int32). The min term takes the float activations' group sum: it needs no rounding.
 *
 * Packed layout: output channels in panels of NR = 32 (two vectors of 16; the last panel zero-padded); a
 * panel is KG = K / 32 groups of GROUP_BYTES, one after another, so a thread streams its panels in order.
 * A group: 8 blocks of 64 bytes (block 4 j + i: channels 16 j .. 16 j + 15; byte 4 c + t holds the weight
 * of k = 4 i + t in its low nibble and of k = 16 + 4 i + t in its high one), then the 32 channels' float16
 * scales, then their float16 mins.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h" /* the entry points, as ctypes calls them */

#define GROUP 32
#define NV 2
#define NR (16 * NV)
#define MR 2                         /* rows per register tile */
#define PARTS 2                      /* int8 parts per activation: the rounding and its remainder */
#define QUAD_BYTES (NR * GROUP / 2)  /* 512: the nibbles of a group */
#define GROUP_BYTES (QUAD_BYTES + 4 * NR)
/* How far ahead of the group it multiplies a thread fetches its stream into L1. Streaming 671 MB at one row
 * on one thread of a loaded Xeon, the kernel ran at a median 64-71% of a plain read's rate (torch's sum)
 * without, 73-84% at 1 KiB, no better at 2-3 KiB. */
#define PREFETCH_BYTES 1024
/* And further ahead into L2: the 1B shape's 608 MB of int4 layers at one row on 2 threads, quiet, streamed at
 * 17.3-18.0 GB/s without, 19.6-20.6 GB/s with it (4, 8 and 16 KiB alike). */
#define PREFETCH_L2_BYTES 8192

/* Whether this build has the kernel (1) or only its stubs (0: no AVX-512 VNNI at build time). */
int w4a8_available(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512VNNI__
/* One group of 32 values rounded to int8 against its own step: q = rint(x / step), step = max|x| / 127 (1
 * where that is 0); returns the step. */
static float round_group(const float *x, int8_t *q) {
    float amax = 0.0f;
    for (int t = 0; t < GROUP; t++)
        amax = fabsf(x[t]) > amax ? fabsf(x[t]) : amax;
    float step = amax / 127.0f;
    step = step == 0.0f ? 1.0f : step;
    for (int t = 0; t < GROUP; t++)
        q[t] = (int8_t)nearbyintf(x[t] / step);
    return step;
}

/* A row x [k] in the kernel's two parts: xq [PARTS][k] int8, their steps [PARTS][kg], and each group's float
 * sum [kg]. The remainder r = x - xq step is computed in double (the product is exact) and rounded once. */
static void quantize_row(const float *x, int64_t k, int8_t *xq, float *step, float *sum) {
    int64_t kg = k / GROUP;
    for (int64_t g = 0; g < kg; g++) {
        const float *xg = x + g * GROUP;
        int8_t *q = xq + g * GROUP, *rq = xq + k + g * GROUP;
        float r[GROUP], total = 0.0f;
        for (int t = 0; t < GROUP; t++)
            total += xg[t];
        step[g] = round_group(xg, q);
        for (int t = 0; t < GROUP; t++)
            r[t] = (float)((double)xg[t] - (double)q[t] * (double)step[g]);
        step[kg + g] = round_group(r, rq);
        sum[g] = total;
    }
}

/* out[r][c] for the R rows of a tile (rows ldo apart) and the `cols` valid channels of panel `w`; xq, step
 * and sum as quantize_row writes them, row after row. R is a constant at every call, so each tile height
 * compiles to its own unrolled loop. */
static inline __attribute__((always_inline)) void panel_tile(
        const int R, const uint8_t *w, int64_t kg, const int8_t *xq, int64_t k, const float *step,
        const float *sum, float *out, int64_t ldo, int cols) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MR][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < kg; g++, w += GROUP_BYTES) {
        for (int line = 0; line < GROUP_BYTES; line += 64)
            _mm_prefetch((const char *)w + PREFETCH_BYTES + line, _MM_HINT_T0);
        for (int line = 0; line < GROUP_BYTES; line += 64)
            _mm_prefetch((const char *)w + PREFETCH_L2_BYTES + line, _MM_HINT_T1);
        __m512i dots[MR][PARTS][NV];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < PARTS; p++)
                for (int j = 0; j < NV; j++)
                    dots[r][p][j] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            __m512i lo[NV], hi[NV];
            for (int j = 0; j < NV; j++) {
                __m512i v = _mm512_loadu_si512(w + (4 * j + i) * 64);
                lo[j] = _mm512_and_si512(v, low);
                hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; r++)
                for (int p = 0; p < PARTS; p++) {
                    const int8_t *xg = xq + (r * PARTS + p) * k + g * GROUP + 4 * i;
                    __m512i xl = _mm512_set1_epi32(*(const int32_t *)xg);
                    __m512i xh = _mm512_set1_epi32(*(const int32_t *)(xg + 16));
                    for (int j = 0; j < NV; j++)
                        dots[r][p][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[r][p][j], lo[j], xl), hi[j], xh);
                }
        }
        for (int j = 0; j < NV; j++) {
            __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + QUAD_BYTES + 32 * j)));
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + QUAD_BYTES + 2 * NR + 32 * j)));
            for (int r = 0; r < R; r++) {
                for (int p = 0; p < PARTS; p++) {
                    __m512 scaled = _mm512_mul_ps(s, _mm512_set1_ps(step[(r * PARTS + p) * kg + g]));
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][p][j]), scaled, acc[r][j]);
                }
                acc[r][j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sum[r * kg + g]), acc[r][j]);
            }
        }
    }
    for (int j = 0; j < NV; j++) {
        int left = cols - 16 * j;
        if (left <= 0)
            break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(out + r * ldo + 16 * j, mask, acc[r][j]);
    }
}
#endif

/* out [m, n] float32 = x W^T in the arithmetic above: x float32 [m, k] (rows lda apart, k a multiple of 32),
 * the weight packed as above. The threads split the panels. Returns 0, or -1 where the quantized
 * activations could not be allocated (nothing written). */
int w4a8_gemm(const float *x, int64_t lda, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *out) {
#ifdef __AVX512VNNI__
    int64_t kg = k / GROUP, panels = (n + NR - 1) / NR;
    int8_t *xq = malloc((size_t)(m * PARTS * k));
    float *groups = malloc((size_t)((PARTS + 1) * m * kg) * sizeof(float));
    if (xq == NULL || groups == NULL) {
        free(xq), free(groups);
        return -1;
    }
    float *step = groups, *sum = groups + PARTS * m * kg;
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * lda, k, xq + r * PARTS * k, step + r * PARTS * kg, sum + r * kg);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *w = packed + p * kg * GROUP_BYTES;
        int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
        for (int64_t t = 0; t < m; t += MR) {
            /* the first row tile reads the panel from memory; the others find it in cache */
            const int8_t *q = xq + t * PARTS * k;
            const float *st = step + t * PARTS * kg, *su = sum + t * kg;
            float *o = out + t * n + p * NR;
            if (m - t < MR)
                panel_tile(1, w, kg, q, k, st, su, o, n, cols);
            else
                panel_tile(MR, w, kg, q, k, st, su, o, n, cols);
        }
    }
    free(xq), free(groups);
    return 0;
#else
    (void)x, (void)lda, (void)m, (void)k, (void)packed, (void)n, (void)out;
    return -1;
#endif
}

/* The packed layout above of an int4 weight [n, k] in the shared format (qweight [n, k / 2]: even k in a byte's
 * low nibble; scales and mins [n, k / 32] as float16 bits), in one pass (kernels/cpu_w4a8.py's
 * pack_w4a8_reference is the same in torch: its unpacking, padding and permutes took 2.6 s of a 1B model's
 * first start on 2 cores). The last panel's channels past n are zeros. */
void w4a8_pack(const uint8_t *qweight, const uint16_t *scales, const uint16_t *mins, int64_t n, int64_t k,
               uint8_t *packed)
{
    const int64_t kg = k / GROUP, panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t pg = 0; pg < panels * kg; pg++) {
        const int64_t p = pg / kg, g = pg % kg;
        uint8_t *out = packed + pg * GROUP_BYTES;
        uint16_t *values = (uint16_t *)(out + QUAD_BYTES); /* NR scales, then NR mins */
        for (int64_t ch = 0; ch < NR; ch++) {
            const int64_t row = p * NR + ch, j = ch / 16, c = ch % 16;
            const uint8_t *q = qweight + row * (k / 2) + g * (GROUP / 2); /* the group's 16 bytes */
            for (int i = 0; i < 4; i++)
                for (int t = 0; t < 4; t++) {
                    const int lo = 4 * i + t, hi = lo + 16; /* k in the group of the byte's two nibbles */
                    const uint8_t a = row < n ? (q[lo / 2] >> (4 * (lo & 1))) & 15 : 0;
                    const uint8_t b = row < n ? (q[hi / 2] >> (4 * (hi & 1))) & 15 : 0;
                    out[(4 * j + i) * 64 + 4 * c + t] = (uint8_t)(a | (b << 4));
                }
            values[ch] = row < n ? scales[row * kg + g] : 0;
            values[NR + ch] = row < n ? mins[row * kg + g] : 0;
        }
    }
}

/* The inverse of w4a8_pack: the weight's first n channels back in the shared format (qweight [n, k / 2],
 * scales and mins [n, k / 32] as float16 bits), where torch's int4 layout is made from them (kernels/cpu_w4a8.py's
 * unpack_w4a8_reference is the same in torch, ~10x slower). */
void w4a8_unpack(const uint8_t *packed, int64_t n, int64_t k, uint8_t *qweight, uint16_t *scales, uint16_t *mins)
{
    const int64_t kg = k / GROUP, panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t pg = 0; pg < panels * kg; pg++) {
        const int64_t p = pg / kg, g = pg % kg;
        const uint8_t *in = packed + pg * GROUP_BYTES;
        const uint16_t *values = (const uint16_t *)(in + QUAD_BYTES);
        for (int64_t ch = 0; ch < NR && p * NR + ch < n; ch++) {
            const int64_t row = p * NR + ch, j = ch / 16, c = ch % 16;
            uint8_t *q = qweight + row * (k / 2) + g * (GROUP / 2);
            for (int b = 0; b < GROUP / 2; b++) {
                uint8_t byte = 0;
                for (int half = 0; half < 2; half++) { /* k = 2 b + half of the group: nibble h of its byte */
                    const int kk = 2 * b + half, h = kk / 16, i = kk % 16 / 4, t = kk % 4;
                    byte |= (uint8_t)(((in[(4 * j + i) * 64 + 4 * c + t] >> (4 * h)) & 15) << (4 * half));
                }
                q[b] = byte;
            }
            scales[row * kg + g] = values[ch];
            mins[row * kg + g] = values[NR + ch];
        }
    }
}
