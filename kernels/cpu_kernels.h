/* The interface of the native CPU kernels, in one place: the entry points each library exports (to ctypes,
 * and to cpu_decode_layers.c, which calls the GEMM's and the attention's through function pointers) and the
 * structs kernels/cpu_decode_layers.py mirrors as ctypes structures.
 *
 * Why one header: every kernel source includes it, so the compiler checks each definition against the
 * declaration here, and the function pointer types are the functions' own types (`gemm_fn int8_gemm;`
 * declares int8_gemm as a gemm_fn). The ctypes mirrors are checked against struct_layout's table by
 * tests/kernels/test_native_interface.py. kernels/native_build.py keys its cache on this text too, so a
 * change here rebuilds every library.
 */
#ifndef CPU_KERNELS_H
#define CPU_KERNELS_H

#include <stdint.h>

/* kernels/cpu_int8_gemm.c: the W8A8 GEMM on a weight packed into its panels. Without AVX-512 VNNI at build
 * time, int8_gemm_available returns 0 and the others are stubs. */
typedef int gemm_fn(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                    const int32_t *correction, const float *scale, int64_t n, float *out);
typedef int gemm_silu_fn(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                         const int32_t *correction, const float *scale, int64_t half, const float *row_scale,
                         const float *smooth, float *out);
/* Adds to a tile of a GEMM's products before an epilogue reads them: rows r0 .. r0 + rows - 1 and columns
 * c0 .. c0 + cols - 1 of the [m, n] products (scaled by the column scales, not yet by the row scales), the
 * tile [rows, cols] ld apart. Called from the GEMM's threads at once, each on tiles of its own. `amx`: the
 * GEMM runs on AMX, and the thread's tiles 0-5 are configured 16 rows x 64 bytes, the hook's to use until it
 * returns (reading the configuration back, sttilecfg, took a quarter of the LoRA hook's time). */
typedef void tile_hook_fn(const void *context, int64_t r0, int64_t rows, int64_t c0, int64_t cols, float *tile,
                          int64_t ld, int amx);
/* int8_gemm with `hook` (unless NULL) called on every tile of products as they are stored (never streamed). */
typedef int gemm_hooked_fn(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                           const int32_t *correction, const float *scale, int64_t n, float *out, tile_hook_fn *hook,
                           const void *context);
/* int8_gemm_silu with `hook` (unless NULL) called on every gate and up tile before the SiLU. */
typedef int gemm_silu_hooked_fn(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                                const int32_t *correction, const float *scale, int64_t half, const float *row_scale,
                                const float *smooth, float *out, tile_hook_fn *hook, const void *context);
gemm_fn int8_gemm;
gemm_hooked_fn int8_gemm_hooked;
gemm_silu_fn int8_gemm_silu;
gemm_silu_hooked_fn int8_gemm_silu_hooked;
int int8_gemm_argmax(const uint8_t *u, int64_t lda, int64_t m, int64_t k, const int8_t *packed,
                     const int32_t *correction, const float *scale, int64_t valid, const float *row_scale,
                     int64_t *index);
void int8_gemm_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed, int32_t *correction);
int int8_gemm_available(void);

/* kernels/cpu_w4a8_gemm.c: the W4A8 GEMM of small steps on int4 weights packed into its panels. Without
 * AVX-512 VNNI at build time, w4a8_available returns 0 and w4a8_gemm is a stub. */
typedef int w4a8_fn(const float *x, int64_t lda, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *out);
w4a8_fn w4a8_gemm;
int w4a8_available(void);
void w4a8_pack(const uint8_t *qweight, const uint16_t *scales, const uint16_t *mins, int64_t n, int64_t k,
               uint8_t *packed);
void w4a8_unpack(const uint8_t *packed, int64_t n, int64_t k, uint8_t *qweight, uint16_t *scales, uint16_t *mins);

/* kernels/cpu_quantize.c: the load's round-to-nearest weight quantizers and their inverse, bit for bit
 * kernels/wq_reference.py's; w is float32 (bf16 == 0) or bfloat16 bits. Plain C: available everywhere. */
void quantize_int4(const void *w, int bf16, int64_t n, int64_t k, int64_t g, uint8_t *packed, _Float16 *scales,
                   _Float16 *mins);
void quantize_int8(const void *w, int bf16, int64_t n, int64_t k, int64_t g, float bound, int8_t *q,
                   float *scales32, _Float16 *scales16);
void dequantize(const void *q, int bits, int64_t n, int64_t k, int64_t g, const float *scales, const float *mins,
                float *out);
int quantize_available(void);

/* kernels/cpu_attention.c: the paged attention's write and decode. The pools' element type is the build's
 * (float32, bfloat16 or int8: -DKV_BF16, -DKV_I8), hence untyped pool pointers. */
typedef void write_fn(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                      int64_t n, void *k_pool, void *v_pool, float *k_scale, float *v_scale, int64_t num_kv_heads,
                      int64_t num_blocks);
typedef void decode_fn(const float *q, const void *k_pool, const void *v_pool, const float *k_scale,
                       const float *v_scale, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                       const int64_t *first, float *out, int64_t rows, int64_t num_kv_heads, int64_t num_blocks,
                       float scale);
write_fn paged_write;
decode_fn paged_decode;
int paged_integer_scores(void);

/* kernels/cpu_decode_layers.c: a run of decoder layers, W8A8 or weight-only (W4A8). */

/* A linear: the W8A8 GEMM's packed weight, correction and column scales, and the smoothing vector its
 * input is multiplied by (NULL: none). y [rows, n] = x [rows, k] W^T. Its resident LoRA pairs, stacked per
 * adapter slot (NULL where no slot's adapter targets it): A^T [slots, k, lora_rank] divided by the smoothing
 * vector along k (projecting the smoothed input, x A^T = (x smooth)(A^T / smooth), which the GEMM's input
 * pass leaves in hand) and B^T scaled [slots, lora_rank, n], zero past each slot's own rank; a row of adapter
 * slot i adds x A^T[i] B^T[i]. lora_band [ceil(n / 16), 2]: for each 16 columns, the ranks [lo, hi) outside
 * which every slot's B^T is zero there (a fused linear's B is block-diagonal: each part's columns take only
 * its own ranks), NULL: all ranks. lora_a16 and lora_b16 (NULL: the float32 pairs' loops): the same pairs in
 * bfloat16 as AMX's B operand, for the deltas' tiles or dot products (struct step's lora_tiles): A^T / smooth [slots, ceil(lora_rank / 16), kp / 2, 16, 2]
 * (kp: k up to a multiple of 32, zeros past k) and B^T [slots, ceil(n / 16), bp / 2, 16, 2] (bp: lora_rank up
 * to a multiple of 16, and one tile's 512 values more at the end), each 16 columns' values with pairs of rows
 * side by side. A tile of B^T takes 32 ranks: past bp it reads the next columns' (or the end's zeros), which
 * meet the projections' zeros there. w4 (NULL: none): the same weight as int4 in the W4A8 GEMM's panels, which
 * weight-only steps read (their input neither smoothed nor quantized here: the W4A8 GEMM quantizes it). */
struct linear {
    const int8_t *panels;
    const int32_t *correction;
    const float *scale;
    const float *smooth;
    int64_t n, k;
    const float *lora_a, *lora_b;
    int64_t lora_rank;
    const int32_t *lora_band;
    const uint16_t *lora_a16, *lora_b16;
    const uint8_t *w4;
    const float *bias; /* [n], added to the scaled products (NULL: none; the layers take only qkv's) */
};

struct layer {
    const float *input_norm, *post_norm; /* RMSNorm weights [hidden] */
    struct linear qkv, o, gate_up, down;
    void *k_pool, *v_pool;   /* this layer's KV pools, in the attention build's dtype */
    float *k_scale, *v_scale; /* int8 pools' scale pools, else NULL */
};

/* What every layer of the step shares: shapes, the rows' positions and block tables, the kernels, and
 * scratch buffers (sizes in cpu_decode_layers.py). */
struct step {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, attention_scale;
    const float *cos, *sin; /* [rows, head_dim / 2] */
    const int64_t *slots, *tables, *lens, *first;
    int64_t table_stride, num_blocks;
    gemm_hooked_fn *gemm; /* the GEMM (int8_gemm_hooked: adapter rows' deltas added to its tiles) */
    gemm_silu_hooked_fn *gemm_silu; /* the GEMM's fused gated-MLP entry (int8_gemm_silu_hooked) */
    write_fn *write;
    decode_fn *decode;
    uint8_t *u;
    float *sx, *tmp, *qkv, *q, *attn, *gate_up, *proj;
    /* each row's LoRA adapter slot (-1: the base model), NULL when no row has one; scratch for each row's
     * rank-space projection (lora_t, lora_width floats a row: the widest lora_rank) and, where the pairs are
     * in bfloat16, for each row's input, then its projections, in bfloat16 (lora_x16: the widest input or
     * lora_width up to a multiple of 32 a row, and 16 rows more) */
    const int64_t *lora_slots;
    float *lora_t;
    int64_t lora_width;
    uint16_t *lora_x16;
    int64_t lora_tiles; /* bfloat16 pairs on AMX's tiles (lora_tiles_available), else AVX-512 BF16's dot products */
    /* NULL: a W8A8 step. Else a weight-only step: every linear's w4 on this GEMM (w4a8_gemm), the rows' scales
     * (sx) all 1, no LoRA rows */
    w4a8_fn *gemm_w4;
};

/* Without AVX-512 (BW) at build time, decode_layers_available returns 0, decode_layers fails, lora_delta and
 * quantize_rows are stubs and split_rows is absent. */
int decode_layers(const struct layer *layers, int64_t count, const struct step *s, float *x,
                  double *attention_seconds);
void split_rows(const struct step *s, int threads, int64_t *bounds);
/* Whether decode_layers splits a step of `rows` between `threads` threads by rows (else pass by pass): enough
 * rows a thread, and layers as small as `layer`. */
int splits_by_rows(const struct layer *layer, int64_t rows, int threads);
/* out [rows, n] = y + each row's LoRA delta x [rows, k] A^T[slot] B^T[slot] (pairs as in struct linear; a
 * row of slot -1, or past the first `slotted`, copies y): a linear's deltas where the torch layers run it. */
void lora_delta(const float *x, const float *y, float *out, const int64_t *slots, int64_t slotted, int64_t rows,
                int64_t k, int64_t n, const float *a, const float *b, int64_t rank);
/* u [m, k] = round(x / s) + 128 and scales [m] = s = max |x| / 127 per row (1 for an all-zero row): each row of
 * x [m, k] quantized as the native layers quantize a linear's input, bit for bit
 * kernels.w8a8_reference.quantize_rows(x, 128); a row with a NaN or an infinity gets a NaN scale. */
void quantize_rows(const float *x, int64_t m, int64_t k, uint8_t *u, float *scales);
int decode_layers_available(void);
/* Whether the LoRA deltas can run on AMX's bfloat16 tiles here (built with AMX-BF16, the CPU has it, Linux
 * grants the tile state): struct linear's lora_a16 and lora_b16 are then read. */
int lora_tiles_available(void);
/* Whether the LoRA deltas can run on AVX-512 BF16's dot products over the same bfloat16 pairs (built with it,
 * so for the CPU the build is for). */
int lora_dots_available(void);
/* Entry i of the layout of the structs above, in every build: the struct's name, a field's name, offset and
 * size, or for the struct's own size a NULL field. Returns 0 past the last entry. */
int struct_layout(int64_t i, const char **structure, const char **field, int64_t *offset, int64_t *size);

#endif
