/* exp of a vector for x <= 0, and SiLU built on it, shared by the native kernels. The includer defines `vec`
 * (float lanes), `ivec` (int32 lanes of the same width) and `splat(float)`. */
#ifndef CPU_VEXP_H
#define CPU_VEXP_H

/* exp(x) lane by lane for x <= 0 (-inf included): exactly 0 below -87, else within ~2 ulp. Plain vector
 * arithmetic (Cody-Waite reduction, degree-6 polynomial) so that it runs a whole vector at a time. */
static inline vec vexp(vec x)
{
    const ivec live = x > splat(-87.0f);
    x = (vec)(((ivec)x & live) | ((ivec)splat(-87.0f) & ~live));
    const vec magic = splat(12582912.0f); /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const vec n = (x * 1.44269504088896341f + magic) - magic;
    const vec r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23; /* 2^n */
    return (vec)((ivec)(p * (vec)bits) & live);
}

#ifdef __AVX512F__
/* silu(g) x u for 16 lanes: sigmoid(g) from exp(-|g|) <= 1, 1 / (1 + e) for g >= 0 and e / (1 + e) below (no
 * overflow for any g). One definition for the MLP's unfused pass and the GEMM's fused epilogue, so that both
 * give the same float32 values. */
static inline __m512 silu_times(__m512 g, __m512 u)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = (__m512)vexp((vec)_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
    return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))), u);
}
#endif

#endif
