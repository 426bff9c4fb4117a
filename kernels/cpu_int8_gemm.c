/* W8A8 GEMM for CPUs with AVX-512 VNNI: uint8 activations (zero point 128) times an int8 weight packed once
 * into panels, float32 products scaled per output channel, the zero point's correction applied in the same
 * pass.
 *
 * Why native code: oneDNN (behind torch._int_mm and its packed GEMM) reached 76% of this CPU's int8 peak at
 * 64 rows with a layer's weights in cache, and less with a step's weights streaming from memory; decode
 * steps at 64-256 rows are where W8A8 runs. This kernel is one register tile and a loop around it.
 *
 * Layout of the packed weight: output channels in panels of NR = 48 (three 16-lane vectors), the last panel
 * zero-padded; inside a panel, for each group of four k, the 48 channels' four int8 weights side by side
 * (192 bytes), as vpdpbusd multiplies them: panel p, group g, channel c, lane j at
 * ((p * K4 + g) * NR + c) * 4 + j, with K4 = ceil(K / 4) groups (k past K padded with zeros).
 *
 * Tile: MR = 8 rows x NR channels in 24 int32 accumulators. Each group of four k loads the panel's three
 * weight vectors once and broadcasts each row's four activations: 24 vpdpbusd per 3 loads and 8
 * broadcasts. Rows of a tile share the panel, which stays in L1/L2 while the row tiles pass over it.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 8
#define NV 3 /* vectors of 16 channels per panel */
#define NR (16 * NV)
#define STREAM_BYTES (8 << 20)

#ifdef __AVX512VNNI__

/* acc[r][j] += sum over k of a[r][k] * panel[k][16 j ...]: rows r < MR of a (lda apart), groups g < k4. */
static inline void tile(const uint8_t *a, int64_t lda, const int8_t *panel, int64_t k4, __m512i out[MR][NV]) {
    __m512i acc[MR][NV]; /* a local array, so that the compiler keeps it in registers */
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++)
            acc[r][j] = _mm512_setzero_si512();
    for (int64_t g = 0; g < k4; g++) {
        const int8_t *w = panel + g * NR * 4;
        __m512i wv[NV];
        for (int j = 0; j < NV; j++)
            wv[j] = _mm512_loadu_si512(w + 64 * j);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            int32_t four;
            memcpy(&four, a + r * lda + g * 4, 4);
            __m512i x = _mm512_set1_epi32(four);
            for (int j = 0; j < NV; j++)
                acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], x, wv[j]);
        }
    }
    memcpy(out, acc, sizeof acc);
}

/* out[r][c] = (acc[r][c] - correction[c]) * scale[c] for rows r < rows, channels c < cols (of the panel);
 * `stream`: whole vectors bypass the caches (out and ldo aligned to 64 bytes). */
static inline void store(__m512i acc[MR][NV], int rows, int cols, const int32_t *correction, const float *scale,
                         float *out, int64_t ldo, int stream) {
    for (int j = 0; j < NV; j++) {
        int left = cols - 16 * j;
        if (left <= 0)
            break;
        __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512i corr = _mm512_maskz_loadu_epi32(m, correction + 16 * j);
        __m512 s = _mm512_maskz_loadu_ps(m, scale + 16 * j);
        for (int r = 0; r < rows; r++) {
            __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], corr)), s);
            if (stream && left >= 16)
                _mm512_stream_ps(out + r * ldo + 16 * j, y);
            else
                _mm512_mask_storeu_ps(out + r * ldo + 16 * j, m, y);
        }
    }
}

#endif

/* Whether this build has the kernel (1) or only its stubs (0: no AVX-512 VNNI at build time). */
int int8_gemm_available(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

/* out [m, n] float32 = ((u - 128) . W^T) * scale: u uint8 [m, k] (rows lda apart), the weight packed as
 * above with correction[c] = 128 * sum_k W[c][k] (int32 [n]) and scale float32 [n]. Returns 0, or -1 where
 * the padded copy of the rows below could not be allocated (nothing written). */
int int8_gemm(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed, const int32_t *correction,
              const float *scale, int64_t n, float *out) {
#ifdef __AVX512VNNI__
    int64_t k4 = (k + 3) / 4, panels = (n + NR - 1) / NR, tiles = (m + MR - 1) / MR;
    int64_t padded = k4 * 4;
    /* Rows are read in place in whole tiles; the rows of a partial last tile (every row, where k is not a
     * multiple of 4) are copied once into whole tiles padded with zeros (u = 128). */
    int64_t in_place = padded == k ? m / MR * MR : 0;
    uint8_t *spare = NULL;
    if (in_place < m) {
        size_t bytes = (size_t)((tiles - in_place / MR) * MR * padded);
        spare = malloc(bytes);
        if (spare == NULL)
            return -1;
        memset(spare, 128, bytes);
        for (int64_t r = in_place; r < m; r++)
            memcpy(spare + (r - in_place) * padded, u + r * lda, (size_t)k);
    }
    /* An output larger than the caches (an LM head's logits) is written with streaming stores: it will not be
     * read again before it leaves the caches, and a plain store first reads each line it writes. On a Zen 4,
     * SmolLM2's head at 256 rows: 16.8 ms against 19.4. */
    int stream = m * n * (int64_t)sizeof(float) > STREAM_BYTES && n % 16 == 0 && (uintptr_t)out % 64 == 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int8_t *panel = packed + p * k4 * NR * 4;
            int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            for (int64_t t = 0; t < tiles; t++) {
                int rows = m - t * MR < MR ? (int)(m - t * MR) : MR;
                int own = t * MR < in_place;
                const uint8_t *a = own ? u + t * MR * lda : spare + (t * MR - in_place) * padded;
                __m512i acc[MR][NV];
                tile(a, own ? lda : padded, panel, k4, acc);
                store(acc, rows, cols, correction + p * NR, scale + p * NR, out + t * MR * n + p * NR, n, stream);
            }
        }
        if (stream)
            _mm_sfence(); /* the streamed lines are visible before the caller reads them */
    }
    free(spare);
#else
    (void)u, (void)lda, (void)m, (void)k, (void)packed, (void)correction, (void)scale, (void)n, (void)out;
#endif
    return 0;
}

/* Pack w int8 [n, k] (rows k apart) into panels (`packed`: ceil(n / NR) * ceil(k / 4) * NR * 4 bytes) and
 * write correction[c] = 128 * sum_k w[c][k]. */
void int8_gemm_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed, int32_t *correction) {
    int64_t k4 = (k + 3) / 4, panels = (n + NR - 1) / NR;
    memset(packed, 0, (size_t)(panels * k4 * NR * 4));
    for (int64_t c = 0; c < n; c++) {
        int64_t p = c / NR, lane = c % NR, sum = 0;
        for (int64_t i = 0; i < k; i++) {
            packed[((p * k4 + i / 4) * NR + lane) * 4 + i % 4] = w[c * k + i];
            sum += w[c * k + i];
        }
        correction[c] = (int32_t)(128 * sum);
    }
}
