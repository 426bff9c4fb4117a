/* Paged decode attention on CPU: each query row over its own keys, read in place from the block pool.
 *
 * Why native code: torch has no paged attention for CPU, and composing one from torch ops gathers every
 * row's blocks into a buffer and reads them twice more (q k^T, then p v): four passes over the cache for
 * one that matters. Here each (row, KV head) task walks its block table once with an online softmax,
 * serving the whole query group of that KV head from one read of each key and value.
 *
 * Pools are [num_kv_heads, num_blocks, BLOCK, HEAD_DIM] (PagedAttention's layout), float32, or bfloat16
 * with -DKV_BF16 (half the bytes to read; widened to float32 on load, all arithmetic in float32), or int8
 * with -DKV_I8 (a quarter: each key and value vector of HEAD_DIM is stored as round(x / s) with its own
 * scale s = max|x| / 127, kept in float32 scale pools [num_kv_heads, num_blocks, BLOCK]; the key's scale
 * multiplies its score and the value's its probability; on AVX-512 the scores are integer dot products
 * with the queries rounded to int16, see INT_SCORES). q and out are float32
 * [rows, num_kv_heads * GROUP, HEAD_DIM]. HEAD_DIM, GROUP (query heads per KV head) and BLOCK
 * (tokens per block) are compile-time constants (-D flags) so that every loop has a fixed trip count; the
 * build is cached per combination (kernels/cpu_attention.py). Threads: OpenMP, the runtime torch already
 * loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h" /* paged_write and paged_decode as cpu_decode_layers.c calls them */

#if defined(__AVX512F__)
#define VEC 16
typedef __m512 native_vec;
static inline float hsum(native_vec v) { return _mm512_reduce_add_ps(v); }
static inline float hmax(native_vec v) { return _mm512_reduce_max_ps(v); }
#define VMAX _mm512_max_ps
#elif defined(__AVX2__)
#define VEC 8
typedef __m256 native_vec;
static inline float hsum(native_vec v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hmax(native_vec v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#define VMAX _mm256_max_ps
#else
#error "the CPU attention kernel needs AVX2 or AVX-512"
#endif

#if HEAD_DIM % VEC != 0 || BLOCK % VEC != 0
#error "HEAD_DIM and BLOCK must be multiples of the vector width"
#endif
#define CHUNKS (HEAD_DIM / VEC)

typedef float vec __attribute__((vector_size(VEC * 4)));
typedef int32_t ivec __attribute__((vector_size(VEC * 4)));

static inline vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vec splat(float x) { return (vec){0} + x; }

#ifdef KV_BF16
typedef uint16_t kv_t;
typedef uint16_t hvec __attribute__((vector_size(VEC * 2)));
typedef uint32_t uvec __attribute__((vector_size(VEC * 4)));
/* bfloat16 is the top half of a float32: widen, shift into place. */
static inline vec load_kv(const kv_t *p)
{
    hvec h;
    memcpy(&h, p, sizeof h);
    return (vec)(__builtin_convertvector(h, uvec) << 16);
}
/* float32 -> bfloat16, rounded to nearest even (NaN stays a quiet NaN), as torch rounds. */
static inline void store_kv(kv_t *p, vec x)
{
    const uvec u = (uvec)x;
    const uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uvec nan = (uvec)(x != x);
    const uvec out = (rounded & ~nan) | (0x7fc0u & nan);
    const hvec h = __builtin_convertvector(out, hvec);
    memcpy(p, &h, sizeof h);
}
#elif defined(KV_I8)
typedef int8_t kv_t;
/* int8 -> float32 widening and float32 -> int8 narrowing of one vector (the compiler's generic vector
 * conversions here come out as scalar code). Narrowing takes values already rounded, within -127..127. */
#if VEC == 16
static inline vec load_kv(const kv_t *p)
{
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void store_i8(kv_t *p, vec x) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32((__m512)x))); }
#else
static inline vec load_kv(const kv_t *p)
{
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void store_i8(kv_t *p, vec x)
{
    const __m256i i = _mm256_cvtps_epi32((__m256)x);
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(h, h));
}
#endif
#else
typedef float kv_t;
static inline vec load_kv(const kv_t *p) { return load(p); }
static inline void store_kv(kv_t *p, vec x) { memcpy(p, &x, sizeof x); }
#endif

static inline vec vmax(vec a, vec b) { return (vec)VMAX((native_vec)a, (native_vec)b); }

#include "cpu_vexp.h"

#if defined(KV_I8) && VEC == 16 && defined(__AVX512BW__) && HEAD_DIM % 32 == 0 && BLOCK % 16 == 0
/* Scores of int8 keys in integer arithmetic: each query is rounded to int16 with its own scale (2^-15 of
 * its largest value: far below the keys' int8 rounding), each key widened to int16, and a key's dot product
 * is HEAD_DIM / 32 multiply-add-pairs (vpdpwssd with VNNI) into 16 int32 partial sums. The partial sums of
 * 16 keys are then added across lanes together (reduce16), not one key at a time: no int8 -> float32
 * widening of the keys and no horizontal sum per key, the two costs of the float path. */
#define INT_SCORES 1
#define I16_CHUNKS (HEAD_DIM / 32)
#ifdef __AVX512VNNI__
#define DOT2(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DOT2(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

/* Lane t of the result: the sum of the 16 lanes of v[t], for 16 vectors at once (45 adds and shuffles for
 * 16 sums instead of 16 horizontal sums). */
static inline __m512i reduce16(const __m512i *v)
{
    __m512i x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        x[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: four vectors' sums over that lane */
        y[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]),
                                _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* 128-bit lanes added in pairs */
        z[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(z[0], z[1], 0x88), _mm512_shuffle_i32x4(z[0], z[1], 0xdd));
}

/* A query (HEAD_DIM floats, as I16_CHUNKS vectors) rounded to int16; returns its scale. */
static inline float query_to_int16(__m512i *dst, const vec *x)
{
    vec top = splat(0.0f);
    for (int c = 0; c < CHUNKS; c++) top = vmax(top, vmax(x[c], -x[c]));
    const float s = hmax(top) / 32767.0f;
    const vec inv = splat(s > 0.0f ? 1.0f / s : 0.0f);
    for (int c = 0; c < I16_CHUNKS; c++) {
        const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32((__m512)(x[2 * c] * inv)));
        const __m256i hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32((__m512)(x[2 * c + 1] * inv)));
        dst[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    return s;
}
#endif

#ifdef KV_I8
/* One vector of HEAD_DIM floats as int8 with its scale: s = max|x| / 127, q = round(x / s) (ties to even,
 * as torch.round), and s = 0 (q = 0) for a zero vector. */
static inline void store_row(kv_t *dst, float *scale, const float *x)
{
    vec top = splat(0.0f);
    for (int c = 0; c < HEAD_DIM; c += VEC) {
        const vec a = load(x + c);
        top = vmax(top, vmax(a, -a));
    }
    const float s = hmax(top) / 127.0f;
    *scale = s;
    const vec div = splat(s > 0.0f ? s : 1.0f);
    const vec magic = splat(12582912.0f); /* 1.5 * 2^23: adding and subtracting it rounds to nearest even */
    for (int c = 0; c < HEAD_DIM; c += VEC) store_i8(dst + c, (load(x + c) / div + magic) - magic);
}
#else
static inline void store_row(kv_t *dst, float *scale, const float *x)
{
    (void)scale;
    for (int c = 0; c < HEAD_DIM; c += VEC) store_kv(dst + c, load(x + c));
}
#endif

/* The step's new keys and values into their slots: k and v are float32 [n, num_kv_heads, HEAD_DIM] with
 * heads and HEAD_DIM packed and tokens k_stride / v_stride floats apart (views into the fused qkv output
 * need no copy), token i goes to slot slots[i] (block * BLOCK + offset) of every head's pool, converted to
 * the pool's dtype (int8 pools: with its scale into the scale pools, which other dtypes do not have). One
 * pass instead of a cast and an index_copy per pool. */
void paged_write(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                 int64_t n, void *k_data, void *v_data, float *k_scale, float *v_scale, int64_t num_kv_heads,
                 int64_t num_blocks)
{
    kv_t *const k_pool = k_data, *const v_pool = v_data;
#pragma omp parallel for collapse(2) if (n * num_kv_heads > 4096)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t slot = h * num_blocks * BLOCK + slots[i];
            store_row(k_pool + slot * HEAD_DIM, k_scale + slot, k + i * k_stride + h * HEAD_DIM);
            store_row(v_pool + slot * HEAD_DIM, v_scale + slot, v + i * v_stride + h * HEAD_DIM);
        }
    }
}

/* Whether this build computes int8 keys' scores in integers (queries rounded to int16, see INT_SCORES). */
int paged_integer_scores(void)
{
#ifdef INT_SCORES
    return 1;
#else
    return 0;
#endif
}

/* Value chunks one pass over a block's keys accumulates, for int8 pools: GROUP x PASS accumulators that
 * stay in registers (16 vector registers on AVX2, 32 on AVX-512; the others hold a value chunk and a
 * probability). With all CHUNKS at once AVX2 kept 18 of SmolLM2's 3 x 8 accumulators on the stack, a load
 * and a store around every multiply-add; in passes of half the chunks each value chunk is still loaded and
 * widened once, and the pass ran ~1.2x faster on an AVX2 Zen 3. Float32 and bfloat16 pools keep one pass:
 * split, they ran ~1.08x slower at 256 rows (their values come from DRAM) and no faster in cache. */
#define ACC_REGS (VEC == 16 ? 24 : 12)
#if !defined(KV_I8) || GROUP * CHUNKS <= ACC_REGS
#define PASS CHUNKS
#elif CHUNKS % 2 == 0 && GROUP * CHUNKS / 2 <= ACC_REGS
#define PASS (CHUNKS / 2)
#elif CHUNKS % 4 == 0 && GROUP * CHUNKS / 4 <= ACC_REGS
#define PASS (CHUNKS / 4)
#else
#define PASS 1
#endif

/* Blocks whose scores one softmax update covers: the running max, the rescale of the accumulators and the
 * sum are a serial chain of horizontal reductions and an exp per update, so one per TILE blocks instead of
 * one per block. */
#define TILE 4

/* Scores of keys lo .. hi - 1 of one block (kb: its keys; its key scales at scales for int8 pools) into
 * s[g * TILE * BLOCK + t], -inf for the block's other keys. */
static inline void block_scores(float *s, const kv_t *kb, const float *scales, int lo, int hi,
#ifdef INT_SCORES
                                const __m512i q16[GROUP][I16_CHUNKS], const float *q_scale
#else
                                const vec qs[GROUP][CHUNKS]
#endif
)
{
    (void)scales;
#ifdef INT_SCORES
    /* every key of the block (int8 keys past `hi` are stale but finite), then the ones outside lo .. hi - 1
     * are set to -inf */
    __m512i part[GROUP][BLOCK];
    for (int t = 0; t < BLOCK; t++) {
        __m512i k[I16_CHUNKS];
        for (int c = 0; c < I16_CHUNKS; c++)
            k[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kb + t * HEAD_DIM + c * 32)));
        for (int g = 0; g < GROUP; g++) {
            __m512i dot = _mm512_setzero_si512();
            for (int c = 0; c < I16_CHUNKS; c++) dot = DOT2(dot, q16[g][c], k[c]);
            part[g][t] = dot;
        }
    }
    for (int g = 0; g < GROUP; g++) {
        float *sg = s + g * TILE * BLOCK;
        for (int t = 0; t < BLOCK; t += 16) {
            const vec sc = (vec)_mm512_cvtepi32_ps(reduce16(&part[g][t])) * load(scales + t) * q_scale[g];
            memcpy(sg + t, &sc, sizeof sc);
        }
        for (int t = 0; t < lo; t++) sg[t] = -INFINITY;
        for (int t = hi; t < BLOCK; t++) sg[t] = -INFINITY;
    }
#else
    for (int g = 0; g < GROUP; g++)
        for (int t = 0; t < BLOCK; t++) s[g * TILE * BLOCK + t] = -INFINITY;
    for (int t = lo; t < hi; t++) {
        vec k[CHUNKS];
        for (int c = 0; c < CHUNKS; c++) k[c] = load_kv(kb + t * HEAD_DIM + c * VEC);
        for (int g = 0; g < GROUP; g++) {
#if CHUNKS >= 8
            /* two chains of multiply-adds instead of one CHUNKS long: each waits on the one before */
            vec dot = qs[g][0] * k[0], odd = qs[g][1] * k[1];
            for (int c = 2; c < CHUNKS; c += 2) {
                dot += qs[g][c] * k[c];
                odd += qs[g][c + 1] * k[c + 1];
            }
            dot += odd;
#else
            vec dot = qs[g][0] * k[0];
            for (int c = 1; c < CHUNKS; c++) dot += qs[g][c] * k[c];
#endif
#ifdef KV_I8
            s[g * TILE * BLOCK + t] = hsum(dot) * scales[t];
#else
            s[g * TILE * BLOCK + t] = hsum(dot);
#endif
        }
    }
#endif
}

/* The (row, KV head) tasks [*lo, *hi) (task t: row t / heads, head t % heads) of thread `id` of `threads`:
 * contiguous and of about equal cost (a task's keys, plus a block's worth for its fixed work), each task to
 * the thread whose share holds the middle of its cost. Contiguous, so that a thread reads the rows that the
 * step's other passes gave it (the native layers split rows in halves too): SmolLM2 steps of 64 rows took
 * 0.92-0.99 of the time they took with tasks handed out one by one (dynamic, interleaving the threads'
 * rows), lock-step in three runs. Weighed by keys, so that a prefill chunk's short and long rows do not
 * leave one thread waiting. */
static void thread_tasks(const int64_t *lens, const int64_t *first, int64_t rows, int64_t heads, int id,
                         int threads, int64_t *lo, int64_t *hi)
{
#define TASK_COST(r) (lens[r] - first[r] + BLOCK)
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++)
        total += TASK_COST(r) * heads;
    const int64_t start = total * id / threads, end = total * (id + 1) / threads, n = rows * heads;
    int64_t t = 0, sum = 0;
    for (; t < n && sum + TASK_COST(t / heads) / 2 < start; t++)
        sum += TASK_COST(t / heads);
    *lo = t;
    for (; t < n && sum + TASK_COST(t / heads) / 2 < end; t++)
        sum += TASK_COST(t / heads);
    *hi = t;
#undef TASK_COST
}

/* The keys (k_pool: a pool's block addresses) of the TILE blocks after position `tile` of task (row
 * task / num_kv_heads, its KV head) that ends at end: after the task's last tile, the first tile of the next
 * task, unless that is end_task; NULL where there are none. */
static inline void next_tile(const kv_t *k_pool, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                             const int64_t *first, int64_t num_kv_heads, int64_t num_blocks, int64_t task,
                             int64_t tile, int64_t end_task, const kv_t *ahead[TILE])
{
    int64_t pos = tile + TILE * BLOCK;
    if (pos >= lens[task / num_kv_heads] && ++task < end_task)
        pos = first[task / num_kv_heads] - first[task / num_kv_heads] % BLOCK;
    const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
    for (int b = 0; b < TILE; b++, pos += BLOCK)
        ahead[b] = task < end_task && pos < lens[r]
                       ? k_pool + (h * num_blocks + tables[r * table_stride + pos / BLOCK]) * BLOCK * HEAD_DIM
                       : NULL;
}

/* All of a block's keys and values (k: its keys, v_off: the values' distance) into the caches, and for int8
 * pools their scales (one cache line each). */
static inline void fetch_block(const kv_t *k, int64_t v_off, const kv_t *k_pool, const float *k_scale,
                               const float *v_scale)
{
    for (int i = 0; i < BLOCK * HEAD_DIM; i += 64 / sizeof(kv_t)) {
        __builtin_prefetch(k + i, 0, 2);
        __builtin_prefetch(k + v_off + i, 0, 2);
    }
#ifdef KV_I8
    __builtin_prefetch(k_scale + (k - k_pool) / HEAD_DIM);
    __builtin_prefetch(v_scale + (k - k_pool) / HEAD_DIM);
#else
    (void)k_pool, (void)k_scale, (void)v_scale;
#endif
}

/* Row r attends to its keys at positions first[r] .. lens[r] - 1; tables is [rows, table_stride]. Each
 * (row, KV head) task walks its blocks TILE at a time: scores, one online-softmax update, then p v. Blocks
 * are scattered pieces that the hardware prefetcher does not follow, so while a tile computes, the next
 * tile's blocks are fetched (after a task's last tile, the next task's first): with the fetch one block
 * ahead, a block from DRAM came too late, and each task's first blocks were waited for whole. */
void paged_decode(const float *q, const void *k_data, const void *v_data, const float *k_scale,
                  const float *v_scale, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                  const int64_t *first, float *out, int64_t rows, int64_t num_kv_heads, int64_t num_blocks,
                  float scale)
{
    const kv_t *const k_pool = k_data, *const v_pool = v_data;
#pragma omp parallel
    {
        int64_t lo_task, hi_task;
        thread_tasks(lens, first, rows, num_kv_heads, omp_get_thread_num(), omp_get_num_threads(), &lo_task,
                     &hi_task);
        for (int64_t task = lo_task; task < hi_task; task++) {
            const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
            vec acc[GROUP][CHUNKS], qs[GROUP][CHUNKS];
            float m[GROUP], l[GROUP]; /* running max and sum of the online softmax */
            const float *qr = q + (r * num_kv_heads + h) * GROUP * HEAD_DIM;
            for (int g = 0; g < GROUP; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                for (int c = 0; c < CHUNKS; c++) {
                    acc[g][c] = splat(0.0f);
                    qs[g][c] = load(qr + g * HEAD_DIM + c * VEC) * scale;
                }
            }
#ifdef INT_SCORES
            __m512i q16[GROUP][I16_CHUNKS];
            float q_scale[GROUP];
            for (int g = 0; g < GROUP; g++) q_scale[g] = query_to_int16(q16[g], qs[g]);
#endif
            const int64_t *table = tables + r * table_stride;
            const int64_t end = lens[r];
            const kv_t *const k_head = k_pool + h * num_blocks * BLOCK * HEAD_DIM;
            const int64_t v_off = v_pool - k_pool;
            for (int64_t tile = first[r] - first[r] % BLOCK; tile < end; tile += TILE * BLOCK) {
                const int64_t blocks_left = (end - tile + BLOCK - 1) / BLOCK;
                const int n = blocks_left < TILE ? (int)blocks_left : TILE;
                float s[GROUP][TILE * BLOCK];
                const kv_t *kb[TILE], *ahead[TILE];
                int lo[TILE], hi[TILE];
                next_tile(k_pool, tables, table_stride, lens, first, num_kv_heads, num_blocks, task, tile, hi_task,
                          ahead);
                for (int b = 0; b < TILE; b++) {
                    if (ahead[b])
                        fetch_block(ahead[b], v_off, k_pool, k_scale, v_scale);
                    if (b >= n)
                        continue;
                    const int64_t start = tile + b * BLOCK;
                    kb[b] = k_head + table[start / BLOCK] * BLOCK * HEAD_DIM;
                    lo[b] = start > first[r] ? 0 : (int)(first[r] - start);
                    hi[b] = end - start < BLOCK ? (int)(end - start) : BLOCK;
#ifdef KV_I8
                    const float *scales = k_scale + (kb[b] - k_pool) / HEAD_DIM;
#else
                    const float *scales = NULL;
#endif
                    block_scores(&s[0][b * BLOCK], kb[b], scales, lo[b], hi[b],
#ifdef INT_SCORES
                                 q16, q_scale
#else
                                 qs
#endif
                    );
                }
                for (int g = 0; g < GROUP; g++) {
                    vec top = load(s[g]);
                    for (int t = VEC; t < n * BLOCK; t += VEC) top = vmax(top, load(&s[g][t]));
                    const float new_m = fmaxf(m[g], hmax(top));
                    const float rescale = vexp(splat(m[g] - new_m))[0];
                    vec sum = splat(0.0f);
                    for (int t = 0; t < n * BLOCK; t += VEC) {
                        const vec p = vexp(load(&s[g][t]) - new_m);
                        memcpy(&s[g][t], &p, sizeof p);
                        sum += p;
                    }
                    l[g] = l[g] * rescale + hsum(sum);
                    m[g] = new_m;
                    for (int c = 0; c < CHUNKS; c++) acc[g][c] *= rescale;
                }
                for (int b = 0; b < n; b++) {
                    const kv_t *vb = kb[b] + v_off;
                    const float *p[GROUP]; /* the block's probabilities (int8 pools: times each value's scale) */
#ifdef KV_I8
                    float scaled[GROUP][BLOCK];
                    const float *vscales = v_scale + (vb - v_pool) / HEAD_DIM;
                    for (int g = 0; g < GROUP; g++) {
                        for (int t = 0; t < BLOCK; t += VEC) {
                            const vec x = load(&s[g][b * BLOCK + t]) * load(vscales + t);
                            memcpy(&scaled[g][t], &x, sizeof x);
                        }
                        p[g] = scaled[g];
                    }
#else
                    for (int g = 0; g < GROUP; g++) p[g] = &s[g][b * BLOCK];
#endif
                    for (int c0 = 0; c0 < CHUNKS; c0 += PASS) {
                        vec a[GROUP][PASS];
                        for (int g = 0; g < GROUP; g++)
                            for (int i = 0; i < PASS; i++) a[g][i] = acc[g][c0 + i];
                        for (int t = lo[b]; t < hi[b]; t++)
                            for (int i = 0; i < PASS; i++) {
                                const vec v = load_kv(vb + t * HEAD_DIM + (c0 + i) * VEC);
                                for (int g = 0; g < GROUP; g++) a[g][i] += p[g][t] * v;
                            }
                        for (int g = 0; g < GROUP; g++)
                            for (int i = 0; i < PASS; i++) acc[g][c0 + i] = a[g][i];
                    }
                }
            }
            float *o = out + (r * num_kv_heads + h) * GROUP * HEAD_DIM;
            for (int g = 0; g < GROUP; g++) {
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int c = 0; c < CHUNKS; c++) {
                    const vec y = acc[g][c] * inv;
                    memcpy(o + g * HEAD_DIM + c * VEC, &y, sizeof y);
                }
            }
        }
    }
}
