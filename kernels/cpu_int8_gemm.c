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
 *
 * AMX (CPUs with amx_int8, where Linux grants the tile state): the same panels feed tdpbusd. A B tile is 16
 * groups of one panel's 16 channels (16 rows x 64 bytes, 192 bytes apart); an A tile 16 activation rows x 64
 * k. A row tile is 32 rows x NR channels in six C tiles (1.1-1.2x oneDNN's AMX GEMM at 64-128 rows, one
 * thread, against 1.0x with 16 rows: each B tile, read from L2, then serves 32 rows), each group of 64 k
 * loading three B tiles and four A tiles; where k is not a multiple of 64 (or m <= 16), AR = 16 rows in three
 * C tiles, the last groups going through a pair of narrower A and B tiles (no tile register is left for
 * them beside six C tiles). The int32 sums, exact as vpdpbusd's, are stored to memory and go through the
 * same epilogues, so both paths give the same bits. Built where the compiler targets AMX (-march=native on such a CPU; -mno-amx-int8 leaves it
 * out), chosen at run time where the CPU has it and the kernel grants its state (int8_gemm_amx).
 *
 * Entry points: int8_gemm stores the products; int8_gemm_argmax runs the same tiles and keeps only each
 * row's largest product and its column (an LM head's greedy step); int8_gemm_silu turns a gate_up weight's
 * products into the gated MLP's activation as the tiles come out.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h" /* the entry points, as ctypes and cpu_decode_layers.c call them */

#define MR 8
#define NV 3 /* vectors of 16 channels per panel */
#define NR (16 * NV)
#define STREAM_BYTES (8 << 20)
#define PARTS 4 /* MR-row parts of the largest row tile (AMX's) */

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__)
#define HAVE_AMX 1
#include "cpu_amx.h"
#define AR 16 /* rows of an AMX tile */
#define KB 16 /* groups of 4 k per A or B tile */
#endif

#ifdef __AVX512VNNI__
typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
static inline vec splat(float x) { return (vec){0} + x; }
#include "cpu_vexp.h"

/* acc[r][j] += sum over k of a[r][k] * panel[k][16 j ...]: rows r < MR of a (lda apart), groups g < k4.
 * Meanwhile `lines` cache lines from `next` are fetched into L2, `per` of them per group (see product_tile). */
static inline void tile(const uint8_t *a, int64_t lda, const int8_t *panel, int64_t k4, __m512i out[MR][NV],
                        const int8_t *next, int64_t lines, int per) {
    __m512i acc[MR][NV]; /* a local array, so that the compiler keeps it in registers */
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++)
            acc[r][j] = _mm512_setzero_si512();
    for (int64_t g = 0; g < k4; g++) {
        const int8_t *w = panel + g * NR * 4;
        for (int i = 0; i < per; i++)
            if (g * per + i < lines)
                _mm_prefetch((const char *)next + (g * per + i) * 64, _MM_HINT_T1);
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

#ifdef HAVE_AMX
/* The tile registers' shapes (palette 1). Row tiles of 2 AR rows (k4 a multiple of KB): tmm0-5 the C tiles
 * (16 x 16 int32), tmm6 the A tile, tmm7 the B tile. Of AR rows: tmm0-2 the C tiles, tmm3 the A tile, tmm4-5
 * the B tiles, tmm6-7 the A and B tiles of the last `tail` groups (k4 % KB). Loaded by each thread that runs
 * tiles: the configuration is per thread, and loading it zeroes the tiles. Tiles 0-2 are 16 rows x 64 bytes
 * in either, which the LoRA hook's tiles rely on (kernels/cpu_decode_layers.c). */
static void amx_configure(int64_t k4, int64_t rows) {
    struct tile_config c = {.palette = 1};
    int tail = (int)(k4 % KB);
    for (int i = 0; i < 8; i++)
        c.rows[i] = AR, c.colsb[i] = 64;
    if (rows == AR && tail)
        c.colsb[6] = (uint16_t)(4 * tail), c.rows[7] = (uint8_t)tail;
    _tile_loadconfig(&c);
}

/* As amx_tile (below), for 2 AR rows (out: int32 [2 AR][NR]) and k4 a multiple of KB: each B tile loaded once
 * for both halves of the rows. */
static inline void amx_tile2(const uint8_t *a, int64_t lda, const int8_t *panel, int64_t k4, __m512i out[][MR][NV],
                             const int8_t *next, int64_t lines) {
    int64_t blocks = k4 / KB, per = blocks ? (lines + blocks - 1) / blocks : 0;
    const uint8_t *a2 = a + AR * lda;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t i = b * per; i < (b + 1) * per && i < lines; i++)
            _mm_prefetch((const char *)next + i * 64, _MM_HINT_T1);
        const int8_t *w = panel + b * KB * NR * 4;
        _tile_loadd(7, w, NR * 4);
        _tile_loadd(6, a + b * KB * 4, lda);
        _tile_dpbusd(0, 6, 7);
        _tile_loadd(6, a2 + b * KB * 4, lda);
        _tile_dpbusd(3, 6, 7);
        _tile_loadd(7, w + 64, NR * 4);
        _tile_dpbusd(4, 6, 7);
        _tile_loadd(6, a + b * KB * 4, lda);
        _tile_dpbusd(1, 6, 7);
        _tile_loadd(7, w + 128, NR * 4);
        _tile_dpbusd(2, 6, 7);
        _tile_loadd(6, a2 + b * KB * 4, lda);
        _tile_dpbusd(5, 6, 7);
    }
    int32_t *c = (int32_t *)out;
    _tile_stored(0, c, NR * 4);
    _tile_stored(1, c + 16, NR * 4);
    _tile_stored(2, c + 32, NR * 4);
    _tile_stored(3, c + AR * NR, NR * 4);
    _tile_stored(4, c + AR * NR + 16, NR * 4);
    _tile_stored(5, c + AR * NR + 32, NR * 4);
}

/* out (int32 [AR][NR], in MR-row register tiles' layout) = the sums of AR rows of a (lda apart) times the panel (k4
 * groups), with `tile`'s prefetch of the next panel spread over the groups of 64 k. */
static inline void amx_tile(const uint8_t *a, int64_t lda, const int8_t *panel, int64_t k4, __m512i out[][MR][NV],
                            const int8_t *next, int64_t lines) {
    int64_t blocks = k4 / KB, steps = blocks + (k4 % KB != 0), per = steps ? (lines + steps - 1) / steps : 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t b = 0; b < steps; b++) {
        for (int64_t i = b * per; i < (b + 1) * per && i < lines; i++)
            _mm_prefetch((const char *)next + i * 64, _MM_HINT_T1);
        const int8_t *w = panel + b * KB * NR * 4;
        if (b < blocks) {
            _tile_loadd(3, a + b * KB * 4, lda);
            _tile_loadd(4, w, NR * 4);
            _tile_dpbusd(0, 3, 4);
            _tile_loadd(5, w + 64, NR * 4);
            _tile_dpbusd(1, 3, 5);
            _tile_loadd(4, w + 128, NR * 4);
            _tile_dpbusd(2, 3, 4);
        } else {
            _tile_loadd(6, a + b * KB * 4, lda);
            _tile_loadd(7, w, NR * 4);
            _tile_dpbusd(0, 6, 7);
            _tile_loadd(7, w + 64, NR * 4);
            _tile_dpbusd(1, 6, 7);
            _tile_loadd(7, w + 128, NR * 4);
            _tile_dpbusd(2, 6, 7);
        }
    }
    int32_t *c = (int32_t *)out;
    _tile_stored(0, c, NR * 4);
    _tile_stored(1, c + 16, NR * 4);
    _tile_stored(2, c + 32, NR * 4);
}
#endif

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

/* Whether the tiles run on AMX (1): built with it, the CPU has amx_int8 and Linux granted this process the
 * tile state (asked once); else the AVX-512 VNNI tile (0). */
int int8_gemm_amx(void) {
#ifdef HAVE_AMX
    static int state = -1; /* -1: not asked yet; the answer is the same for every thread that asks */
    int known = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (known < 0) {
        known = amx_granted(AMX_INT8_BIT);
        __atomic_store_n(&state, known, __ATOMIC_RELEASE);
    }
    return known;
#else
    return 0;
#endif
}

#ifdef __AVX512VNNI__
/* The activations' row tiles of `rows` rows (AR where the tiles run on AMX, else MR): rows read in place in
 * whole tiles; the rows of a partial last tile (every row, where k is not a multiple of 4) copied once into
 * whole tiles padded with zeros (u = 128). */
struct row_tiles {
    const uint8_t *u;
    int64_t lda, padded, in_place, tiles, rows;
    uint8_t *spare; /* NULL where every tile is read in place */
};

/* Returns 0, or -1 where the padded copy could not be allocated. */
static int row_tiles_init(struct row_tiles *a, const uint8_t *u, int64_t lda, int64_t m, int64_t k) {
#ifdef HAVE_AMX
    a->rows = !int8_gemm_amx() ? MR : m > AR && k % (4 * KB) == 0 ? 2 * AR : AR;
#else
    a->rows = MR;
#endif
    a->u = u, a->lda = lda, a->padded = (k + 3) / 4 * 4, a->tiles = (m + a->rows - 1) / a->rows, a->spare = NULL;
    a->in_place = a->padded == k ? m / a->rows * a->rows : 0;
    if (a->in_place < m) {
        size_t bytes = (size_t)((a->tiles - a->in_place / a->rows) * a->rows * a->padded);
        a->spare = malloc(bytes);
        if (a->spare == NULL)
            return -1;
        memset(a->spare, 128, bytes);
        for (int64_t r = a->in_place; r < m; r++)
            memcpy(a->spare + (r - a->in_place) * a->padded, u + r * lda, (size_t)k);
    }
    return 0;
}

/* Each thread that runs row tiles calls these around them (AMX's tile configuration is per thread). */
static inline void tiles_begin(const struct row_tiles *a, int64_t k4) {
#ifdef HAVE_AMX
    if (a->rows != MR)
        amx_configure(k4, a->rows);
#endif
    (void)a, (void)k4;
}

static inline void tiles_end(const struct row_tiles *a) {
#ifdef HAVE_AMX
    if (a->rows != MR)
        _tile_release();
#endif
    (void)a;
}

/* The rows of part h (MR rows each) of a row tile of `rows` rows. */
static inline int part_rows(int rows, int h) { return rows - h * MR < MR ? rows - h * MR : MR; }

/* The sums of row tile t (of m rows) times panel p (of `panels`) of the packed weight (k4 groups of 4) into
 * acc (MR-row parts: one for the VNNI tile, PARTS for AMX's); returns the tile's rows. Each row tile of a panel also fetches its share of the next panel: a panel is
 * read from memory once, by its first row tile, and the hardware prefetcher stops at each 4 KiB page, so
 * without this the first tile waited on memory (SmolLM2 steps of 64 rows: 0.974 of the time, lock-step). */
static inline int product_tile(const struct row_tiles *a, int64_t m, const int8_t *packed, int64_t k4, int64_t p,
                               int64_t panels, int64_t t, __m512i acc[PARTS][MR][NV]) {
    int64_t first = t * a->rows;
    int own = first < a->in_place;
    const uint8_t *rows = own ? a->u + first * a->lda : a->spare + (first - a->in_place) * a->padded;
    int64_t panel_bytes = k4 * NR * 4, share = (panel_bytes / a->tiles + 63) / 64 * 64;
    int64_t lines = p + 1 < panels ? share / 64 : 0;
    const int8_t *panel = packed + p * panel_bytes, *next = packed + (p + 1) * panel_bytes + t * share;
#ifdef HAVE_AMX
    if (a->rows != MR) {
        if (a->rows == AR)
            amx_tile(rows, own ? a->lda : a->padded, panel, k4, acc, next, lines);
        else
            amx_tile2(rows, own ? a->lda : a->padded, panel, k4, acc, next, lines);
        return m - first < a->rows ? (int)(m - first) : (int)a->rows;
    }
#endif
    tile(rows, own ? a->lda : a->padded, panel, k4, acc[0], next, lines, (int)((lines + k4 - 1) / k4));
    return m - first < MR ? (int)(m - first) : MR;
}
#endif

/* out [m, n] float32 = ((u - 128) . W^T) * scale: u uint8 [m, k] (rows lda apart), the weight packed as
 * above with correction[c] = 128 * sum_k W[c][k] (int32 [n]) and scale float32 [n]. `hook` (unless NULL) adds
 * to each row tile of a panel's products as soon as they are stored, while they are in L1 (a LoRA delta's
 * columns: kernels/cpu_decode_layers.c). Returns 0, or -1 where the padded copy of a partial row tile could
 * not be allocated (nothing written). */
int int8_gemm_hooked(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                     const int32_t *correction, const float *scale, int64_t n, float *out, tile_hook_fn *hook,
                     const void *context) {
#ifdef __AVX512VNNI__
    int64_t k4 = (k + 3) / 4, panels = (n + NR - 1) / NR;
    struct row_tiles a;
    if (row_tiles_init(&a, u, lda, m, k))
        return -1;
    /* An output larger than the caches (an LM head's logits) is written with streaming stores: it will not be
     * read again before it leaves the caches, and a plain store first reads each line it writes. On a Zen 4,
     * SmolLM2's head at 256 rows: 16.8 ms against 19.4. */
    int stream = !hook && m * n * (int64_t)sizeof(float) > STREAM_BYTES && n % 16 == 0 && (uintptr_t)out % 64 == 0;
    /* One barrier per call, the region's end (`nowait`): on a shared machine a thread descheduled at a barrier
     * holds the other there (16 weights of 2048-8192 at 128 rows, 2 threads, load 3-4: median 134 ms
     * against 196 with the loop's barrier too). */
#pragma omp parallel
    {
        tiles_begin(&a, k4);
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            for (int64_t t = 0; t < a.tiles; t++) {
                __m512i acc[PARTS][MR][NV];
                int rows = product_tile(&a, m, packed, k4, p, panels, t, acc);
                for (int h = 0; h * MR < rows; h++)
                    store(acc[h], part_rows(rows, h), cols, correction + p * NR, scale + p * NR,
                          out + (t * a.rows + h * MR) * n + p * NR, n, stream);
                if (hook)
                    hook(context, t * a.rows, rows, p * NR, cols, out + t * a.rows * n + p * NR, n, a.rows != MR);
            }
        }
        tiles_end(&a);
        if (stream)
            _mm_sfence(); /* the streamed lines are visible before the caller reads them */
    }
    free(a.spare);
#else
    (void)u, (void)lda, (void)m, (void)k, (void)packed, (void)correction, (void)scale, (void)n, (void)out, (void)hook,
        (void)context;
#endif
    return 0;
}

/* int8_gemm_hooked without a hook. */
int int8_gemm(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed, const int32_t *correction,
              const float *scale, int64_t n, float *out) {
    return int8_gemm_hooked(u, lda, m, k, packed, correction, scale, n, out, NULL, NULL);
}

#ifdef __AVX512VNNI__
/* For rows r < rows of a tile: the largest of y[r][c] = ((acc[r][c] - correction[c]) * scale[c]) * row_scale[r]
 * over the panel's channels c < cols, where larger than best[r] (strictly: an earlier column keeps a tie),
 * into best[r] and index[r] (col0 + c, the first such c). */
static inline void track_max(__m512i acc[MR][NV], int rows, int cols, const int32_t *correction, const float *scale,
                             const float *row_scale, int64_t col0, float *best, int64_t *index) {
    __m512i corr[NV];
    __m512 s[NV];
    __mmask16 m[NV];
    for (int j = 0; j < NV; j++) {
        int left = cols - 16 * j;
        m[j] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        corr[j] = _mm512_maskz_loadu_epi32(m[j], correction + 16 * j);
        s[j] = _mm512_maskz_loadu_ps(m[j], scale + 16 * j);
    }
    for (int r = 0; r < rows; r++) {
        const __m512 rs = _mm512_set1_ps(row_scale[r]);
        __m512 y[NV], top = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < NV; j++) {
            y[j] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], corr[j])), s[j]), rs);
            top = _mm512_mask_max_ps(top, m[j], top, y[j]);
        }
        float peak = _mm512_reduce_max_ps(top);
        if (!(peak > best[r]))
            continue;
        for (int j = 0; j < NV; j++) {
            __mmask16 hit = _mm512_mask_cmp_ps_mask(m[j], y[j], _mm512_set1_ps(peak), _CMP_EQ_OQ);
            if (hit) {
                best[r] = peak;
                index[r] = col0 + 16 * j + __builtin_ctz(hit);
                break;
            }
        }
    }
}
#endif

/* Each row's argmax over columns c < valid of ((u - 128) . W^T)[r][c] * scale[c] * row_scale[r], the values
 * int8_gemm's products times the row scales give, in the same float32 operations: index int64 [m], the
 * first column of a tie (torch.argmax's choice for finite values; callers pass finite row scales). The
 * values are never stored: for an LM head's greedy step the [m, vocab] logits would be written and read
 * back for nothing. Returns 0, or -1 where a copy of the rows could not be allocated. */
int int8_gemm_argmax(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                     const int32_t *correction, const float *scale, int64_t valid, const float *row_scale,
                     int64_t *index) {
#ifdef __AVX512VNNI__
    int64_t k4 = (k + 3) / 4, panels = (valid + NR - 1) / NR;
    struct row_tiles a;
    float *best = malloc((size_t)m * sizeof(float));
    if (best == NULL || row_tiles_init(&a, u, lda, m, k)) {
        free(best);
        return -1;
    }
    for (int64_t r = 0; r < m; r++)
        best[r] = -INFINITY, index[r] = 0;
    int failed = 0;
#pragma omp parallel
    {
        /* this thread's best of its panels (a contiguous range: static), merged below */
        float *mine = malloc((size_t)m * (sizeof(float) + sizeof(int64_t)));
        int64_t *at = (int64_t *)(mine + m);
        if (mine != NULL)
            for (int64_t r = 0; r < m; r++)
                mine[r] = -INFINITY, at[r] = 0;
        tiles_begin(&a, k4);
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            if (mine == NULL)
                continue;
            int cols = valid - p * NR < NR ? (int)(valid - p * NR) : NR;
            for (int64_t t = 0; t < a.tiles; t++) {
                __m512i acc[PARTS][MR][NV];
                int rows = product_tile(&a, m, packed, k4, p, panels, t, acc);
                for (int h = 0; h * MR < rows; h++) {
                    int64_t r0 = t * a.rows + h * MR;
                    track_max(acc[h], part_rows(rows, h), cols, correction + p * NR, scale + p * NR, row_scale + r0,
                              p * NR, mine + r0, at + r0);
                }
            }
        }
        tiles_end(&a);
#pragma omp critical
        {
            if (mine == NULL)
                failed = 1;
            else
                for (int64_t r = 0; r < m; r++)
                    if (mine[r] > best[r] || (mine[r] == best[r] && at[r] < index[r]))
                        best[r] = mine[r], index[r] = at[r];
        }
        free(mine);
    }
    free(a.spare);
    free(best);
    return failed ? -1 : 0;
#else
    (void)u, (void)lda, (void)m, (void)k, (void)packed, (void)correction, (void)scale, (void)valid, (void)row_scale,
        (void)index;
    return -1;
#endif
}

#ifdef __AVX512VNNI__
/* out[r][c] = silu(gate[r][c] * row_scale[r]) x up[r][c] * row_scale[r] (x smooth[c] unless NULL) for rows
 * r < rows of a tile and the panel's NR channels: gate and up the products as `store` wrote them, NR apart. */
static inline void silu_store(int rows, const float *gate, const float *up, const float *row_scale,
                              const float *smooth, float *out, int64_t ldo) {
    for (int j = 0; j < NV; j++) {
        for (int r = 0; r < rows; r++) {
            __m512 sr = _mm512_set1_ps(row_scale[r]);
            __m512 y = silu_times(_mm512_mul_ps(_mm512_loadu_ps(gate + r * NR + 16 * j), sr),
                                  _mm512_mul_ps(_mm512_loadu_ps(up + r * NR + 16 * j), sr));
            if (smooth)
                y = _mm512_mul_ps(y, _mm512_loadu_ps(smooth + 16 * j));
            _mm512_storeu_ps(out + r * ldo + 16 * j, y);
        }
    }
}
#endif

/* A gated MLP's activation straight from its gate_up GEMM: out [m, half] float32 = silu(gate x row_scale) x
 * (up x row_scale) (x smooth [half] unless NULL), where gate and up are int8_gemm's products for the weight's
 * first and last `half` channels (one [gate; up] weight, n = 2 * half), in the same float32 operations as
 * scaling the stored products and applying silu_times. The [m, 2 * half] products are never written: each
 * thread takes pairs of panels (gate channels c .. c + NR - 1 and their up channels), the gate panel's tiles
 * into a buffer of its own, then each up tile into a small one and combined with them. `hook` (unless NULL)
 * adds to each gate and up row tile (all its rows at once) in those buffers first (a LoRA delta's columns: kernels/cpu_decode_layers.c),
 * as it would to int8_gemm's stored products. Returns 0; -2 where half is not a multiple of the panel width
 * (nothing done: use int8_gemm); -1 where a buffer could not be allocated (out then incomplete). */
int int8_gemm_silu_hooked(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                          const int32_t *correction, const float *scale, int64_t half, const float *row_scale,
                          const float *smooth, float *out, tile_hook_fn *hook, const void *context) {
#ifdef __AVX512VNNI__
    if (half % NR)
        return -2;
    if (m == 0)
        return 0;
    int64_t k4 = (k + 3) / 4, pairs = half / NR;
    struct row_tiles a;
    if (row_tiles_init(&a, u, lda, m, k))
        return -1;
    int failed = 0;
#pragma omp parallel
    {
        float *gate = malloc((size_t)(a.tiles * a.rows * NR) * sizeof(float));
        tiles_begin(&a, k4);
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < pairs; q++) {
            if (gate == NULL)
                continue;
            for (int64_t t = 0; t < a.tiles; t++) {
                __m512i acc[PARTS][MR][NV];
                int rows = product_tile(&a, m, packed, k4, q, 2 * pairs, t, acc);
                for (int h = 0; h * MR < rows; h++) {
                    int64_t r0 = t * a.rows + h * MR;
                    store(acc[h], part_rows(rows, h), NR, correction + q * NR, scale + q * NR, gate + r0 * NR, NR, 0);
                }
                if (hook)
                    hook(context, t * a.rows, rows, q * NR, NR, gate + t * a.rows * NR, NR, a.rows != MR);
            }
            int64_t p = pairs + q;
            for (int64_t t = 0; t < a.tiles; t++) {
                __m512i acc[PARTS][MR][NV];
                float up[PARTS * MR * NR];
                int rows = product_tile(&a, m, packed, k4, p, 2 * pairs, t, acc);
                for (int h = 0; h * MR < rows; h++)
                    store(acc[h], part_rows(rows, h), NR, correction + p * NR, scale + p * NR, up + h * MR * NR, NR, 0);
                if (hook)
                    hook(context, t * a.rows, rows, p * NR, NR, up, NR, a.rows != MR);
                for (int h = 0; h * MR < rows; h++) {
                    int64_t r0 = t * a.rows + h * MR;
                    silu_store(part_rows(rows, h), gate + r0 * NR, up + h * MR * NR, row_scale + r0,
                               smooth ? smooth + q * NR : NULL, out + r0 * half + q * NR, half);
                }
            }
        }
        tiles_end(&a);
        if (gate == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        free(gate);
    }
    free(a.spare);
    return failed ? -1 : 0;
#else
    (void)u, (void)lda, (void)m, (void)k, (void)packed, (void)correction, (void)scale, (void)half, (void)row_scale,
        (void)smooth, (void)out, (void)hook, (void)context;
    return -1;
#endif
}

/* int8_gemm_silu_hooked without a hook. */
int int8_gemm_silu(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                   const int32_t *correction, const float *scale, int64_t half, const float *row_scale,
                   const float *smooth, float *out) {
    return int8_gemm_silu_hooked(u, lda, m, k, packed, correction, scale, half, row_scale, smooth, out, NULL, NULL);
}

/* Pack w int8 [n, k] (rows k apart) into panels (`packed`: ceil(n / NR) * ceil(k / 4) * NR * 4 bytes) and
 * write correction[c] = 128 * sum_k w[c][k]. Panel by panel on the threads, each channel's groups of 4 copied
 * as words: a byte at a time on one thread, packing the 1B shape's 1.2 GB took 1.8 s of every start. */
void int8_gemm_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed, int32_t *correction) {
    int64_t k4 = (k + 3) / 4, whole = k / 4, panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int8_t *panel = packed + p * k4 * NR * 4;
        memset(panel, 0, (size_t)(k4 * NR * 4));
        for (int64_t lane = 0; lane < NR && p * NR + lane < n; lane++) {
            const int8_t *row = w + (p * NR + lane) * k;
            int64_t sum = 0;
            for (int64_t i = 0; i < k; i++)
                sum += row[i];
            correction[p * NR + lane] = (int32_t)(128 * sum);
            for (int64_t g = 0; g < whole; g++)
                memcpy(panel + (g * NR + lane) * 4, row + 4 * g, 4);
            for (int64_t i = 4 * whole; i < k; i++)
                panel[(whole * NR + lane) * 4 + i % 4] = row[i];
        }
    }
}
