/* A run of decoder layers for a decode step on CPU, in one native call: W8A8, or weight-only on int4 weights
 * (the W4A8 GEMM of small steps).
 *
 * Why native code: at 64 rows a compiled SmolLM2 step spent about a quarter of its main thread between
 * kernels (graph guards and wrappers, operator dispatch, the Python around each GEMM and attention call),
 * while the second thread waited. Here a layer's elementwise passes (RMSNorm, smoothing and per-row int8
 * quantization, RoPE, SiLU x up, the residual adds) are plain loops over the rows, and its GEMMs and
 * attention are called directly: the native int8 GEMM (kernels/cpu_int8_gemm.c) and the paged attention's
 * write and decode (kernels/cpu_attention.c), passed in as function pointers so that each keeps its own
 * build.
 *
 * The arithmetic is the model's W8A8 layer (pipeline/model/llama.py with pipeline/model/quant.py): each
 * linear's input times its smoothing vector, rounded per row to uint8 with zero point 128 (scale
 * max|y| / 127, round half to even, as kernels/w8a8_reference.py's quantize_rows), the GEMM's float32
 * products times the row's scale. A weight-only step is the model's layer with its int4 linears on the W4A8
 * GEMM (kernels/cpu_w4a8_gemm.c, passed in as the others are): the same passes, the GEMM's input the float
 * activations. Float32 throughout; sums may round differently from torch's in the last bits (as compiled
 * graphs' do).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "cpu_kernels.h" /* struct linear, layer and step, and the kernels' entry points */

#if defined(__AVX512F__) && defined(__AVX512BW__)

typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
static inline vec splat(float x) { return (vec){0} + x; }
#include "cpu_vexp.h"

#define PARALLEL_MIN 16384 /* elements of a pass below which the second thread's wake-up costs more */

#ifdef __AVX512BF16__
#define HAVE_LORA_BF16 1 /* the deltas on bfloat16 pairs: AVX-512 BF16's dot products, or AMX's tiles */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define HAVE_LORA_TILES 1
#include "cpu_amx.h"
#endif
#endif

static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
static inline __m512 load(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void store(float *p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }

/* u = round(y / s) + 128 (uint8) with s = max|y| / 127, or 1 for an all-zero row; returns s. */
static float quantize_row(const float *y, int64_t k, uint8_t *u)
{
    __m512 top = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(load(y + c, lanes(k - c))));
    float s = _mm512_reduce_max_ps(top) / 127.0f;
    if (s == 0.0f)
        s = 1.0f;
    const __m512 vs = _mm512_set1_ps(s), zero_point = _mm512_set1_ps(128.0f);
    for (int64_t c = 0; c < k; c += 16) {
        __mmask16 m = lanes(k - c);
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load(y + c, m), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_mask_storeu_epi8(u + c, m, _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_add_ps(q, zero_point))));
    }
    return s;
}

void quantize_rows(const float *x, int64_t m, int64_t k, uint8_t *u, float *scales)
{
#pragma omp parallel for if (m * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < m; r++) {
        const float *y = x + r * k;
        __m512 nonfinite = _mm512_setzero_ps(); /* 0 * y: NaN where y is NaN or infinite */
        for (int64_t c = 0; c < k; c += 16)
            nonfinite = _mm512_add_ps(nonfinite, _mm512_mul_ps(load(y + c, lanes(k - c)), _mm512_setzero_ps()));
        scales[r] = quantize_row(y, k, u + r * k);
        if (_mm512_reduce_add_ps(nonfinite) != 0.0f)
            scales[r] = NAN;
    }
}

/* LoRA deltas, a run of up to LORA_ROWS consecutive rows of one adapter slot at a time: each A^T row and B^T
 * vector loaded once serves all of them (row by row, the pairs' reads from cache bounded the deltas). */
#define LORA_ROWS 8

/* The LoRA adapter slot row r runs on linear l, or -1 (the base model alone, or no pair for l). */
static inline int64_t lora_slot(const struct linear *l, const struct step *s, int64_t r)
{
    return l->lora_a && s->lora_slots ? s->lora_slots[r] : -1;
}

/* The end of the run of rows from r on with r's slot, at most LORA_ROWS rows and before `end`. */
static inline int64_t run_end(const int64_t *slots, int64_t r, int64_t end)
{
    int64_t e = r + 1;
    while (e < end && e - r < LORA_ROWS && slots[e] == slots[r])
        e++;
    return e;
}

/* t [g, rank] = x [g, k] A^T [k, rank] / sx (sx NULL: 1): each A^T row's vector of 16 ranks times a broadcast
 * input element of every row. g is a constant where it is inlined (one accumulator a row). */
static inline __attribute__((always_inline)) void project_rows(const float *x, int64_t k, const float *a, int64_t rank,
                                                               const float *sx, float *t, int64_t t_stride, const int g)
{
    for (int64_t j = 0; j < rank; j += 16) {
        const __mmask16 m = lanes(rank - j);
        __m512 acc[LORA_ROWS];
        for (int i = 0; i < g; i++)
            acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c++) {
            const __m512 ac = load(a + c * rank + j, m);
            for (int i = 0; i < g; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * k + c]), ac, acc[i]);
        }
        for (int i = 0; i < g; i++)
            store(t + i * t_stride + j, m, sx ? _mm512_div_ps(acc[i], _mm512_set1_ps(sx[i])) : acc[i]);
    }
}

/* Lanes of a vector that starts `left` values before the end of a row (none at or past it). */
static inline __mmask16 lanes_left(int64_t left) { return left <= 0 ? 0 : lanes(left); }

/* The ranks [*lo, *hi) of B^T that the `blocks` blocks of 16 columns from c need (those before `cols`): their
 * bands' (a band [2] for each 16 columns, as struct linear's lora_band; NULL: all `rank`). */
static inline void rank_range(const int32_t *band, int64_t c, int64_t cols, int64_t rank, int blocks, int64_t *lo,
                              int64_t *hi)
{
    if (!band) {
        *lo = 0, *hi = rank;
        return;
    }
    *lo = rank, *hi = 0;
    for (int q = 0; q < blocks && c + 16 * q < cols; q++) {
        const int32_t *b = band + (c / 16 + q) * 2;
        *lo = b[0] < *lo ? b[0] : *lo;
        *hi = b[1] > *hi ? b[1] : *hi;
    }
}

/* out [g, cols] = y [g, cols] + t [g, rank] B^T [rank, cols] (out may be y; rows of y, out and B^T ld_y, ld_out
 * and ld_b apart): 32 columns of every row at a time, each B^T vector times a broadcast rank value of every
 * row, over the ranks the columns' bands need (the others' B^T is zero: skipped, the sums are the same). g as
 * in project_rows. */
static inline __attribute__((always_inline)) void expand_rows(const float *t, int64_t t_stride, const float *b,
                                                              int64_t ld_b, const int32_t *band, int64_t rank,
                                                              int64_t cols, const float *y, int64_t ld_y, float *out,
                                                              int64_t ld_out, const int g)
{
    for (int64_t c = 0; c < cols; c += 32) {
        const __mmask16 m0 = lanes_left(cols - c), m1 = lanes_left(cols - c - 16);
        __m512 lo[LORA_ROWS], hi[LORA_ROWS];
        for (int i = 0; i < g; i++)
            lo[i] = load(y + i * ld_y + c, m0), hi[i] = load(y + i * ld_y + c + 16, m1);
        int64_t first, end;
        rank_range(band, c, cols, rank, 2, &first, &end);
        for (int64_t j = first; j < end; j++) {
            const __m512 b0 = load(b + j * ld_b + c, m0), b1 = load(b + j * ld_b + c + 16, m1);
            for (int i = 0; i < g; i++) {
                const __m512 tj = _mm512_set1_ps(t[i * t_stride + j]);
                lo[i] = _mm512_fmadd_ps(tj, b0, lo[i]);
                hi[i] = _mm512_fmadd_ps(tj, b1, hi[i]);
            }
        }
        for (int i = 0; i < g; i++)
            store(out + i * ld_out + c, m0, lo[i]), store(out + i * ld_out + c + 16, m1, hi[i]);
    }
}

/* project_rows and expand_rows for a run of g (1 .. LORA_ROWS) rows, each inlined with its g a constant. */
#define BY_ROWS(call, g)                                                                                                \
    switch (g) {                                                                                                       \
    case 1: call(1); break;                                                                                            \
    case 2: call(2); break;                                                                                            \
    case 3: call(3); break;                                                                                            \
    case 4: call(4); break;                                                                                            \
    case 5: call(5); break;                                                                                            \
    case 6: call(6); break;                                                                                            \
    case 7: call(7); break;                                                                                            \
    default: call(8); break;                                                                                           \
    }

static void project_run(const float *x, int64_t k, const float *a, int64_t rank, const float *sx, float *t,
                        int64_t t_stride, int64_t g)
{
#define PROJECT(G) project_rows(x, k, a, rank, sx, t, t_stride, G)
    BY_ROWS(PROJECT, g)
#undef PROJECT
}

static void expand_run(const float *t, int64_t t_stride, const float *b, int64_t ld_b, const int32_t *band,
                       int64_t rank, int64_t cols, const float *y, int64_t ld_y, float *out, int64_t ld_out, int64_t g)
{
#define EXPAND(G) expand_rows(t, t_stride, b, ld_b, band, rank, cols, y, ld_y, out, ld_out, G)
    BY_ROWS(EXPAND, g)
#undef EXPAND
}

void lora_delta(const float *x, const float *y, float *out, const int64_t *slots, int64_t slotted, int64_t rows,
                int64_t k, int64_t n, const float *a, const float *b, int64_t rank)
{
    if (rows > slotted) /* rows past the adapters' copy y */
        memcpy(out + slotted * n, y + slotted * n, (size_t)((rows - slotted) * n) * sizeof(float));
#pragma omp parallel for if (slotted * n >= PARALLEL_MIN)
    for (int64_t lo = 0; lo < slotted; lo += LORA_ROWS) {
        float t[LORA_ROWS * rank];
        const int64_t end = lo + LORA_ROWS < slotted ? lo + LORA_ROWS : slotted;
        for (int64_t r = lo, e; r < end; r = e) {
            e = run_end(slots, r, end);
            if (slots[r] < 0) {
                memcpy(out + r * n, y + r * n, (size_t)((e - r) * n) * sizeof(float));
                continue;
            }
            project_run(x + r * k, k, a + slots[r] * k * rank, rank, NULL, t, rank, e - r);
            expand_run(t, rank, b + slots[r] * rank * n, n, NULL, rank, n, y + r * n, n, out + r * n, n, e - r);
        }
    }
}

#ifdef HAVE_LORA_BF16
/* The deltas on bfloat16 pairs (struct linear's lora_a16 and lora_b16), as AMX's tiles or AVX-512 BF16's dot
 * products multiply them: inputs and projections rounded to bfloat16, products and sums float32 (the deltas'
 * error is bfloat16's, well inside the W8A8 products' they are added to). A dot product instruction multiplies
 * 16 columns by a pair of k (or rank) values, twice the float32 loops' 16 multiply-adds, from half the bytes.
 * SmolLM2, 256 rows over 8 adapters of rank 16: see docs/performance.md. */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* dst [kp] = src [k] in bfloat16 (round to nearest even), zeros past k. */
static inline void to_bf16(const float *src, int64_t k, uint16_t *dst, int64_t kp)
{
    for (int64_t c = 0; c < kp; c += 16)
        _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)_mm512_cvtneps_pbh(load(src + c, lanes_left(k - c))));
}

/* Values a row of s->lora_x16 takes for l: its input, then its projections, in bfloat16 (each up to a
 * multiple of 32). */
static inline int64_t x16_stride(const struct linear *l)
{
    const int64_t kp = round_up(l->k, 32), rp = round_up(l->lora_rank, 32);
    return kp > rp ? kp : rp;
}

/* The pair of bfloat16 values at p in every 32-bit lane: the row operand of a dot product. */
static inline __m512bh pair(const uint16_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* t [g, rank] (rows rp apart) = xb [g, kp] (bfloat16, rows ld apart) A^T [kp, rank] / sx, from a slot's
 * lora_a16 (16 ranks at a time, each k pair's 16 x 2 values one vector). g as in project_rows. */
static inline __attribute__((always_inline)) void project_dot_rows(const uint16_t *xb, int64_t ld, int64_t kp,
                                                                   const uint16_t *a, int64_t rank, const float *sx,
                                                                   float *t, int64_t rp, const int g)
{
    for (int64_t j = 0; j < rank; j += 16, a += kp * 16) {
        __m512 acc[LORA_ROWS];
        for (int i = 0; i < g; i++)
            acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < kp; c += 2) {
            const __m512bh ac = (__m512bh)_mm512_loadu_si512(a + c * 16);
            for (int i = 0; i < g; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], pair(xb + i * ld + c), ac);
        }
        for (int i = 0; i < g; i++)
            store(t + i * rp + j, 0xFFFF, _mm512_div_ps(acc[i], _mm512_set1_ps(sx[i])));
    }
}

/* out [g, cols] += tb [g, rank] (bfloat16 projections, rows ld_t apart) B^T [rank, cols] from lora_b16 at the
 * first of the columns (c0's block; bp ranks a block), 48 columns at a time (an int8 GEMM panel's, NR: three
 * vectors a row) over the pairs of ranks their bands need (band: c0's; NULL: all). A block past the last
 * column reads the block before's B^T again (its sums masked off), not past it. g as in project_rows. */
static inline __attribute__((always_inline)) void expand_dot_rows(const uint16_t *tb, int64_t ld_t, const uint16_t *b,
                                                                  int64_t bp, const int32_t *band, int64_t rank,
                                                                  int64_t cols, float *out, int64_t ld, const int g)
{
    for (int64_t c = 0; c < cols; c += 48) {
        const __mmask16 m0 = lanes_left(cols - c), m1 = lanes_left(cols - c - 16), m2 = lanes_left(cols - c - 32);
        const uint16_t *b0 = b + c / 16 * bp * 16, *b1 = m1 ? b0 + bp * 16 : b0, *b2 = m2 ? b1 + bp * 16 : b1;
        __m512 s0[LORA_ROWS], s1[LORA_ROWS], s2[LORA_ROWS];
        for (int i = 0; i < g; i++) {
            s0[i] = load(out + i * ld + c, m0);
            s1[i] = load(out + i * ld + c + 16, m1);
            s2[i] = load(out + i * ld + c + 32, m2);
        }
        int64_t first, end;
        rank_range(band, c, cols, rank, 3, &first, &end);
        for (int64_t j = first / 2 * 2; j < end; j += 2) { /* a pair past `end`: B^T's zeros (up to bp) */
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + j * 16), v1 = (__m512bh)_mm512_loadu_si512(b1 + j * 16),
                           v2 = (__m512bh)_mm512_loadu_si512(b2 + j * 16);
            for (int i = 0; i < g; i++) {
                const __m512bh tj = pair(tb + i * ld_t + j);
                s0[i] = _mm512_dpbf16_ps(s0[i], tj, v0);
                s1[i] = _mm512_dpbf16_ps(s1[i], tj, v1);
                s2[i] = _mm512_dpbf16_ps(s2[i], tj, v2);
            }
        }
        for (int i = 0; i < g; i++) {
            store(out + i * ld + c, m0, s0[i]);
            store(out + i * ld + c + 16, m1, s1[i]);
            store(out + i * ld + c + 32, m2, s2[i]);
        }
    }
}

/* lora_project on dot products, for a run of g rows from r of one slot: their inputs x (rows k apart) in
 * bfloat16 into s->lora_x16, their projections from them, then those in bfloat16 in the inputs' place, where
 * expand_dots reads them. */
static void project_dots(const struct linear *l, const struct step *s, const float *x, int64_t r, int64_t g)
{
    const int64_t k = l->k, kp = round_up(k, 32), rank = l->lora_rank, rp = round_up(rank, 32), ld = x16_stride(l);
    const int64_t slot = s->lora_slots[r], blocks = (rank + 15) / 16;
    uint16_t *xb = s->lora_x16 + r * ld;
    float t[LORA_ROWS * rp];
    for (int64_t i = 0; i < g; i++)
        to_bf16(x + (r + i) * k, k, xb + i * ld, kp);
#define PROJECT(G) project_dot_rows(xb, ld, kp, l->lora_a16 + slot * blocks * kp * 16, rank, s->sx + r, t, rp, G)
    BY_ROWS(PROJECT, g)
#undef PROJECT
    for (int64_t i = 0; i < g; i++)
        to_bf16(t + i * rp, rank, xb + i * ld, rp);
}

/* add_deltas on dot products: a run of g rows from r of one slot, columns c0 .. c0 + cols - 1 (c0 a multiple
 * of 16) of out (rows ld apart). */
static void expand_dots(const struct linear *l, const struct step *s, int64_t r, int64_t g, int64_t c0, int64_t cols,
                        float *out, int64_t ld)
{
    const int64_t rank = l->lora_rank, bp = round_up(rank, 16), col_blocks = (l->n + 15) / 16, xs = x16_stride(l);
    const uint16_t *b = l->lora_b16 + (s->lora_slots[r] * col_blocks + c0 / 16) * bp * 16;
    const int32_t *band = l->lora_band ? l->lora_band + c0 / 16 * 2 : NULL;
#define EXPAND(G) expand_dot_rows(s->lora_x16 + r * xs, xs, b, bp, band, rank, cols, out, ld, G)
    BY_ROWS(EXPAND, g)
#undef EXPAND
}

/* The B^T that the row tile from `next` will read in these columns, fetched into L1 now: between two tiles'
 * hooks the GEMM streams its weight panel through L1, so expand_dots met its B^T there cold each time (on a
 * Zen 4, SmolLM2 at 256 rows over 8 adapters: a quarter of its samples on those loads; the deltas' samples
 * 0.20 -> 0.18 of the GEMMs'). Not the tile's projections: fetching them too cost more than it saved. */
static void prefetch_next_tile(const struct linear *l, const struct step *s, int64_t next, int64_t c0, int64_t cols)
{
    if (next >= s->rows || s->lora_slots[next] < 0)
        return;
    const int64_t bp = round_up(l->lora_rank, 16), col_blocks = (l->n + 15) / 16;
    const char *b = (const char *)(l->lora_b16 + (s->lora_slots[next] * col_blocks + c0 / 16) * bp * 16);
    for (int64_t i = 0; i < (cols + 15) / 16 * bp * 32; i += 64)
        _mm_prefetch(b + i, _MM_HINT_T0);
}
#endif

#ifdef HAVE_LORA_TILES
/* The deltas on AMX's bfloat16 tiles (lora_a16 and lora_b16, as the dot products above): a tile pass
 * multiplies 16 rows by 32 bfloat16 values of k (or of rank) into 16 float32 columns. Xeon AMX: see
 * docs/performance.md. Tiles 0-5 are used, 16 rows x 64 bytes: the int8 GEMM's AMX configuration has them so
 * (the hooks run inside it), else lora_tiles_configure loads one. */
#define TILE 16 /* rows of a tile, and float32 columns of its sums */

/* Loads the thread's tile configuration, tiles 0-5 16 rows x 64 bytes (the caller releases it when done). */
static void lora_tiles_configure(void)
{
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 6; i++)
        c.rows[i] = TILE, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}


/* Fetches `bytes` from p into L2 ahead of the tile loads that read them (into L1, the hook's two dozen
 * prefetches waited on L1's fill buffers: a fifth of expand_tiles' samples, and 0.3-0.5 ms more a 256-row step). */
static inline void prefetch(const void *p, int64_t bytes)
{
    for (int64_t i = 0; i < bytes; i += 64)
        _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

/* Whether rows i < v before row i had slot slots[i] (its group's slot then already done). */
static inline int slot_seen(const int64_t *slots, int64_t i)
{
    for (int64_t j = 0; j < i; j++)
        if (slots[j] == slots[i])
            return 1;
    return 0;
}

/* Three tiles of sums at once (0, 3, 4), tile 1 the row operand, B operands alternating between tiles 2 and
 * 5: a tile pass's result is ready some 16 cycles after it starts, and a tile is loaded only after the pass
 * before reads it, so one tile of sums a pass behind another waits out each pass in turn (240 cycles a
 * 16 x 16 block of the expansion, measured, against ~60 with three). The tile numbers are immediates. */
#define SUMS_TILES 3
/* op(t) on sums tile i: tile 0, 3 or 4 (tile numbers are immediates). */
#define ON_SUMS(i, op)                                                                                                 \
    do {                                                                                                               \
        if ((i) == 0)                                                                                                  \
            op(0);                                                                                                     \
        else if ((i) == 1)                                                                                             \
            op(3);                                                                                                     \
        else                                                                                                           \
            op(4);                                                                                                     \
    } while (0)

static inline void sums_zero(int i) { ON_SUMS(i, _tile_zero); }

static inline void sums_load(int i, const void *p, int64_t stride)
{
#define LOAD(t) _tile_loadd(t, p, stride)
    ON_SUMS(i, LOAD);
#undef LOAD
}

static inline void sums_store(int i, void *p, int64_t stride)
{
#define STORE(t) _tile_stored(t, p, stride)
    ON_SUMS(i, STORE);
#undef STORE
}

/* Sums tile i += tile 1 x the B operand at b (16 pairs of rows x 64 bytes), loaded into tile 2 or 5 by *turn. */
static inline void sums_add(int i, const uint16_t *b, int *turn)
{
#define FROM_2(t) _tile_dpbf16ps(t, 1, 2)
#define FROM_5(t) _tile_dpbf16ps(t, 1, 5)
    if ((*turn ^= 1)) {
        _tile_loadd(2, b, 64);
        ON_SUMS(i, FROM_2);
    } else {
        _tile_loadd(5, b, 64);
        ON_SUMS(i, FROM_5);
    }
#undef FROM_2
#undef FROM_5
}

/* lora_project on tiles, for the rows g .. g + v - 1 (v <= 16): their inputs in bfloat16 (s->lora_x16, kp
 * apart), then for each slot among them the tiles' sums over k, three blocks of 16 ranks at a time (one block:
 * k's chunks of 32 dealt round the three tiles, then added), each row keeping its own slot's, over its sx;
 * then the rows' projections in bfloat16 in place of their inputs (zeros for a row without a slot), where
 * expand_tiles reads them. Rows past v in the tile are whatever the buffer holds: their sums are dropped. */
static void project_tile(const struct linear *l, const struct step *s, const float *x, int64_t g, int64_t v)
{
    const int64_t k = l->k, kp = round_up(k, 32), rank = l->lora_rank, blocks = (rank + 15) / 16;
    const int64_t *slots = s->lora_slots + g, ld = x16_stride(l);
    uint16_t *xb = s->lora_x16 + g * ld;
    for (int64_t i = 0; i < v; i++)
        if (slots[i] >= 0)
            to_bf16(x + (g + i) * k, k, xb + i * ld, kp);
    float sums[SUMS_TILES][TILE * TILE], t[TILE * round_up(rank, 16)];
    int turn = 0;
    for (int64_t i = 0; i < v; i++) {
        if (slots[i] < 0 || slot_seen(slots, i))
            continue;
        const int64_t slot = slots[i];
        for (int64_t b0 = 0; b0 < blocks; b0 += SUMS_TILES) {
            const int n = blocks - b0 < SUMS_TILES ? (int)(blocks - b0) : SUMS_TILES, split = n == 1;
            const int used = split ? SUMS_TILES : n;
            for (int q = 0; q < used; q++)
                sums_zero(q);
            for (int64_t c = 0; c < kp; c += 32) {
                _tile_loadd(1, xb + c, ld * 2);
                for (int q = 0; q < n; q++)
                    sums_add(split ? (int)(c / 32 % SUMS_TILES) : q,
                             l->lora_a16 + ((slot * blocks + b0 + q) * kp + c) * 16, &turn);
            }
            for (int q = 0; q < used; q++)
                sums_store(q, sums[q], 64);
            for (int q = 0; q < n; q++)
                for (int64_t r = i; r < v; r++) {
                    if (slots[r] != slot)
                        continue;
                    __m512 sum = load(sums[q] + r * TILE, 0xFFFF);
                    if (split)
                        sum = _mm512_add_ps(_mm512_add_ps(sum, load(sums[1] + r * TILE, 0xFFFF)),
                                            load(sums[2] + r * TILE, 0xFFFF));
                    store(t + r * blocks * 16 + (b0 + q) * 16, 0xFFFF, _mm512_div_ps(sum, _mm512_set1_ps(s->sx[g + r])));
                }
        }
    }
    for (int64_t r = 0; r < v; r++)
        if (slots[r] >= 0)
            to_bf16(t + r * blocks * 16, rank, xb + r * ld, round_up(rank, 32));
        else
            memset(xb + r * ld, 0, (size_t)round_up(rank, 32) * sizeof *xb);
}

/* add_deltas on tiles, for rows r0 .. r0 + rows - 1 of out (ld apart; any count) and columns c0 .. c0 + cols - 1
 * (c0 a multiple of 16): 16 rows at a time, for each slot among them its rows' projections in bfloat16
 * (project_tile's; the other rows zero, adding nothing), times B^T's columns three blocks of 16 at a time over
 * the ranks of their bands, summed onto out in the tiles (through a copy where a tile would pass the rows or
 * columns). */
static void expand_tiles(const struct linear *l, const struct step *s, int64_t r0, int64_t rows, int64_t c0,
                         int64_t cols, float *out, int64_t ld, int amx)
{
    const int64_t rank = l->lora_rank, rp = round_up(rank, 32), bp = round_up(rank, 16), col_blocks = (l->n + 15) / 16;
    const int64_t xs = x16_stride(l);
    const uint16_t *projections = s->lora_x16 + r0 * xs; /* project_tile's */
    if (!amx) /* the GEMM's AMX configuration has the tiles (tile_hook_fn), else this thread loads one */
        lora_tiles_configure();
    uint16_t t[TILE * rp];
    float copy[SUMS_TILES][TILE * TILE];
    int turn = 0;
    for (int64_t g = r0; g < r0 + rows; g += TILE) {
        const int64_t v = r0 + rows - g < TILE ? r0 + rows - g : TILE, *slots = s->lora_slots + g;
        for (int64_t i = 0; i < v; i++) {
            if (slots[i] < 0 || slot_seen(slots, i))
                continue;
            const int64_t slot = slots[i];
            /* the projections' tile: in place where the group's rows run this slot or none, else a copy
             * with the other slots' rows zero */
            const uint16_t *tile = projections + (g - r0) * xs;
            int64_t stride = xs;
            for (int64_t r = 0; r < v && tile != t; r++)
                if (slots[r] >= 0 && slots[r] != slot)
                    tile = t, stride = rp;
            for (int64_t r = 0; r < TILE && tile == t; r++) {
                if (r < v && slots[r] == slot)
                    memcpy(t + r * rp, projections + (g - r0 + r) * xs, (size_t)rp * sizeof *t);
                else
                    memset(t + r * rp, 0, (size_t)rp * sizeof *t);
            }
            const uint16_t *b = l->lora_b16 + slot * col_blocks * bp * 16;
            for (int64_t c = 0; c < cols; c += SUMS_TILES * 16) {
                if (c + SUMS_TILES * 16 < cols) /* the next columns' B^T, while these are summed */
                    prefetch(b + ((c0 + c) / 16 + SUMS_TILES) * bp * 16, SUMS_TILES * bp * 32);
                int64_t lo[SUMS_TILES], hi[SUMS_TILES], w[SUMS_TILES], first = rp, end = 0;
                for (int q = 0; q < SUMS_TILES; q++) {
                    const int64_t block = (c0 + c) / 16 + q;
                    w[q] = cols - c - 16 * q < 16 ? cols - c - 16 * q : 16;
                    lo[q] = w[q] <= 0 ? 0 : l->lora_band ? l->lora_band[2 * block] : 0;
                    hi[q] = w[q] <= 0 ? 0 : l->lora_band ? l->lora_band[2 * block + 1] : rank;
                    if (hi[q] <= lo[q])
                        continue;
                    float *y = out + (g - r0) * ld + c + 16 * q;
                    if (v == TILE && w[q] == 16)
                        sums_load(q, y, ld * 4);
                    else {
                        for (int64_t r = 0; r < TILE; r++)
                            store(copy[q] + r * TILE, 0xFFFF, r < v ? load(y + r * ld, lanes(w[q])) : _mm512_setzero_ps());
                        sums_load(q, copy[q], 64);
                    }
                    first = lo[q] / 32 * 32 < first ? lo[q] / 32 * 32 : first;
                    end = hi[q] > end ? hi[q] : end;
                }
                for (int64_t j = first; j < end; j += 32) {
                    _tile_loadd(1, tile + j, stride * 2);
                    for (int q = 0; q < SUMS_TILES; q++)
                        if (j < hi[q] && j + 32 > lo[q])
                            sums_add(q, b + (((c0 + c) / 16 + q) * bp + j) * 16, &turn);
                }
                for (int q = 0; q < SUMS_TILES; q++) {
                    if (hi[q] <= lo[q])
                        continue;
                    float *y = out + (g - r0) * ld + c + 16 * q;
                    if (v == TILE && w[q] == 16)
                        sums_store(q, y, ld * 4);
                    else {
                        sums_store(q, copy[q], 64);
                        for (int64_t r = 0; r < v; r++)
                            store(y + r * ld, lanes(w[q]), load(copy[q] + r * TILE, lanes(w[q])));
                    }
                }
            }
        }
    }
    /* the next rows' B^T for the first of these columns where their slot is another: the gate_up GEMM calls
     * next with them (rows run in adapter order, each slot's B^T met cold after another row tile's) */
    const int64_t next = r0 + rows;
    if (next < s->rows && s->lora_slots[next] >= 0 && s->lora_slots[next] != s->lora_slots[next - 1])
        prefetch(l->lora_b16 + (s->lora_slots[next] * col_blocks + c0 / 16) * bp * 16,
                 (cols < SUMS_TILES * 16 ? (cols + 15) / 16 : SUMS_TILES) * bp * 32);
    if (!amx)
        _tile_release();
}
#endif

/* The rows' projections x A^T / sx into s->lora_t, where they run an adapter on l: x [rows, k] is the linear's
 * float input as the quantization took it, smoothed (A^T divided by the smoothing vector: struct linear), sx
 * the scales the quantization just set (the GEMM's products are in units of them until the pass after it). */
static void lora_project(const struct linear *l, const struct step *s, const float *x)
{
    if (!l->lora_a || !s->lora_slots)
        return;
    const int64_t k = l->k, rank = l->lora_rank;
#ifdef HAVE_LORA_TILES
    if (l->lora_a16 && s->lora_tiles) {
#pragma omp parallel if (s->rows * k >= PARALLEL_MIN)
        {
            lora_tiles_configure();
#pragma omp for
            for (int64_t g = 0; g < s->rows; g += TILE)
                project_tile(l, s, x, g, s->rows - g < TILE ? s->rows - g : TILE);
            _tile_release();
        }
        return;
    }
#endif
#pragma omp parallel for if (s->rows * k >= PARALLEL_MIN)
    for (int64_t lo = 0; lo < s->rows; lo += LORA_ROWS) {
        const int64_t end = lo + LORA_ROWS < s->rows ? lo + LORA_ROWS : s->rows;
        for (int64_t r = lo, e; r < end; r = e) {
            e = run_end(s->lora_slots, r, end);
            if (s->lora_slots[r] < 0)
                continue;
#ifdef HAVE_LORA_BF16
            if (l->lora_a16) {
                project_dots(l, s, x, r, e - r);
                continue;
            }
#endif
            project_run(x + r * k, k, l->lora_a + s->lora_slots[r] * k * rank, rank, s->sx + r,
                        s->lora_t + r * s->lora_width, s->lora_width, e - r);
        }
    }
}

/* The LoRA deltas on l of rows r0 .. end - 1 (at most LORA_ROWS), in columns c0 .. c0 + cols - 1 (c0 a
 * multiple of 16), added to out [end - r0, cols] (rows ld apart) from their projections (lora_project). */
static void add_deltas(const struct linear *l, const struct step *s, int64_t r0, int64_t end, int64_t c0,
                       int64_t cols, float *out, int64_t ld)
{
    const int64_t n = l->n, rank = l->lora_rank;
    const int32_t *band = l->lora_band ? l->lora_band + c0 / 16 * 2 : NULL;
    for (int64_t r = r0, e; r < end; r = e) {
        e = run_end(s->lora_slots, r, end);
        if (s->lora_slots[r] < 0)
            continue;
        float *rows = out + (r - r0) * ld;
#ifdef HAVE_LORA_BF16
        if (l->lora_a16) {
            expand_dots(l, s, r, e - r, c0, cols, rows, ld);
            continue;
        }
#endif
        expand_run(s->lora_t + r * s->lora_width, s->lora_width, l->lora_b + s->lora_slots[r] * rank * n + c0, n, band,
                   rank, cols, rows, ld, rows, ld, e - r);
    }
}

/* What lora_tile reads: the linear and the step. */
struct lora_context {
    const struct linear *l;
    const struct step *s;
};

/* The GEMMs' tile hook (tile_hook_fn): the tile's LoRA deltas added to its products as they are stored (the
 * fused gate_up + SiLU GEMM's before the SiLU, so that adapter rows keep the fused entry). */
static void lora_tile(const void *context, int64_t r0, int64_t rows, int64_t c0, int64_t cols, float *tile, int64_t ld,
                      int amx)
{
    const struct lora_context *c = context;
#ifdef HAVE_LORA_TILES
    if (c->l->lora_a16 && c->s->lora_tiles) {
        expand_tiles(c->l, c->s, r0, rows, c0, cols, tile, ld, amx);
        return;
    }
#endif
    (void)amx;
    for (int64_t lo = r0; lo < r0 + rows; lo += LORA_ROWS)
        add_deltas(c->l, c->s, lo, lo + LORA_ROWS < r0 + rows ? lo + LORA_ROWS : r0 + rows, c0, cols,
                   tile + (lo - r0) * ld, ld);
#ifdef HAVE_LORA_BF16
    if (c->l->lora_a16)
        prefetch_next_tile(c->l, c->s, r0 + rows, c0, cols);
#endif
}

/* Whether any row of the step runs an adapter on l. */
static int lora_rows(const struct linear *l, const struct step *s)
{
    for (int64_t r = 0; r < s->rows; r++)
        if (lora_slot(l, s, r) >= 0)
            return 1;
    return 0;
}

/* tmp = x * smooth (or x itself without one), then quantized: each row of a linear's input. */
static void quantize_input(const float *x, const struct linear *l, const struct step *s)
{
    const int64_t k = l->k;
#pragma omp parallel for if (s->rows * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < s->rows; r++) {
        const float *y = x + r * k;
        if (l->smooth) {
            float *t = s->tmp + r * k;
            for (int64_t c = 0; c < k; c += 16)
                store(t + c, lanes(k - c), _mm512_mul_ps(load(y + c, lanes(k - c)), load(l->smooth + c, lanes(k - c))));
            y = t;
        }
        s->sx[r] = quantize_row(y, k, s->u + r * k);
    }
    lora_project(l, s, l->smooth ? s->tmp : x);
}

/* RMSNorm of each row of x (weight w) into s->tmp; in a W8A8 step times the linear's smoothing vector, then
 * quantized (a weight-only step's GEMM reads s->tmp as it is). */
static void norm_quantize(const float *x, const float *w, const struct linear *l, const struct step *s)
{
    const int64_t k = l->k;
    const float *smooth = s->gemm_w4 ? NULL : l->smooth;
#pragma omp parallel for if (s->rows * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < s->rows; r++) {
        const float *xr = x + r * k;
        float *t = s->tmp + r * k;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += 16) {
            __m512 v = load(xr + c, lanes(k - c));
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)k + s->eps));
        for (int64_t c = 0; c < k; c += 16) {
            __mmask16 m = lanes(k - c);
            __m512 y = _mm512_mul_ps(_mm512_mul_ps(load(xr + c, m), inv), load(w + c, m));
            if (smooth)
                y = _mm512_mul_ps(y, load(smooth + c, m));
            store(t + c, m, y);
        }
        if (!s->gemm_w4)
            s->sx[r] = quantize_row(t, k, s->u + r * k);
    }
    lora_project(l, s, s->tmp);
}

/* y = products [rows, n] x the row scales; x += y (the residual stream). */
static void add_scaled(float *x, const float *products, int64_t n, const struct step *s)
{
#pragma omp parallel for if (s->rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < s->rows; r++) {
        const __m512 sr = _mm512_set1_ps(s->sx[r]);
        for (int64_t c = 0; c < n; c += 16) {
            __mmask16 m = lanes(n - c);
            store(x + r * n + c, m, _mm512_add_ps(load(x + r * n + c, m), _mm512_mul_ps(load(products + r * n + c, m), sr)));
        }
    }
}

/* One head's rotate-half RoPE: dst = (x1 cos - x2 sin, x2 cos + x1 sin) of src = (x1, x2) (may alias). */
static inline void rotate(float *dst, const float *src, const float *cos, const float *sin, int64_t half)
{
    for (int64_t j = 0; j < half; j += 16) {
        __mmask16 m = lanes(half - j);
        __m512 x1 = load(src + j, m), x2 = load(src + half + j, m), c = load(cos + j, m), n = load(sin + j, m);
        store(dst + j, m, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, n)));
        store(dst + half + j, m, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, n)));
    }
}

/* The qkv products times the row scales, plus qkv's bias; q rotated into s->q, k rotated in place, v in place; then
 * each thread writes its rows' keys and values to the layer's KV pools, their cache lines still hot. (The
 * write took a parallel region of its own, serial below 4,096 row-heads: SmolLM2 steps of 64 rows took
 * 0.956 of the time with it here, lock-step.) */
static void scale_rope_write(const struct step *s, const struct layer *L)
{
    const int64_t n = L->qkv.n, d = s->head_dim, half = d / 2, nq = s->heads * d;
    const float *bias = L->qkv.bias;
#pragma omp parallel if (s->rows * n >= PARALLEL_MIN)
    {
        const int threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t lo = s->rows * id / threads, hi = s->rows * (id + 1) / threads;
        for (int64_t r = lo; r < hi; r++) {
            float *row = s->qkv + r * n;
            const __m512 sr = _mm512_set1_ps(s->sx[r]);
            for (int64_t c = 0; c < n; c += 16) {
                const __mmask16 m = lanes(n - c);
                const __m512 y = _mm512_mul_ps(load(row + c, m), sr);
                store(row + c, m, bias ? _mm512_add_ps(y, load(bias + c, m)) : y);
            }
            const float *cos = s->cos + r * half, *sin = s->sin + r * half;
            for (int64_t h = 0; h < s->heads; h++)
                rotate(s->q + r * nq + h * d, row + h * d, cos, sin, half);
            for (int64_t h = 0; h < s->kv_heads; h++)
                rotate(row + nq + h * d, row + nq + h * d, cos, sin, half);
        }
        const float *k = s->qkv + lo * n + nq;
        s->write(k, k + s->kv_heads * d, n, n, s->slots + lo, hi - lo, L->k_pool, L->v_pool, L->k_scale, L->v_scale,
                 s->kv_heads, s->num_blocks);
    }
}

/* silu(gate) x up (both times the row scale) into s->tmp; in a W8A8 step times the down projection's
 * smoothing vector, then quantized. */
static void silu_quantize(const struct linear *down, const struct step *s)
{
    const int64_t i = s->intermediate;
    const float *smooth = s->gemm_w4 ? NULL : down->smooth;
#pragma omp parallel for if (s->rows * i >= PARALLEL_MIN)
    for (int64_t r = 0; r < s->rows; r++) {
        const float *gate = s->gate_up + r * 2 * i, *up = gate + i;
        float *t = s->tmp + r * i;
        const __m512 sr = _mm512_set1_ps(s->sx[r]);
        for (int64_t c = 0; c < i; c += 16) {
            __mmask16 m = lanes(i - c);
            __m512 y = silu_times(_mm512_mul_ps(load(gate + c, m), sr), _mm512_mul_ps(load(up + c, m), sr));
            if (smooth)
                y = _mm512_mul_ps(y, load(smooth + c, m));
            store(t + c, m, y);
        }
        if (!s->gemm_w4)
            s->sx[r] = quantize_row(t, i, s->u + r * i);
    }
    lora_project(down, s, s->tmp);
}

/* Each row of the down projection's smoothed input in s->tmp quantized into s->u and s->sx. */
static void quantize_activation(const struct linear *down, const struct step *s)
{
    const int64_t k = down->k;
#pragma omp parallel for if (s->rows * k >= PARALLEL_MIN)
    for (int64_t r = 0; r < s->rows; r++)
        s->sx[r] = quantize_row(s->tmp + r * k, k, s->u + r * k);
    lora_project(down, s, s->tmp);
}

static inline double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* out [rows, n] = the GEMM's products: in a W8A8 step of the quantized input in s->u, plus the rows' LoRA
 * deltas (added to the GEMM's tiles as they are stored, while in L1); in a weight-only step the W4A8 GEMM's
 * of the float input x. */
static inline int gemm(const struct step *s, const struct linear *l, const float *x, float *out)
{
    if (s->gemm_w4)
        return s->gemm_w4(x, l->k, s->rows, l->k, l->w4, l->n, out);
    const struct lora_context lora = {l, s};
    return s->gemm(s->u, l->k, s->rows, l->k, l->panels, l->correction, l->scale, l->n, out,
                   lora_rows(l, s) ? lora_tile : NULL, &lora);
}

/* x [rows, hidden] (the residual stream) through `count` layers in place, each pass split between the
 * threads (GEMMs by panels, the rest by rows). A weight-only step takes the same passes with the rows' scales
 * 1 (its GEMM's products are scaled already), nothing smoothed or quantized but by its GEMM. Adds the seconds
 * spent in the attention's decode to *attention_seconds. Returns 0, or -1 where a GEMM could not allocate its
 * padded rows or quantized activations (x then holds a partial result). */
static int layer_passes(const struct layer *layers, int64_t count, const struct step *s, float *x,
                        double *attention_seconds)
{
    if (s->gemm_w4)
        for (int64_t r = 0; r < s->rows; r++)
            s->sx[r] = 1.0f;
    for (int64_t i = 0; i < count; i++) {
        const struct layer *L = &layers[i];
        norm_quantize(x, L->input_norm, &L->qkv, s);
        if (gemm(s, &L->qkv, s->tmp, s->qkv))
            return -1;
        scale_rope_write(s, L);
        double t0 = now();
        s->decode(s->q, L->k_pool, L->v_pool, L->k_scale, L->v_scale, s->tables, s->table_stride, s->lens, s->first,
                  s->attn, s->rows, s->kv_heads, s->num_blocks, s->attention_scale);
        *attention_seconds += now() - t0;
        if (!s->gemm_w4)
            quantize_input(s->attn, &L->o, s);
        if (gemm(s, &L->o, s->attn, s->proj))
            return -1;
        add_scaled(x, s->proj, s->hidden, s);
        norm_quantize(x, L->post_norm, &L->gate_up, s);
        /* the activation from the GEMM's tiles (the products never stored, adapter rows' deltas added to the
         * tiles), else from the stored products */
        const struct linear *gu = &L->gate_up;
        const struct lora_context lora = {gu, s};
        const int fused = s->gemm_w4 ? -2 : s->gemm_silu(s->u, gu->k, s->rows, gu->k, gu->panels, gu->correction,
                                                         gu->scale, s->intermediate, s->sx, L->down.smooth, s->tmp,
                                                         lora_rows(gu, s) ? lora_tile : NULL, &lora);
        if (fused == -1 || (fused == -2 && gemm(s, gu, s->tmp, s->gate_up)))
            return -1;
        if (fused == 0)
            quantize_activation(&L->down, s);
        else
            silu_quantize(&L->down, s);
        if (gemm(s, &L->down, s->tmp, s->proj))
            return -1;
        add_scaled(x, s->proj, s->hidden, s);
    }
    return 0;
}

/* Rows a thread must have for the layers to split a step by rows: each thread then reads every weight,
 * which small steps (bound by those reads) cannot afford. */
#define SPLIT_ROWS_MIN 8
/* A layer's int8 weights above which steps are never split by rows: split pass by pass, each thread reads its
 * half of a weight once, and a large layer's GEMMs dwarf the passes' ~10 barriers, which is what splitting
 * by rows saves (SmolLM2, 3.5 MB a layer). Llama-3.2-1B's shapes (61 MB a layer), Xeon AMX, quiet: 64 rows
 * 89.5 ms a step pass by pass against 111.3 ms by rows, 256 rows 213.4 against 232.7 ms. */
#define SPLIT_LAYER_BYTES_MAX (16 << 20)
/* A row's GEMM work, in attended keys (its weights' multiply-adds over a key's in attention): what weighs
 * rows against each other when the step is split, so that long contexts do not leave a thread waiting. */
#define ROW_KEYS 1024
#define TILE_ROWS 8 /* the GEMM's row tile: split points at its multiples leave no thread a partial tile */
#define MAX_SPLIT 256 /* threads a step is split between at most */

/* Whether the step may be split between rows r - 1 and r: not inside one sequence's rows of a prompt
 * chunk (or of its guesses), where a row reads the keys the rows before it write in the same layer, which
 * the other thread might not have written yet. Such rows have consecutive lengths; rows of other sequences
 * that happen to have them are only not split (never wrong). */
static int may_split_at(const struct step *s, int64_t r)
{
    return r <= 0 || r >= s->rows || s->lens[r] != s->lens[r - 1] + 1;
}

/* The split nearest row r that may_split_at allows: a multiple of TILE_ROWS up to a tile from the nearest
 * one, else any row (0 and rows always are). */
static int64_t allowed_split(const struct step *s, int64_t r)
{
    const int64_t tile = (r + TILE_ROWS / 2) / TILE_ROWS * TILE_ROWS;
    for (int64_t d = 0; d <= TILE_ROWS; d += TILE_ROWS) {
        if (tile - d >= 0 && tile - d <= s->rows && may_split_at(s, tile - d))
            return tile - d;
        if (tile + d <= s->rows && may_split_at(s, tile + d))
            return tile + d;
    }
    for (int64_t d = 0;; d++) {
        if (r - d >= 0 && may_split_at(s, r - d))
            return r - d;
        if (r + d <= s->rows && may_split_at(s, r + d))
            return r + d;
    }
}

/* bounds[0 .. threads]: thread i's rows are bounds[i] .. bounds[i + 1] - 1, rows weighed by ROW_KEYS plus
 * their keys, each bound the allowed split nearest the balanced one. */
void split_rows(const struct step *s, int threads, int64_t *bounds)
{
    int64_t total = 0;
    for (int64_t r = 0; r < s->rows; r++)
        total += ROW_KEYS + s->lens[r] - s->first[r];
    bounds[0] = 0;
    int64_t r = 0, sum = 0;
    for (int id = 1; id < threads; id++) {
        for (; r < s->rows && sum + (ROW_KEYS + s->lens[r] - s->first[r]) / 2 < total * id / threads; r++)
            sum += ROW_KEYS + s->lens[r] - s->first[r];
        const int64_t split = allowed_split(s, r);
        bounds[id] = split > bounds[id - 1] ? split : bounds[id - 1];
    }
    bounds[threads] = s->rows;
}

/* Rows lo .. hi - 1 of s as a step of their own: the per-row inputs and each scratch buffer's slab of
 * those rows (scratch buffers hold `widest` values per row at most). */
static struct step rows_of(const struct step *s, int64_t lo, int64_t hi)
{
    struct step t = *s;
    const int64_t half = s->head_dim / 2, nq = s->heads * s->head_dim, n_qkv = nq + 2 * s->kv_heads * s->head_dim;
    int64_t widest = s->hidden > nq ? s->hidden : nq;
    widest = widest > s->intermediate ? widest : s->intermediate;
    t.rows = hi - lo;
    t.cos += lo * half, t.sin += lo * half;
    t.slots += lo, t.tables += lo * s->table_stride, t.lens += lo, t.first += lo;
    t.u += lo * widest, t.sx += lo, t.tmp += lo * widest, t.qkv += lo * n_qkv, t.q += lo * nq, t.attn += lo * nq;
    t.gate_up += lo * 2 * s->intermediate, t.proj += lo * s->hidden;
    if (t.lora_slots)
        t.lora_slots += lo, t.lora_t += lo * s->lora_width;
    if (t.lora_x16) /* lora_x16_values in cpu_decode_layers.py */
        t.lora_x16 += lo * (((widest > s->lora_width ? widest : s->lora_width) + 31) / 32 * 32);
    return t;
}

/* decode_layers' passes with the step's rows split between the threads, each thread taking its rows through
 * every layer on its own: every pass of a decode layer is row by row (a row's attention reads only its own
 * new key and value and blocks written in earlier steps), so the threads never wait for each other, where
 * split pass by pass they met at ~10 barriers a layer. */
static int row_split(const struct layer *layers, int64_t count, const struct step *s, float *x, double *attention_seconds)
{
    int failed = 0;
    double attention = 0.0;
    int64_t bounds[MAX_SPLIT + 1];
    const int threads = omp_get_max_threads() < MAX_SPLIT ? omp_get_max_threads() : MAX_SPLIT;
    split_rows(s, threads, bounds);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int id = omp_get_thread_num();
        const int64_t lo = bounds[id], hi = bounds[id + 1];
        const struct step mine = rows_of(s, lo, hi);
        double seconds = 0.0;
        omp_set_num_threads(1); /* the passes' own parallel regions: this thread alone */
        if (hi > lo)
            failed |= layer_passes(layers, count, &mine, x + lo * s->hidden, &seconds) != 0;
        if (id == 0)
            attention = seconds;
    }
    *attention_seconds += attention;
    return failed ? -1 : 0;
}

int splits_by_rows(const struct layer *layer, int64_t rows, int threads)
{
    const struct linear *l[] = {&layer->qkv, &layer->o, &layer->gate_up, &layer->down};
    int64_t bytes = 0;
    for (int i = 0; i < 4; i++)
        bytes += l[i]->n * l[i]->k;
    return threads > 1 && rows >= SPLIT_ROWS_MIN * threads && bytes <= SPLIT_LAYER_BYTES_MAX;
}

/* x [rows, hidden] (the residual stream) through `count` layers in place: large W8A8 steps split by rows
 * (row_split), the others pass by pass (a weight-only step is a few rows, bound by its weights' reads).
 * Adds the seconds spent in the attention's decode (the first thread's, split by rows) to *attention_seconds.
 * Returns 0, or -1 where a GEMM could not allocate its scratch (x then holds a partial result). */
int decode_layers(const struct layer *layers, int64_t count, const struct step *s, float *x, double *attention_seconds)
{
    if (count > 0 && !s->gemm_w4 && splits_by_rows(layers, s->rows, omp_get_max_threads()))
        return row_split(layers, count, s, x, attention_seconds);
    return layer_passes(layers, count, s, x, attention_seconds);
}

int decode_layers_available(void) { return 1; }

#else

int decode_layers(const struct layer *layers, int64_t count, const struct step *s, float *x, double *attention_seconds)
{
    (void)layers, (void)count, (void)s, (void)x, (void)attention_seconds;
    return -1;
}

int decode_layers_available(void) { return 0; }

int splits_by_rows(const struct layer *layer, int64_t rows, int threads)
{
    (void)layer, (void)rows, (void)threads;
    return 0;
}

void lora_delta(const float *x, const float *y, float *out, const int64_t *slots, int64_t slotted, int64_t rows,
                int64_t k, int64_t n, const float *a, const float *b, int64_t rank)
{
    (void)x, (void)y, (void)out, (void)slots, (void)slotted, (void)rows, (void)k, (void)n, (void)a, (void)b, (void)rank;
}

void quantize_rows(const float *x, int64_t m, int64_t k, uint8_t *u, float *scales)
{
    (void)x, (void)m, (void)k, (void)u, (void)scales;
}

#endif

int lora_tiles_available(void)
{
#ifdef HAVE_LORA_TILES
    return amx_granted(AMX_BF16_BIT);
#else
    return 0;
#endif
}

int lora_dots_available(void)
{
#ifdef HAVE_LORA_BF16
    return 1;
#else
    return 0;
#endif
}

/* The structs' layout as this compiler lays them out, for the test that holds the ctypes mirrors
 * (kernels/cpu_decode_layers.py) to it: a mirror that disagrees would have this code read its fields at the
 * wrong addresses. */
#define SIZE(s) {#s, NULL, 0, sizeof(struct s)}
#define FIELD(s, f) {#s, #f, offsetof(struct s, f), sizeof(((struct s *)0)->f)}
static const struct {
    const char *structure, *field;
    size_t offset, size;
} LAYOUT[] = {
    SIZE(linear), FIELD(linear, panels), FIELD(linear, correction), FIELD(linear, scale), FIELD(linear, smooth),
    FIELD(linear, n), FIELD(linear, k), FIELD(linear, lora_a), FIELD(linear, lora_b), FIELD(linear, lora_rank),
    FIELD(linear, lora_band), FIELD(linear, lora_a16), FIELD(linear, lora_b16), FIELD(linear, w4), FIELD(linear, bias),
    SIZE(layer), FIELD(layer, input_norm), FIELD(layer, post_norm), FIELD(layer, qkv), FIELD(layer, o),
    FIELD(layer, gate_up), FIELD(layer, down), FIELD(layer, k_pool), FIELD(layer, v_pool), FIELD(layer, k_scale),
    FIELD(layer, v_scale),
    SIZE(step), FIELD(step, rows), FIELD(step, hidden), FIELD(step, heads), FIELD(step, kv_heads),
    FIELD(step, head_dim), FIELD(step, intermediate), FIELD(step, eps), FIELD(step, attention_scale),
    FIELD(step, cos), FIELD(step, sin), FIELD(step, slots), FIELD(step, tables), FIELD(step, lens),
    FIELD(step, first), FIELD(step, table_stride), FIELD(step, num_blocks), FIELD(step, gemm),
    FIELD(step, gemm_silu), FIELD(step, write), FIELD(step, decode), FIELD(step, u), FIELD(step, sx),
    FIELD(step, tmp), FIELD(step, qkv), FIELD(step, q), FIELD(step, attn), FIELD(step, gate_up), FIELD(step, proj),
    FIELD(step, lora_slots), FIELD(step, lora_t), FIELD(step, lora_width), FIELD(step, lora_x16),
    FIELD(step, lora_tiles), FIELD(step, gemm_w4),
};

int struct_layout(int64_t i, const char **structure, const char **field, int64_t *offset, int64_t *size)
{
    if (i < 0 || i >= (int64_t)(sizeof LAYOUT / sizeof LAYOUT[0]))
        return 0;
    *structure = LAYOUT[i].structure, *field = LAYOUT[i].field;
    *offset = (int64_t)LAYOUT[i].offset, *size = (int64_t)LAYOUT[i].size;
    return 1;
}
