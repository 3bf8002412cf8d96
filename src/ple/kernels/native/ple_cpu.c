/* Fused CPU kernels of the PLE layer, compiled on first use by ple.kernels.native (plain C, no Python API).
 *
 * ple_gate_conv: gate (three grouped RMS norms, key/query match, gated value, conv input), the
 * dilated causal depthwise conv over a packed batch with its state pool, SiLU and the residual, in
 * one pass over each token's row. Each work unit is a token range of one request; it keeps the conv
 * inputs of its last W+1 rows in an fp32 ring (rounded to the activation dtype, so every value equals
 * the one stored in the state), and recomputes the W rows before its range. The state slot of a
 * request is rewritten by whichever unit of that request finishes last, after all of its reads.
 *
 * Rounding follows ple.ops.gate.torch_impl + ple.ops.conv.torch_impl: fp32 arithmetic, one rounding
 * of v, of c, of the residual v + hidden, and of the output.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ple_common.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : r;
}

ALWAYS_INLINE float ld(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

ALWAYS_INLINE void st(void *p, int64_t i, float x, int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* Store a value already rounded to the activation dtype (rnd): bf16 is then its high half, exactly. */
ALWAYS_INLINE void st_exact(void *p, int64_t i, float x, int bf) {
    if (bf) {
        uint32_t u;
        memcpy(&u, &x, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = x;
    }
}

ALWAYS_INLINE float rnd(float x, int bf) { return bf ? bf16_to_f32(f32_to_bf16(x)) : x; }

/* 1/d for d >= 1 within 2 ulp (d beyond 2^125 is taken as 2^125): a bit-level first guess refined by
 * three Newton steps, all multiply-adds. A vector division costs more than the rest of the SiLU. */
ALWAYS_INLINE float recip_ge1(float d) {
    d = d < 4.2535296e37f ? d : 4.2535296e37f;
    uint32_t u;
    memcpy(&u, &d, 4);
    u = 0x7EF311C3u - u;
    float r;
    memcpy(&r, &u, 4);
    r = r * (2.0f - d * r);
    r = r * (2.0f - d * r);
    r = r * (2.0f - d * r);
    return r;
}

/* SiLU, a * sigmoid(a) */
ALWAYS_INLINE float silu(float a) { return a * recip_ge1(1.0f + ple_exp_vec(-a)); }

/* ---------------------------------------------------------------------------------------------------
 * Rows written by hand for CPUs with AVX-512 BF16 (the `avx512bf16` instruction set below): the two
 * loops of a row that round to bf16 four times per channel (the gate's conv input and residual, the
 * conv's SiLU and output) in intrinsics. A vector of 16 values is rounded with VCVTNEPS2BF16 (one
 * instruction, round to nearest even); that instruction reads denormal inputs as zero and writes
 * another NaN than PyTorch's 0x7FC0, so a vector holding either (one VFPCLASSPS test) takes the exact
 * integer rounding instead: the stored bits are PyTorch's in every case. SiLU's exponential is a shorter
 * polynomial and its reciprocal VRCP14PS refined by one Newton step (see x512_silu_add): its outputs
 * differ from the other variants' in the last few bits of fp32 before rounding. The sums are the other
 * variants' (same order, fused multiply-adds).
 */
#if defined(__x86_64__) && defined(__GNUC__)
#define PLE_X86 1
#include <immintrin.h>

#if defined(__clang__) /* clang takes instruction sets only in the attribute; its default width is used */
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2,f16c"
#else /* 512-bit vectors (gcc's default for AVX-512 is 256-bit) */
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2,f16c,prefer-vector-width=512"
#endif
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define PLE_X512 1 /* the compiler has the AVX-512 BF16 intrinsics: the avx512bf16 variant is built */
#endif
#endif

#ifdef PLE_X86
/* Columns cols[0 .. nc-1] of a slot of the [S, C, L] layout (channel i's L values are one run from
 * `slot`), widened to fp32: hist[cols[k] * C + i] = slot[i * L + cols[k]], 8 channels a gather, for every
 * vector variant (16-channel AVX-512 gathers were measured no faster). The scalar loop it replaces in
 * run_unit cost about 40 us per decode request of 10,240 channels. A bf16 lane gathers the 32-bit word
 * that starts at its element (the element is its low half), so the last channel, whose word may end past
 * the slot, is read alone. The values are the scalar loop's exactly. */
__attribute__((noinline, target("avx2,fma"))) static void x256_gather_columns(int bf, const char *slot, int64_t L,
                                                                                int64_t C, const int64_t *cols,
                                                                                int64_t nc, float *hist) {
    const int64_t esz = bf ? 2 : 4, vector_end = bf ? C - 1 : C;
    const __m256i row = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int32_t)(L * esz)));
    for (int64_t k = 0; k < nc; k++) {
        const int64_t col = cols[k];
        float *dst = hist + col * C;
        const __m256i at = _mm256_add_epi32(row, _mm256_set1_epi32((int32_t)(col * esz)));
        int64_t i = 0;
        for (; i + 8 <= vector_end; i += 8) {
            const char *base = slot + i * L * esz;
            if (bf)
                _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_i32gather_epi32((const int *)base, at, 1), 16)));
            else
                _mm256_storeu_ps(dst + i, _mm256_i32gather_ps((const float *)base, at, 1));
        }
        for (; i < C; i++) {
            if (bf) {
                const uint32_t u = (uint32_t)((const uint16_t *)slot)[i * L + col] << 16;
                memcpy(dst + i, &u, 4);
            } else {
                dst[i] = ((const float *)slot)[i * L + col];
            }
        }
    }
}
#endif

#ifdef PLE_X512
#define BF16_TARGET AVX512_TARGET ",avx512bf16"
#define X512 static inline __attribute__((always_inline, target(BF16_TARGET)))

/* bf16 bits of each lane as PyTorch rounds: nearest even, NaN -> 0x7FC0, denormals kept */
X512 __m256i x512_bf16_exact(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* the same bits: the instruction, unless a lane is NaN or denormal (VFPCLASSPS classes 0x01 quiet NaN,
 * 0x20 denormal, 0x80 signalling NaN) */
X512 __m256i x512_bf16(__m512 x) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0xA1) != 0, 0)) return x512_bf16_exact(x);
    return (__m256i)_mm512_cvtneps_pbh(x);
}

X512 __m512 x512_widen(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

X512 __m512 x512_rnd(__m512 x, int bf) { return bf ? x512_widen(x512_bf16(x)) : x; }

/* 16 values (the first lanes of `k`) at p + i, in the activation dtype when `bf16`, else fp32 */
X512 __m512 x512_load(const void *p, int64_t i, int bf16, __mmask16 k) {
    if (bf16)
        return x512_widen(k == 0xFFFF ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))
                                      : _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i));
    return k == 0xFFFF ? _mm512_loadu_ps((const float *)p + i) : _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

X512 void x512_store(void *p, int64_t i, __m512 x, int bf, __mmask16 k) {
    if (bf) {
        const __m256i b = x512_bf16(x);
        if (k == 0xFFFF)
            _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), b);
        else
            _mm256_mask_storeu_epi16((uint16_t *)p + i, k, b);
    } else if (k == 0xFFFF) {
        _mm512_storeu_ps((float *)p + i, x);
    } else {
        _mm512_mask_storeu_ps((float *)p + i, k, x);
    }
}

X512 __mmask16 x512_tail(int64_t left) { return (__mmask16)((1u << left) - 1u); }

/* silu(a) + res. exp(-a) = 2^n p(s), n = round(-a / ln 2), s = a + n ln 2 (one reduction step: |n| <= 125
 * costs at most 3e-6 relative where silu is below 1e-6), p(s) a degree-5 fit of e^-s on |s| <= ln2 / 2
 * (within 4 ulp); a clamped to [-86, 87] for the exponential only, so 1 + e^-a stays below 2^125 and
 * its reciprocal (VRCP14PS, one Newton step) a normal number. */
X512 __m512 x512_silu_add(__m512 a, __m512 res) {
    const __m512 ac = _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(87.0f)), _mm512_set1_ps(-86.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(ac, _mm512_set1_ps(-1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 t = _mm512_fmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), ac);
    __m512 p = _mm512_set1_ps(-0.008298712782561779f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.041915446519851685f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.1666755974292755f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.49998894333839417f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.9999997019767761f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.0000001192092896f));
    const __m512 d = _mm512_add_ps(_mm512_scalef_ps(p, n), _mm512_set1_ps(1.0f));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    return _mm512_fmadd_ps(a, r, res);
}

/* One vector of a K = 4 conv row: taps x0..x3 (x0..x2 in the activation dtype when `hist_bf16`, else
 * fp32; x3 fp32), SiLU and the residual. */
X512 __m512 x512_conv4_at(int hist_bf16, const void *x0, const void *x1, const void *x2, const float *x3,
                           const float *w, int64_t C, const float *res, int64_t i, __mmask16 k) {
    __m512 a = _mm512_mul_ps(x512_load(x0, i, hist_bf16, k), x512_load(w, i, 0, k));
    a = _mm512_fmadd_ps(x512_load(x1, i, hist_bf16, k), x512_load(w + C, i, 0, k), a);
    a = _mm512_fmadd_ps(x512_load(x2, i, hist_bf16, k), x512_load(w + 2 * C, i, 0, k), a);
    a = _mm512_fmadd_ps(x512_load(x3, i, 0, k), x512_load(w + 3 * C, i, 0, k), a);
    return x512_silu_add(a, x512_load(res, i, 0, k));
}

X512 void x512_conv4_body(int bf, int hist_bf16, const void *x0, const void *x1, const void *x2, const float *x3,
                           const float *w, int64_t C, const float *res, void *out) {
    int64_t i = 0;
    /* two vectors at a time: two independent chains, and one rounding test for both */
    for (; i + 32 <= C; i += 32) {
        const __m512 y0 = x512_conv4_at(hist_bf16, x0, x1, x2, x3, w, C, res, i, 0xFFFF);
        const __m512 y1 = x512_conv4_at(hist_bf16, x0, x1, x2, x3, w, C, res, i + 16, 0xFFFF);
        if (!bf) {
            _mm512_storeu_ps((float *)out + i, y0);
            _mm512_storeu_ps((float *)out + i + 16, y1);
        } else if (__builtin_expect((_mm512_fpclass_ps_mask(y0, 0xA1) | _mm512_fpclass_ps_mask(y1, 0xA1)) == 0, 1)) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), (__m256i)_mm512_cvtneps_pbh(y0));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i + 16), (__m256i)_mm512_cvtneps_pbh(y1));
        } else {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), x512_bf16_exact(y0));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i + 16), x512_bf16_exact(y1));
        }
    }
    for (; i < C; i += 16) {
        const __mmask16 k = C - i >= 16 ? (__mmask16)0xFFFF : x512_tail(C - i);
        x512_store(out, i, x512_conv4_at(hist_bf16, x0, x1, x2, x3, w, C, res, i, k), bf, k);
    }
}

/* the K = 4 conv of one row over C channels: out = silu(sum_k x_k * w[k]) + res */
__attribute__((noinline, target(BF16_TARGET))) static void x512_conv4(int bf, int hist_bf16, const void *x0,
                                                                         const void *x1, const void *x2,
                                                                         const float *x3, const float *w, int64_t C,
                                                                         const float *res, void *out) {
    if (!bf)
        x512_conv4_body(0, 0, x0, x1, x2, x3, w, C, res, out);
    else if (hist_bf16)
        x512_conv4_body(1, 1, x0, x1, x2, x3, w, C, res, out);
    else
        x512_conv4_body(1, 0, x0, x1, x2, x3, w, C, res, out);
}

X512 void x512_gate_out_at(int bf, int add_hidden, int masked, const float *v, const float *wc, const void *q,
                            __m512 cs, __m512 g, float *cr, float *rr, int64_t i, __mmask16 k) {
    /* a masked row's v and c are multiplied by 0 (NaN stays NaN); 1 would change nothing */
    const __m512 zero = _mm512_setzero_ps(), x = x512_load(v, i, 0, k);
    __m512 c = x512_rnd(_mm512_mul_ps(_mm512_mul_ps(x, cs), x512_load(wc, i, 0, k)), bf);
    if (masked) c = _mm512_mul_ps(c, zero);
    if (k == 0xFFFF)
        _mm512_storeu_ps(cr + i, c);
    else
        _mm512_mask_storeu_ps(cr + i, k, c);
    if (!rr) return;
    __m512 r;
    if (!bf && !masked && add_hidden) {
        r = _mm512_fmadd_ps(x, g, x512_load(q, i, 0, k)); /* fp32: one rounding (the decode tiles do the same) */
    } else {
        r = x512_rnd(_mm512_mul_ps(x, g), bf);
        if (masked) r = _mm512_mul_ps(r, zero);
        if (add_hidden) r = x512_rnd(_mm512_add_ps(r, x512_load(q, i, bf, k)), bf);
    }
    if (k == 0xFFFF)
        _mm512_storeu_ps(rr + i, r);
    else
        _mm512_mask_storeu_ps(rr + i, k, r);
}

X512 void x512_gate_out_body(int bf, int add_hidden, int masked, const float *v, const float *wc, const void *q,
                              float cs, float g, float *cr, float *rr, int64_t H) {
    const __m512 vcs = _mm512_set1_ps(cs), vg = _mm512_set1_ps(g);
    int64_t i = 0;
    for (; i + 16 <= H; i += 16) x512_gate_out_at(bf, add_hidden, masked, v, wc, q, vcs, vg, cr, rr, i, 0xFFFF);
    if (i < H) x512_gate_out_at(bf, add_hidden, masked, v, wc, q, vcs, vg, cr, rr, i, x512_tail(H - i));
}

/* The gate's outputs of one head: cr = rnd(v cs wc) m; rr (when non-null) = rnd(rnd(v g) m + q), or
 * rnd(v g) m without the hidden; q in the activation dtype; m = 0 for a masked row, else 1. */
__attribute__((noinline, target(BF16_TARGET))) static void x512_gate_out(int bf, int add_hidden, int masked,
                                                                            const float *v, const float *wc,
                                                                            const void *q, float cs, float g,
                                                                            float *cr, float *rr, int64_t H) {
    if (masked)
        x512_gate_out_body(bf, add_hidden, 1, v, wc, q, cs, g, cr, rr, H); /* rare: not specialized */
    else if (bf && add_hidden)
        x512_gate_out_body(1, 1, 0, v, wc, q, cs, g, cr, rr, H);
    else if (bf)
        x512_gate_out_body(1, 0, 0, v, wc, q, cs, g, cr, rr, H);
    else if (add_hidden)
        x512_gate_out_body(0, 1, 0, v, wc, q, cs, g, cr, rr, H);
    else
        x512_gate_out_body(0, 0, 0, v, wc, q, cs, g, cr, rr, H);
}
#endif

#define LANES 16
#define MAX_TAPS 64 /* taps per channel the kernel takes (the published model has 4) */

_Static_assert(LANES == 16, "lane_sum adds 16 partial sums in a fixed tree");

ALWAYS_INLINE float lane_sum(const float *p) {
    float a[LANES / 2];
    for (int j = 0; j < LANES / 2; j++) a[j] = p[j] + p[j + LANES / 2];
    float b0 = (a[0] + a[4]) + (a[2] + a[6]), b1 = (a[1] + a[5]) + (a[3] + a[7]);
    return b0 + b1;
}

typedef struct {
    int64_t hidden_size, hc, channels, taps, dilation, window, state_len;
    float eps;
    const void *key, *value, *hidden;
    int64_t key_stride, value_stride, hidden_stride;
    const float *wkq, *wc, *conv_w; /* [C], [C], [K, C] */
    const int64_t *starts, *slots, *rejected; /* rejected may be null (nothing rejected) */
    const uint8_t *has_init, *mask;
    void *state;
    int64_t *ring_base; /* null: state is [S, C, L]; else state is [S, L, C], column j of slot s in row (base[s] + j) % L */
    int add_hidden;
    const void *c_in, *res_in; /* conv stage: conv inputs [T, C] and residual rows given instead of the gate */
    int64_t res_stride;
    void *out, *c_out;
    int c_all;
    /* work partition */
    int64_t num_units;
    int64_t *unit_request, *unit_begin, *unit_end;
    int64_t *remaining; /* per request: units not yet finished */
    int64_t next_unit;
    int64_t ahead; /* the unit a thread is likely to take next is this many after its current one */
    int64_t plan_lines; /* the prefetch plan's lines per run (ple_prefetch_lines at the call) */
} job_t;

#define MAX_PREFETCH 64 /* state columns a unit's prefetch plan names */
#define MAX_PLAN (MAX_PREFETCH + 3) /* and the key, value and hidden rows of its first row */

typedef struct {
    float *ring, *vrow, *res, *acc;
    float *hist;   /* [W, C] the slot's last W history columns, read by units that start inside the window */
    uint8_t *need; /* [W] which of them */
    float *zero;   /* [C] zeros: the taps of a fresh request's history */
    float *block;  /* the one allocation all of the above live in (zero first) */
    size_t floats; /* its size */
    /* prefetch plan: the reads of a unit this thread is likely to run next that no hardware prefetcher
     * can guess (the state columns it gathers, the first rows of its key, value and hidden: each unit of
     * a decode step is one row, at another place than the last), fetched a few lines at a time while
     * this unit computes */
    const char *pf_at[MAX_PLAN];
    int64_t pf_len[MAX_PLAN];
    int64_t pf_n, pf_i, pf_off, pf_lines;
} scratch_t;

/* How many lines of each run of bytes (a row, a state column) the prefetch plan fetches: 0 none, else at
 * most that many from the run's start (PLAN_ALL: whole runs); -1 until set, then this CPU's default.
 * Whole runs help where software prefetches do not hold up the loads around them (an AMD EPYC: the
 * kernel after the GEMM 0.66 ms with whole runs, 0.77 without a plan); on Intel cores each prefetch
 * in flight takes one of the core's few line-fill buffers the loads need, and whole runs slowed the
 * kernel by a quarter against 8 lines (the first lines of a run start the core's own stream
 * prefetcher, which fetches the rest without taking them). */
#define PLAN_ALL INT64_MAX
static int64_t g_plan_lines = -1;

static int64_t plan_lines_default(void) {
    static int64_t lines = -1; /* found once (every thread finds the same value) */
    int64_t found = __atomic_load_n(&lines, __ATOMIC_RELAXED);
    if (found >= 0) return found;
    found = PLAN_ALL;
#ifdef PLE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel")) found = 8;
#endif
    __atomic_store_n(&lines, found, __ATOMIC_RELAXED);
    return found;
}

/* Set the plan's lines per run: -1 this CPU's default, 0 no plan, PLAN_ALL whole runs. Returns 0, or -1
 * for a value below -1 (nothing changes). */
int ple_set_prefetch_lines(int64_t lines) {
    if (lines < -1) return -1;
    __atomic_store_n(&g_plan_lines, lines, __ATOMIC_RELAXED);
    return 0;
}

/* The plan's lines per run later calls use (PLAN_ALL: whole runs). */
int64_t ple_prefetch_lines(void) {
    const int64_t lines = __atomic_load_n(&g_plan_lines, __ATOMIC_RELAXED);
    return lines >= 0 ? lines : plan_lines_default();
}

ALWAYS_INLINE void plan_add(scratch_t *S, const void *at, int64_t bytes, int64_t lines) {
    if ((bytes + 63) / 64 > lines) bytes = lines * 64;
    if (S->pf_n >= MAX_PLAN || bytes <= 0) return;
    S->pf_at[S->pf_n] = (const char *)at;
    S->pf_len[S->pf_n++] = bytes;
    S->pf_lines += (bytes + 63) / 64;
}

/* The next `lines` lines of the plan (its position kept in registers: updating it in the scratch per line
 * would chain every prefetch through a store and a load) */
ALWAYS_INLINE void prefetch_some(scratch_t *S, int64_t lines) {
    int64_t i = S->pf_i, off = S->pf_off;
    const int64_t n = S->pf_n, start = lines;
    while (lines > 0 && i < n) {
        const char *at = S->pf_at[i];
        const int64_t len = S->pf_len[i];
        int64_t stop = off + lines * 64;
        if (stop > len) stop = len;
        for (; off < stop; off += 64, lines--) __builtin_prefetch(at + off, 0, 2);
        if (off >= len) {
            off = 0;
            i++;
        }
    }
    S->pf_i = i;
    S->pf_off = off;
    S->pf_lines -= start - lines;
}

/* A head's gate from its sums: g (the gate) and cs (the conv input's scale), as the reference computes
 * them in fp32 (shared by gate_row and the decode tiles, so both give the same bits). */
ALWAYS_INLINE void gate_scalars(const job_t *J, float ss_k, float ss_q, float dot, float ms_v, float *g_out,
                                float *cs_out) {
    const int64_t H = J->hidden_size;
    const float inv_sqrt_h = 1.0f / sqrtf((float)H);
    float rk = 1.0f / sqrtf(ss_k / (float)H + J->eps);
    float rq = 1.0f / sqrtf(ss_q / (float)H + J->eps);
    float d = dot * rk * rq * inv_sqrt_h;
    float s = d > 0.0f ? sqrtf(fmaxf(d, 1e-6f)) : (d < 0.0f ? -sqrtf(fmaxf(-d, 1e-6f)) : d);
    float g = 1.0f / (1.0f + expf(-s));
    *g_out = g;
    *cs_out = g * (1.0f / sqrtf(g * g * ms_v + J->eps));
}

/* Whether request r continues the history held in its slot, and where that history ends (column). */
ALWAYS_INLINE int resumes_of(const job_t *J, int64_t r) { return J->slots[r] >= 0 && J->has_init[r] != 0; }

ALWAYS_INLINE int64_t history_end_of(const job_t *J, int64_t r) {
    return J->state_len - (J->rejected != 0 && resumes_of(J, r) ? J->rejected[r] : 0);
}

/* Element (channel i, logical column j) of slot `slot`: its offset in the state pool. */
ALWAYS_INLINE int64_t state_at(const job_t *J, int64_t slot, int64_t i, int64_t j) {
    const int64_t C = J->channels, L = J->state_len;
    if (J->ring_base) return slot * L * C + ((J->ring_base[slot] + j) % L) * C + i;
    return slot * C * L + i * L + j;
}

/* Conv input of row t for all streams into `c_row`; the residual into `res` when non-null. */
/* `hand`: the rows written by hand (x512_*) instead of the compiler's vectors (AVX-512 BF16 only). */
ALWAYS_INLINE void gate_row(const job_t *J, int64_t t, float *c_row, float *res, float *vrow, scratch_t *S, int bf,
                            int hand) {
    const int64_t H = J->hidden_size, HC = J->hc;
    const void *vp = (const char *)J->value + t * J->value_stride * (bf ? 2 : 4);
    const void *kp = (const char *)J->key + t * J->key_stride * (bf ? 2 : 4);
    const void *qp = (const char *)J->hidden + t * J->hidden_stride * (bf ? 2 : 4);
    /* Sums run in LANES independent partial sums (vectorizable without reassociation), then a fixed tree. */
    float pv[LANES] = {0};
    int64_t i0 = 0;
    for (; i0 + LANES <= H; i0 += LANES)
        for (int j = 0; j < LANES; j++) {
            float x = ld(vp, i0 + j, bf);
            vrow[i0 + j] = x;
            pv[j] += x * x;
        }
    for (int64_t i = i0; i < H; i++) {
        float x = ld(vp, i, bf);
        vrow[i] = x;
        pv[i - i0] += x * x;
    }
    const float ss_v = lane_sum(pv);
    const float ms_v = ss_v / (float)H;
    const int masked = J->mask != 0 && J->mask[t] == 0;
    /* the plan's lines spread over the heads: a few per block of 256 channels */
    const int64_t blocks = HC * ((H + 255) / 256);
    const int64_t per_block = S->pf_lines / (blocks > 0 ? blocks : 1) + 1;
    for (int64_t h = 0; h < HC; h++) {
        const int64_t o = h * H;
        const float *wkq = J->wkq + o;
        float pk[LANES] = {0}, pq[LANES] = {0}, pd[LANES] = {0};
        int64_t i1 = 0;
        for (; i1 + LANES <= H; i1 += LANES) {
            if ((i1 & 255) == 0) prefetch_some(S, per_block);
            for (int j = 0; j < LANES; j++) {
                float k = ld(kp, o + i1 + j, bf), q = ld(qp, o + i1 + j, bf);
                pk[j] += k * k;
                pq[j] += q * q;
                pd[j] += k * wkq[i1 + j] * q;
            }
        }
        for (int64_t i = i1; i < H; i++) {
            float k = ld(kp, o + i, bf), q = ld(qp, o + i, bf);
            pk[i - i1] += k * k;
            pq[i - i1] += q * q;
            pd[i - i1] += k * wkq[i] * q;
        }
        const float ss_k = lane_sum(pk), ss_q = lane_sum(pq), dot = lane_sum(pd);
        float g, cs;
        gate_scalars(J, ss_k, ss_q, dot, ms_v, &g, &cs);
        const float *wc = J->wc + o;
        float *cr = c_row + o;
        /* a masked token's v and c are multiplied by 0, as the PyTorch path does (NaN stays NaN) */
        const float m = masked ? 0.0f : 1.0f;
#ifdef PLE_X512
        if (hand) {
            x512_gate_out(bf, J->add_hidden, masked, vrow, wc, (const char *)qp + o * (bf ? 2 : 4), cs, g, cr,
                          res ? res + o : 0, H);
            continue;
        }
#else
        (void)hand;
#endif
#pragma omp simd
        for (int64_t i = 0; i < H; i++) cr[i] = rnd(vrow[i] * cs * wc[i], bf) * m;
        if (res) {
            float *rr = res + o;
            if (J->add_hidden) {
#pragma omp simd
                for (int64_t i = 0; i < H; i++) rr[i] = rnd(rnd(vrow[i] * g, bf) * m + ld(qp, o + i, bf), bf);
            } else {
#pragma omp simd
                for (int64_t i = 0; i < H; i++) rr[i] = rnd(vrow[i] * g, bf) * m;
            }
        }
    }
}

/* Conv stage: row t of the given conv inputs (and the residual) instead of the gate's. The values are
 * those the gate stage rounded, so the rest of the step sees exactly what the fused step computes. */
ALWAYS_INLINE void load_row(const job_t *J, int64_t t, float *c_row, float *res, int bf) {
    const int64_t C = J->channels;
    const void *cp = (const char *)J->c_in + t * C * (bf ? 2 : 4);
#pragma omp simd
    for (int64_t i = 0; i < C; i++) c_row[i] = ld(cp, i, bf);
    if (res) {
        const void *rp = (const char *)J->res_in + t * J->res_stride * (bf ? 2 : 4);
#pragma omp simd
        for (int64_t i = 0; i < C; i++) res[i] = ld(rp, i, bf);
    }
}

/* The history columns unit u gathers (see run_unit): marks need[0 .. W-1]; returns how many. */
/* Rows p < direct_rows of a resuming request in the ring layout read their history taps straight from
 * the slot (see run_unit): with K = 4, rows before the first dilation take all K-1 history taps there. */
ALWAYS_INLINE int64_t direct_rows(const job_t *J) { return J->ring_base && J->taps == 4 ? J->dilation : 0; }

/* The history columns the rows from_row.. of unit u read: marks need[0 .. W-1]; returns how many. */
ALWAYS_INLINE int64_t needed_columns(const job_t *J, int64_t u, uint8_t *need, int64_t from_row) {
    const int64_t K = J->taps, W = J->window;
    const int64_t r = J->unit_request[u], p1 = J->unit_end[u];
    const int64_t p0 = J->unit_begin[u] > from_row ? J->unit_begin[u] : from_row;
    int64_t count = 0;
    for (int64_t col = 0; col < W; col++) need[col] = 0;
    if (J->slots[r] < 0 || !resumes_of(J, r) || p0 >= W) return 0;
    const int64_t rows = p1 < W ? p1 : W;
    for (int64_t p = p0; p < rows; p++)
        for (int64_t k = 0; k < K - 1; k++) {
            const int64_t q = p - (K - 1 - k) * J->dilation;
            if (q < 0 && !need[q + W]) {
                need[q + W] = 1;
                count++;
            }
        }
    return count;
}

/* Plan the prefetch of unit u's reads that no hardware prefetcher guesses: the key, value and hidden
 * rows of its first row (gate stage) and the state columns it gathers (ring layout only: a column is
 * one run of bytes there). */
ALWAYS_INLINE void plan_prefetch(const job_t *J, int64_t u, scratch_t *S, int bf) {
    S->pf_n = S->pf_i = S->pf_off = S->pf_lines = 0;
    const int64_t lines = J->plan_lines;
    if (u >= J->num_units || lines == 0) return;
    const int64_t r = J->unit_request[u], esz = bf ? 2 : 4, C = J->channels;
    if (!J->c_in) {
        const int64_t W = J->window, p0 = J->unit_begin[u];
        const int64_t t = J->starts[r] + (J->slots[r] < 0 ? p0 : (p0 > W ? p0 - W : 0)); /* run_unit's `warm` */
        if (t < J->starts[r + 1]) {
            plan_add(S, (const char *)J->key + t * J->key_stride * esz, C * esz, lines);
            plan_add(S, (const char *)J->value + t * J->value_stride * esz, J->hidden_size * esz, lines);
            plan_add(S, (const char *)J->hidden + t * J->hidden_stride * esz, C * esz, lines);
        }
    }
    if (!J->ring_base || J->window > MAX_PREFETCH) return;
    if (!needed_columns(J, u, S->need, 0)) return;
    const int64_t slot = J->slots[r], first = history_end_of(J, r) - J->window, L = J->state_len;
    /* another thread may be moving this slot's base (the unit already ran there): any value is a
     * valid column, and a prefetch of a stale one is only a wasted line */
    const int64_t base = __atomic_load_n(&J->ring_base[slot], __ATOMIC_RELAXED);
    for (int64_t col = 0; col < J->window; col++)
        if (S->need[col])
            plan_add(S, (const char *)J->state + (slot * L * C + ((base + first + col) % L) * C) * esz, C * esz, lines);
}

/* Whether the state write of unit u's request takes its new columns from the ring of conv inputs of the
 * thread that ran u (instead of c_out rows): the gate ran (no c_in), u is the request's only unit (that
 * thread then writes the state right after it), and the ring's W + 1 rows hold the rows the state takes
 * (its last min(n, L)). */
ALWAYS_INLINE int state_from_ring(const job_t *J, int64_t u) {
    const int64_t r = J->unit_request[u], n = J->starts[r + 1] - J->starts[r];
    return !J->c_in && J->unit_begin[u] == 0 && J->unit_end[u] == n && (n < J->state_len ? n : J->state_len) <= J->window + 1;
}

#ifdef PLE_X512
static int64_t x512_rows(const job_t *J, scratch_t *S, int64_t r, int64_t p, int64_t p1, int64_t c_from, int bf);
#endif
int ple_decode_tiles(void);

/* `gathers`: the [S, C, L] layout's history columns read with vector gathers (AVX2 and up). */
ALWAYS_INLINE void run_unit(const job_t *J, int64_t u, scratch_t *S, int bf, int hand, int gathers) {
    const int64_t C = J->channels, K = J->taps, W = J->window, L = J->state_len, ring_rows = W + 1;
    const int64_t r = J->unit_request[u], p0 = J->unit_begin[u], p1 = J->unit_end[u];
    const int64_t start = J->starts[r], n = J->starts[r + 1] - start;
    const int64_t slot = J->slots[r];
    const int resumes = resumes_of(J, r);
    const int64_t hist = history_end_of(J, r);
    const int active = slot >= 0;
    /* without c_all, c_out rows are written only for a state write that cannot take them from the ring */
    const int c_rows_for_state = active && !state_from_ring(J, u);
    /* the rows before the unit feed its taps; a row without a slot has no conv, so no taps */
    const int64_t warm = !active ? p0 : (p0 > W ? p0 - W : 0);
    if (active && resumes && p0 < W) {
        /* The slot columns hist-W .. hist-1 that this unit's taps read (rows p0 .. W-1 reach before the
         * chunk), token-major into S->hist. No unit writes the slot before all of them have run. */
        const int64_t first = hist - W;
        needed_columns(J, u, S->need, direct_rows(J));
        if (J->ring_base) {
            for (int64_t col = 0; col < W; col++)
                if (S->need[col]) {
                    float *dst = S->hist + col * C;
                    const int64_t at = state_at(J, slot, 0, first + col);
#pragma omp simd
                    for (int64_t i = 0; i < C; i++) dst[i] = ld(J->state, at + i, bf);
                }
        } else {
            /* [S, C, L]: a channel's columns are one run of L values; one pass over the slot reads each run
             * once and scatters the needed columns (instead of one strided pass per column) */
            int64_t cols[MAX_PREFETCH], nc = 0, more = 0;
            for (int64_t col = 0; col < W; col++)
                if (S->need[col]) {
                    if (nc < MAX_PREFETCH)
                        cols[nc++] = col;
                    else
                        more = 1;
                }
            const int64_t at = state_at(J, slot, 0, first);
#ifdef PLE_X86
            /* vector gathers where their offsets fit in 32 bits (8 runs of L values from the column) */
            if (gathers && !more && 8 * L * (bf ? 2 : 4) < INT32_MAX) {
                x256_gather_columns(bf, (const char *)J->state + at * (bf ? 2 : 4), L, C, cols, nc, S->hist);
                more = -1; /* done */
            }
#else
            (void)gathers;
#endif
            if (!more) {
                for (int64_t i = 0; i < C; i++)
                    for (int64_t k = 0; k < nc; k++) S->hist[cols[k] * C + i] = ld(J->state, at + i * L + cols[k], bf);
            } else if (more > 0) { /* more columns than the list holds (long windows): a strided pass per column */
                for (int64_t col = 0; col < W; col++)
                    if (S->need[col])
                        for (int64_t i = 0; i < C; i++) S->hist[col * C + i] = ld(J->state, at + i * L + col, bf);
            }
        }
    }
    plan_prefetch(J, u + J->ahead, S, bf);
#ifdef PLE_X512
    /* rows whose taps are all rows of this chunk run in tiles (x512_rows) */
    const int row_tiles = hand && active && !J->c_in && !J->mask && K == 4 && J->hidden_size % LANES == 0 &&
                          ple_decode_tiles();
    const int64_t c_from = J->c_out && J->c_all ? 0 : (J->c_out && c_rows_for_state ? n - L : INT64_MAX);
#endif
    for (int64_t p = warm; p < p1; p++) {
#ifdef PLE_X512
        if (row_tiles && p >= p0 && p >= W) {
            p += x512_rows(J, S, r, p, p1, c_from, bf) - 1;
            continue;
        }
#endif
        const int64_t t = start + p;
        float *c_row = S->ring + (p % ring_rows) * C;
        if (J->c_in)
            load_row(J, t, c_row, p >= p0 ? S->res : 0, bf);
        else
            gate_row(J, t, c_row, p >= p0 ? S->res : 0, S->vrow, S, bf, hand);
        if (p < p0) continue;
        if (J->c_out && (J->c_all || (c_rows_for_state && p >= n - L))) {
            void *co = (char *)J->c_out + t * C * (bf ? 2 : 4);
#pragma omp simd
            for (int64_t i = 0; i < C; i++) st_exact(co, i, c_row[i], bf);
        }
        void *op = (char *)J->out + t * C * (bf ? 2 : 4);
        if (!active) {
#pragma omp simd
            for (int64_t i = 0; i < C; i++) st_exact(op, i, S->res[i], bf);
            continue;
        }
        const float *src[MAX_TAPS];
        for (int64_t k = 0; k < K; k++) {
            const int64_t q = p - (K - 1 - k) * J->dilation;
            if (q >= 0)
                src[k] = S->ring + (q % ring_rows) * C;
            else if (resumes)
                src[k] = S->hist + (q + W) * C; /* p < W here: gathered above for this unit */
            else
                src[k] = S->zero; /* a fresh request's history is zero */
        }
        const float *res = S->res, *w = J->conv_w;
        if (K == 4 && resumes && p < direct_rows(J)) {
            /* the history taps straight from the slot's columns (token-major rows of the ring), converted
             * as the gather would: the same values, no copy; the current row's tap from the ring */
            const int64_t esz = bf ? 2 : 4, first = hist - W, d = J->dilation;
            const void *h0 = (const char *)J->state + state_at(J, slot, 0, first + p - 3 * d + W) * esz;
            const void *h1 = (const char *)J->state + state_at(J, slot, 0, first + p - 2 * d + W) * esz;
            const void *h2 = (const char *)J->state + state_at(J, slot, 0, first + p - d + W) * esz;
            const float *s3 = src[3];
#ifdef PLE_X512
            if (hand) {
                x512_conv4(bf, bf, h0, h1, h2, s3, w, C, res, op);
                continue;
            }
#endif
#pragma omp simd
            for (int64_t i = 0; i < C; i++) {
                float a = 0.0f;
                a += ld(h0, i, bf) * w[i];
                a += ld(h1, i, bf) * w[C + i];
                a += ld(h2, i, bf) * w[2 * C + i];
                a += s3[i] * w[3 * C + i];
                st(op, i, silu(a) + res[i], bf);
            }
            continue;
        }
        if (K == 4) { /* the published geometry: taps, SiLU, residual and the store in one loop */
            const float *s0 = src[0], *s1 = src[1], *s2 = src[2], *s3 = src[3];
#ifdef PLE_X512
            if (hand) {
                x512_conv4(bf, 0, s0, s1, s2, s3, w, C, res, op);
                continue;
            }
#endif
#pragma omp simd
            for (int64_t i = 0; i < C; i++) {
                float a = 0.0f;
                a += s0[i] * w[i];
                a += s1[i] * w[C + i];
                a += s2[i] * w[2 * C + i];
                a += s3[i] * w[3 * C + i];
                st(op, i, silu(a) + res[i], bf);
            }
            continue;
        }
        float *acc = S->acc;
        for (int64_t i = 0; i < C; i++) acc[i] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float *sk = src[k], *wk = w + k * C;
#pragma omp simd
            for (int64_t i = 0; i < C; i++) acc[i] += sk[i] * wk[i];
        }
#pragma omp simd
        for (int64_t i = 0; i < C; i++) {
            float a = acc[i];
            st(op, i, silu(a) + res[i], bf);
        }
    }
}

/* Row `row` of the step's conv inputs (the gate's output, or the conv stage's input). */
ALWAYS_INLINE const char *c_row_of(const job_t *J, int64_t row, int64_t esz) {
    return (const char *)(J->c_in ? J->c_in : J->c_out) + row * J->channels * esz;
}

/* New state of request r: the last L columns of (kept history ++ its c rows), zeros on the left.
 * [S, C, L]: in the flat [C * L] slot, keeping old columns is one shift by `kept + n - L` elements (a
 * memmove; columns that cross into the next channel are the ones overwritten by c rows or zeroed).
 * Ring [S, L, C]: old columns stay where they are; the slot's base moves by `kept + n - L`, and only the
 * new rows (and columns before the history, when more were rejected than added) are written. */
ALWAYS_INLINE void write_state(const job_t *J, int64_t r, int bf, const float *ring) {
    /* ring: the conv inputs of the request's rows, row p at ring + (p % (W + 1)) * C (see
     * state_from_ring), or null: read them from c_out / c_in */
    const int64_t C = J->channels, L = J->state_len, esz = bf ? 2 : 4, ring_rows = J->window + 1;
    const int64_t slot = J->slots[r];
    if (slot < 0 || L == 0) return;
    const int64_t start = J->starts[r], n = J->starts[r + 1] - start;
    const int resumes = resumes_of(J, r);
    const int64_t kept = resumes ? history_end_of(J, r) : L;
    const int64_t shift = kept + n - L, flat = C * L;
    char *base = (char *)J->state + slot * flat * esz;
    const int64_t first_row = L - n > 0 ? L - n : 0; /* new columns first_row .. L-1 come from c rows */
    if (J->ring_base) {
        int64_t b = resumes ? ((J->ring_base[slot] + shift) % L + L) % L : 0;
        J->ring_base[slot] = b;
        /* columns before the kept history (all of them for a fresh request) are zeros */
        const int64_t zeros = !resumes ? first_row : (shift < 0 ? (-shift < first_row ? -shift : first_row) : 0);
        for (int64_t j = 0; j < zeros; j++) memset(base + ((b + j) % L) * C * esz, 0, (size_t)(C * esz));
        for (int64_t j = first_row; j < L; j++) {
            char *dst = base + ((b + j) % L) * C * esz;
            if (ring) {
                const float *src = ring + ((n - L + j) % ring_rows) * C;
#pragma omp simd
                for (int64_t i = 0; i < C; i++) st_exact(dst, i, src[i], bf);
            } else {
                memcpy(dst, c_row_of(J, start + n - L + j, esz), (size_t)(C * esz));
            }
        }
        return;
    }
    if (n >= L) {
        /* every column comes from the chunk's rows */
    } else if (!resumes) {
        memset(base, 0, (size_t)(flat * esz));
    } else if (shift > 0) { /* 0 < shift < kept <= L <= flat here */
        memmove(base, base + shift * esz, (size_t)((flat - shift) * esz));
    } else if (shift < 0) {
        memmove(base - shift * esz, base, (size_t)((flat + shift) * esz));
        for (int64_t i = 0; i < C; i++) memset(base + i * L * esz, 0, (size_t)(-shift * esz));
    }
    for (int64_t j = first_row; j < L; j++) {
        if (ring) {
            const float *src = ring + ((n - L + j) % ring_rows) * C;
            for (int64_t i = 0; i < C; i++) st_exact(base, i * L + j, src[i], bf);
            continue;
        }
        const char *src = c_row_of(J, start + n - L + j, esz);
        if (bf)
            for (int64_t i = 0; i < C; i++) ((uint16_t *)base)[i * L + j] = ((const uint16_t *)src)[i];
        else
            for (int64_t i = 0; i < C; i++) ((float *)base)[i * L + j] = ((const float *)src)[i];
    }
}

ALWAYS_INLINE void work(job_t *J, scratch_t *S, int bf, int hand, int gathers) {
    for (;;) {
        int64_t u = __atomic_fetch_add(&J->next_unit, 1, __ATOMIC_RELAXED);
        if (u >= J->num_units) break;
        run_unit(J, u, S, bf, hand, gathers);
        int64_t r = J->unit_request[u];
        if (__atomic_sub_fetch(&J->remaining[r], 1, __ATOMIC_ACQ_REL) == 0)
            write_state(J, r, bf, state_from_ring(J, u) ? S->ring : 0);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * Decode tiles (the AVX-512 BF16 variant). A decode row (one token of a request that resumes from its
 * slot, nothing rejected) with K = 4 needs no scratch rows: its history taps are columns of the slot (a
 * run of values in the ring layout, read with vector gathers in the engine layout), its conv input is both
 * the fourth tap and its new state column (the engine layout's runs move on by one in the same pass). Up to TILE such
 * rows (consecutive units) run together, head by head and TILE_CHUNK channels at a time: the gate's sums,
 * then its outputs, the conv, SiLU, the residual and both stores in one pass, reading each weight once
 * per tile instead of once per row (the weights are about 1.5 times the bytes of a row's own operands)
 * and writing no fp32 row. Rows of a chunk whose taps are all earlier rows of it (row W on) run the same
 * pass a few at a time (x512_rows: fewer than the dilation, so none reads another's conv input), their
 * taps from the unit's fp32 ring. Every value is the one the row-by-row path computes (the same
 * operations in the same order: sums in 16 lanes, then the same tree; products and roundings as
 * x512_gate_out and x512_conv4), so the two give the same bits (tested, with ple_set_decode_tiles,
 * which turns both off).
 */
#define TILE 4
#define TILE_CHUNK 512

static int g_decode_tiles = 1;

/* Turn the tiles on (1, the default) or off (0: every row runs alone). Returns 0. */
int ple_set_decode_tiles(int on) {
    __atomic_store_n(&g_decode_tiles, on ? 1 : 0, __ATOMIC_RELAXED);
    return 0;
}

int ple_decode_tiles(void) { return __atomic_load_n(&g_decode_tiles, __ATOMIC_RELAXED); }

static int64_t g_tile_rows; /* rows run in tiles since the library was loaded */

/* How many rows ran in tiles since the library was loaded (what tests read). */
int64_t ple_tile_rows(void) { return __atomic_load_n(&g_tile_rows, __ATOMIC_RELAXED); }

/* Whether the step's geometry lets its decode rows run as tiles. */
ALWAYS_INLINE int tiles_fit(const job_t *J) {
    /* [S, C, L]: a tap's offsets (16 runs) in 32 bits */
    return J->taps == 4 && !J->c_in && !J->mask && J->hidden_size % LANES == 0 && J->state_len > 0 &&
           (J->ring_base || LANES * J->state_len * 4 < INT32_MAX);
}

/* Whether unit u is a decode row a tile takes (with tiles_fit). */
ALWAYS_INLINE int tile_row(const job_t *J, int64_t u) {
    const int64_t r = J->unit_request[u];
    return J->starts[r + 1] - J->starts[r] == 1 && resumes_of(J, r) && (!J->rejected || J->rejected[r] == 0);
}

#ifdef PLE_X512
/* 16 values of `c` (already rounded to the activation dtype) stored exactly: bf16 is the high half */
X512 void x512_store_exact(void *p, int64_t i, __m512 c, int bf) {
    if (bf)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(c), 16)));
    else
        _mm512_storeu_ps((float *)p + i, c);
}

/* Taps of 16 channels of the [S, C, L] layout: the elements `run` bytes apart from `at` (channel i's column
 * j is element i * L + j of the slot), widened. A bf16 lane reads a 32-bit word: the one its element ends
 * (`high`: the element is its high half) for a column j >= 1, else the one it starts; either way the
 * word lies inside the slot. */
X512 __m512 x512_tap(const char *at, __m512i run, int bf, int high) {
    if (!bf) return _mm512_castsi512_ps(_mm512_i32gather_epi32(run, at, 1));
    if (high)
        return _mm512_castsi512_ps(_mm512_and_si512(_mm512_i32gather_epi32(run, at - 2, 1), _mm512_set1_epi32((int32_t)0xFFFF0000u)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(run, at, 1), 16));
}

/* The new state of 16 channels of an [S, C, L] slot (their runs of L elements from `blk`): every run moves
 * one element towards its start and ends with the channel's conv input (`c`, already rounded). One pass
 * over 16 L elements in 64-byte pieces, each loaded one element on (the piece's last element is the next
 * run's first, or for the last run the place of its conv input: not read there, so nothing past the
 * slot is touched), then the conv inputs, one per run. */
X512 void x512_shift_runs(char *blk, int64_t L, __m512 c, int bf) {
    const int64_t esz = bf ? 2 : 4, bytes = LANES * L * esz, moved = bytes - esz;
    for (int64_t off = 0; off < moved; off += 64) {
        const int64_t left = moved - off;
        const __mmask64 k = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        _mm512_mask_storeu_epi8(blk + off, k, _mm512_maskz_loadu_epi8(k, blk + off + esz));
    }
    if (bf) {
        uint16_t w[LANES];
        _mm256_storeu_si256((__m256i *)w, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(c), 16)));
        for (int i = 0; i < LANES; i++) ((uint16_t *)blk)[i * L + L - 1] = w[i];
    } else {
        float w[LANES];
        _mm512_storeu_ps(w, c);
        for (int i = 0; i < LANES; i++) ((float *)blk)[i * L + L - 1] = w[i];
    }
}

/* The mean square of a value row [H], summed as gate_row sums it (16 lanes, then lane_sum). */
X512 float x512_mean_square(const char *v, int64_t H, int bf) {
    __m512 pv = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += LANES) {
        const __m512 x = x512_load(v, i, bf, 0xFFFF);
        pv = _mm512_fmadd_ps(x, x, pv);
    }
    float lanes[LANES];
    _mm512_storeu_ps(lanes, pv);
    return lane_sum(lanes) / (float)H;
}

/* The gates of head o / H of n rows (key rows kp, hidden rows qp): their three sums, TILE_CHUNK channels
 * at a time for all rows (each wkq chunk read once), in gate_row's lane order, then gate_scalars. With
 * `prefetch`, a line of each stream 1 KiB ahead (its next chunk): decode rows start cold after the GEMM,
 * and a tile's streams outnumber what the core's own prefetcher follows. */
X512 void x512_head_gates(const job_t *J, const char *const *kp, const char *const *qp, const float *ms_v, int64_t n,
                           int64_t o, int bf, int prefetch, float *g, float *cs) {
    const int64_t H = J->hidden_size, esz = bf ? 2 : 4;
    __m512 pk[TILE], pq[TILE], pd[TILE];
    for (int j = 0; j < n; j++) pk[j] = pq[j] = pd[j] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < H; c0 += TILE_CHUNK) {
        const int64_t c1 = c0 + TILE_CHUNK < H ? c0 + TILE_CHUNK : H;
        for (int j = 0; j < n; j++) {
            __m512 ak = pk[j], aq = pq[j], ad = pd[j];
            for (int64_t i = o + c0; i < o + c1; i += LANES) {
                if (prefetch && ((i * esz) & 63) == 0) {
                    __builtin_prefetch(kp[j] + i * esz + 1024, 0, 3);
                    __builtin_prefetch(qp[j] + i * esz + 1024, 0, 3);
                }
                const __m512 k = x512_load(kp[j], i, bf, 0xFFFF), q = x512_load(qp[j], i, bf, 0xFFFF);
                ak = _mm512_fmadd_ps(k, k, ak);
                aq = _mm512_fmadd_ps(q, q, aq);
                ad = _mm512_fmadd_ps(_mm512_mul_ps(k, _mm512_loadu_ps(J->wkq + i)), q, ad);
            }
            pk[j] = ak;
            pq[j] = aq;
            pd[j] = ad;
        }
    }
    for (int j = 0; j < n; j++) {
        float lk[LANES], lq[LANES], ld_[LANES];
        _mm512_storeu_ps(lk, pk[j]);
        _mm512_storeu_ps(lq, pq[j]);
        _mm512_storeu_ps(ld_, pd[j]);
        gate_scalars(J, lane_sum(lk), lane_sum(lq), lane_sum(ld_), ms_v[j], &g[j], &cs[j]);
    }
}

/* The tiles' second pass over channels o + c0 .. o + c1 of one row: the gate's outputs (v: the value row, q:
 * the hidden row), the conv, SiLU, the residual and the stores. `taps`: where the history taps are and where
 * the conv input goes: 0 state columns in the activation dtype (t0..t2) and the new column (sp); 1 runs of
 * the [S, C, L] layout (gathers from t0..t2, channel 0's tap; the runs moved on from sp); 2 fp32 rows of the
 * unit's ring (t0..t2) and the row's ring row (sp). Everything per row is in locals here, so the loop reads
 * no pointer from memory; cp (c_out) may be null. */
X512 void x512_pass(int bf, int taps, int add_hidden, int with_c, const char *restrict v, const char *restrict q,
                     const char *t0, const char *t1, const char *t2, char *sp, char *restrict cp, char *restrict op,
                     const float *restrict wc, const float *restrict w, int64_t C, int64_t L, int high0,
                     __m512i run, __m512 vcs, __m512 vg, int64_t o, int64_t c0, int64_t c1) {
    const int64_t esz = bf ? 2 : 4;
    for (int64_t i = c0; i < c1; i += LANES) {
        const int64_t ch = o + i;
        if (taps == 0 && ((ch * esz) & 63) == 0) {
            /* a line of each column 1 KiB ahead (its next chunk): every column starts cold after the GEMM,
             * and the tile's streams outnumber what the core's own prefetcher follows */
            __builtin_prefetch(t0 + ch * esz + 1024, 0, 3);
            __builtin_prefetch(t1 + ch * esz + 1024, 0, 3);
            __builtin_prefetch(t2 + ch * esz + 1024, 0, 3);
        }
        const __m512 x = x512_load(v, i, bf, 0xFFFF);
        const __m512 c = x512_rnd(_mm512_mul_ps(_mm512_mul_ps(x, vcs), _mm512_loadu_ps(wc + ch)), bf);
        __m512 res;
        if (!bf && add_hidden) {
            res = _mm512_fmadd_ps(x, vg, x512_load(q, ch, 0, 0xFFFF)); /* as x512_gate_out_at */
        } else {
            res = x512_rnd(_mm512_mul_ps(x, vg), bf);
            if (add_hidden) res = x512_rnd(_mm512_add_ps(res, x512_load(q, ch, bf, 0xFFFF)), bf);
        }
        __m512 h0, h1, h2;
        if (taps == 0) {
            h0 = x512_load(t0, ch, bf, 0xFFFF);
            h1 = x512_load(t1, ch, bf, 0xFFFF);
            h2 = x512_load(t2, ch, bf, 0xFFFF);
        } else if (taps == 1) {
            h0 = x512_tap(t0 + ch * L * esz, run, bf, high0);
            h1 = x512_tap(t1 + ch * L * esz, run, bf, 1);
            h2 = x512_tap(t2 + ch * L * esz, run, bf, 1);
        } else {
            h0 = _mm512_loadu_ps((const float *)t0 + ch);
            h1 = _mm512_loadu_ps((const float *)t1 + ch);
            h2 = _mm512_loadu_ps((const float *)t2 + ch);
        }
        __m512 a = _mm512_mul_ps(h0, _mm512_loadu_ps(w + ch));
        a = _mm512_fmadd_ps(h1, _mm512_loadu_ps(w + C + ch), a);
        a = _mm512_fmadd_ps(h2, _mm512_loadu_ps(w + 2 * C + ch), a);
        a = _mm512_fmadd_ps(c, _mm512_loadu_ps(w + 3 * C + ch), a);
        /* the new state after the taps are read: the ring's new column may be h0's place (L = 3d) */
        if (taps == 0)
            x512_store_exact(sp, ch, c, bf);
        else if (taps == 1)
            x512_shift_runs(sp + ch * L * esz, L, c, bf);
        else
            _mm512_storeu_ps((float *)sp + ch, c);
        if (with_c) x512_store_exact(cp, ch, c, bf);
        x512_store(op, ch, x512_silu_add(a, res), bf, 0xFFFF);
    }
}

/* x512_pass with add_hidden and with_c (cp non-null) made constants of their own loops */
X512 void x512_pass_any(int bf, int taps, int add_hidden, const char *v, const char *q, const char *t0,
                         const char *t1, const char *t2, char *sp, char *cp, char *op, const float *wc,
                         const float *w, int64_t C, int64_t L, int high0, __m512i run, __m512 vcs, __m512 vg,
                         int64_t o, int64_t c0, int64_t c1) {
    if (add_hidden && cp)
        x512_pass(bf, taps, 1, 1, v, q, t0, t1, t2, sp, cp, op, wc, w, C, L, high0, run, vcs, vg, o, c0, c1);
    else if (add_hidden)
        x512_pass(bf, taps, 1, 0, v, q, t0, t1, t2, sp, cp, op, wc, w, C, L, high0, run, vcs, vg, o, c0, c1);
    else if (cp)
        x512_pass(bf, taps, 0, 1, v, q, t0, t1, t2, sp, cp, op, wc, w, C, L, high0, run, vcs, vg, o, c0, c1);
    else
        x512_pass(bf, taps, 0, 0, v, q, t0, t1, t2, sp, cp, op, wc, w, C, L, high0, run, vcs, vg, o, c0, c1);
}

/* The tiles' work once each row's pointers are set: head by head, the n rows' gates (x512_head_gates, with
 * `prefetch`), then TILE_CHUNK channels at a time each row's second pass (x512_pass_any) with its taps
 * t0..t2 and its new state's place sp, `taps` as x512_pass reads them (L, high0 and run: the [S, C, L]
 * layout's). */
X512 void x512_heads(const job_t *J, int n, int bf, int taps, int prefetch, const char *const *vp,
                     const char *const *kp, const char *const *qp, const float *ms_v, const char *const *t0,
                     const char *const *t1, const char *const *t2, char *const *sp, char *const *cp,
                     char *const *op, int64_t L, int high0, __m512i run) {
    const int64_t H = J->hidden_size, HC = J->hc, C = J->channels;
    for (int64_t h = 0; h < HC; h++) {
        const int64_t o = h * H;
        float g[TILE], cs[TILE];
        x512_head_gates(J, kp, qp, ms_v, n, o, bf, prefetch, g, cs);
        for (int64_t c0 = 0; c0 < H; c0 += TILE_CHUNK) {
            const int64_t c1 = c0 + TILE_CHUNK < H ? c0 + TILE_CHUNK : H;
            for (int j = 0; j < n; j++)
                x512_pass_any(bf, taps, J->add_hidden, vp[j], qp[j], t0[j], t1[j], t2[j], sp[j], cp[j], op[j], J->wc,
                              J->conv_w, C, L, high0, run, _mm512_set1_ps(cs[j]), _mm512_set1_ps(g[j]), o, c0, c1);
        }
    }
}

X512 void x512_tile_body(job_t *J, const int64_t *units, int n, int bf, int ring) {
    const int64_t H = J->hidden_size, C = J->channels, L = J->state_len, d = J->dilation;
    const int64_t esz = bf ? 2 : 4;
    /* [S, C, L]: lane i's element is i runs on */
    const __m512i run = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int32_t)(L * esz)));
    const char *vp[TILE], *kp[TILE], *qp[TILE], *h0[TILE], *h1[TILE], *h2[TILE];
    char *op[TILE], *sp[TILE], *cp[TILE];
    float ms_v[TILE];
    for (int j = 0; j < n; j++) {
        const int64_t r = J->unit_request[units[j]], t = J->starts[r], slot = J->slots[r];
        vp[j] = (const char *)J->value + t * J->value_stride * esz;
        kp[j] = (const char *)J->key + t * J->key_stride * esz;
        qp[j] = (const char *)J->hidden + t * J->hidden_stride * esz;
        op[j] = (char *)J->out + t * C * esz;
        cp[j] = J->c_out && J->c_all ? (char *)J->c_out + t * C * esz : 0;
        /* the history ends at column L (nothing rejected); its taps are columns L - 3d, L - 2d, L - d. Ring:
         * the new column takes the oldest one's place (the slot's base moves on by one). [S, C, L]: h0..h2
         * point at channel 0's tap and sp at the slot; every run moves on by one (x512_shift_runs). */
        const char *slot_at = (const char *)J->state + slot * L * C * esz;
        if (ring) {
            const int64_t base = J->ring_base[slot];
            h0[j] = slot_at + ((base + L - 3 * d) % L) * C * esz;
            h1[j] = slot_at + ((base + L - 2 * d) % L) * C * esz;
            h2[j] = slot_at + ((base + L - d) % L) * C * esz;
            sp[j] = (char *)slot_at + base * C * esz;
        } else {
            h0[j] = slot_at + (L - 3 * d) * esz;
            h1[j] = slot_at + (L - 2 * d) * esz;
            h2[j] = slot_at + (L - d) * esz;
            sp[j] = (char *)slot_at;
        }
        ms_v[j] = x512_mean_square(vp[j], H, bf);
    }
    x512_heads(J, n, bf, ring ? 0 : 1, 1, vp, kp, qp, ms_v, h0, h1, h2, sp, cp, op, L, L - 3 * d >= 1, run);
    for (int j = 0; ring && j < n; j++) {
        const int64_t slot = J->slots[J->unit_request[units[j]]];
        J->ring_base[slot] = (J->ring_base[slot] + 1) % L;
    }
    __atomic_add_fetch(&g_tile_rows, n, __ATOMIC_RELAXED);
}

__attribute__((noinline, target(BF16_TARGET))) static void x512_tile(job_t *J, const int64_t *units, int n, int bf) {
    if (J->ring_base)
        bf ? x512_tile_body(J, units, n, 1, 1) : x512_tile_body(J, units, n, 0, 1);
    else
        bf ? x512_tile_body(J, units, n, 1, 0) : x512_tile_body(J, units, n, 0, 0);
}
#endif

#ifdef PLE_X512
/* Rows p .. of request r (at most TILE, fewer than the dilation, before p1), each at or after row W of its
 * chunk: their taps are conv inputs of earlier rows of the chunk, in the unit's fp32 ring. The decode
 * tile's pass (sums, then the gate's outputs, the conv, SiLU and the residual in one pass) with the taps
 * from the ring, each row's conv input stored there (and in c_out from row c_from on) as the row path
 * stores it. Within a chunk of channels row j reads its oldest tap before row j + 1 overwrites that ring
 * row. Returns how many rows ran. */
X512 int64_t x512_rows_body(const job_t *J, scratch_t *S, int64_t r, int64_t p, int64_t p1, int64_t c_from, int bf) {
    const int64_t H = J->hidden_size, C = J->channels, d = J->dilation, ring_rows = J->window + 1;
    const int64_t esz = bf ? 2 : 4, start = J->starts[r];
    int64_t n = p1 - p;
    if (n > d) n = d;
    if (n > TILE) n = TILE;
    const char *vp[TILE], *kp[TILE], *qp[TILE], *x0[TILE], *x1[TILE], *x2[TILE]; /* taps: fp32 ring rows */
    char *op[TILE], *cp[TILE], *cr[TILE];
    float ms_v[TILE];
    for (int j = 0; j < n; j++) {
        const int64_t row = p + j, t = start + row;
        vp[j] = (const char *)J->value + t * J->value_stride * esz;
        kp[j] = (const char *)J->key + t * J->key_stride * esz;
        qp[j] = (const char *)J->hidden + t * J->hidden_stride * esz;
        op[j] = (char *)J->out + t * C * esz;
        cp[j] = row >= c_from ? (char *)J->c_out + t * C * esz : 0;
        cr[j] = (char *)(S->ring + (row % ring_rows) * C);
        x0[j] = (const char *)(S->ring + ((row - 3 * d) % ring_rows) * C);
        x1[j] = (const char *)(S->ring + ((row - 2 * d) % ring_rows) * C);
        x2[j] = (const char *)(S->ring + ((row - d) % ring_rows) * C);
        ms_v[j] = x512_mean_square(vp[j], H, bf);
    }
    x512_heads(J, n, bf, 2, 0, vp, kp, qp, ms_v, x0, x1, x2, cr, cp, op, 0, 0, _mm512_setzero_si512());
    __atomic_add_fetch(&g_tile_rows, n, __ATOMIC_RELAXED);
    return n;
}

__attribute__((noinline, target(BF16_TARGET))) static int64_t x512_rows(const job_t *J, scratch_t *S, int64_t r,
                                                                          int64_t p, int64_t p1, int64_t c_from,
                                                                          int bf) {
    return bf ? x512_rows_body(J, S, r, p, p1, c_from, 1) : x512_rows_body(J, S, r, p, p1, c_from, 0);
}
#endif

/* work() with decode rows taken TILE consecutive units at a time where they follow each other; every
 * other unit runs alone, as in work(). */
ALWAYS_INLINE void work_tiles(job_t *J, scratch_t *S, int bf) {
#ifdef PLE_X512
    for (;;) {
        int64_t u = __atomic_fetch_add(&J->next_unit, 1, __ATOMIC_RELAXED);
        if (u >= J->num_units) break;
        if (!tile_row(J, u)) {
            run_unit(J, u, S, bf, 1, 1);
            int64_t r = J->unit_request[u];
            if (__atomic_sub_fetch(&J->remaining[r], 1, __ATOMIC_ACQ_REL) == 0)
                write_state(J, r, bf, state_from_ring(J, u) ? S->ring : 0);
            continue;
        }
        int64_t tile[TILE];
        int n = 0;
        tile[n++] = u;
        /* the next units too, while they are decode rows no other thread took */
        int64_t next = u + 1;
        while (n < TILE && next < J->num_units && tile_row(J, next)) {
            int64_t want = next;
            if (__atomic_compare_exchange_n(&J->next_unit, &want, next + 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                tile[n++] = next++;
            else
                break; /* another thread moved on: this tile is what it is */
        }
        x512_tile(J, tile, n, bf);
    }
#else
    work(J, S, bf, 0, 1);
#endif
}

/* ---------------------------------------------------------------------------------------------------
 * Instruction sets. The library is built for the baseline of its architecture; the step's code is
 * compiled once more per x86 vector extension (function target attributes: the compiler vectorizes the
 * same source for AVX2 + FMA, and for AVX-512 with 512-bit vectors), and the variant run is chosen per
 * call from what the CPU reports, or forced with ple_set_isa. The variants compute the same sums in the
 * same order (16 partial sums, then a fixed tree); they differ only where the compiler fuses a multiply
 * and an add (FMA, one rounding instead of two). bf16 is converted with integer shifts and the
 * round-to-nearest-even add in vector registers. The AVX-512 BF16 variant is the AVX-512 one with the
 * rows of x512_* (above): VCVTNEPS2BF16 where it gives PyTorch's bits, and SiLU's reciprocal from
 * VRCP14PS.
 */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_COUNT = 4 };

typedef void (*work_fn)(job_t *, scratch_t *, int);

static void work_portable(job_t *J, scratch_t *S, int bf) {
    if (bf)
        work(J, S, 1, 0, 0);
    else
        work(J, S, 0, 0, 0);
}

#ifdef PLE_X86
__attribute__((target("avx2,fma,bmi2,f16c"))) static void work_avx2(job_t *J, scratch_t *S, int bf) {
    if (bf)
        work(J, S, 1, 0, 1);
    else
        work(J, S, 0, 0, 1);
}

__attribute__((target(AVX512_TARGET))) static void work_avx512(job_t *J, scratch_t *S, int bf) {
    if (bf)
        work(J, S, 1, 0, 1);
    else
        work(J, S, 0, 0, 1);
}

#ifdef PLE_X512
/* AVX-512 with its BF16 instructions: the compiler's AVX-512 vectors, the rows of x512_* by hand */
__attribute__((target(BF16_TARGET))) static void work_avx512bf16(job_t *J, scratch_t *S, int bf) {
    const int tiles = tiles_fit(J) && ple_decode_tiles();
    if (bf && tiles)
        work_tiles(J, S, 1);
    else if (bf)
        work(J, S, 1, 1, 1);
    else if (tiles)
        work_tiles(J, S, 0);
    else
        work(J, S, 0, 1, 1);
}
#endif
#endif

/* Whether this CPU runs the instruction set `isa` (and the build has code for it). */
int ple_isa_available(int isa) {
    if (isa == ISA_PORTABLE) return 1;
#ifdef PLE_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX2) return avx2;
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (isa == ISA_AVX512) return avx512;
#ifdef PLE_X512
    if (isa == ISA_AVX512BF16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
#endif
    return 0;
}

static int g_isa = -1; /* the forced instruction set, or -1: the best available */

/* Force the instruction set of later calls (-1: the best this CPU runs). Returns 0, or -1 when the CPU
 * or the build lacks it (nothing changes). */
int ple_set_isa(int isa) {
    if (isa != -1 && (isa < 0 || isa >= ISA_COUNT || !ple_isa_available(isa))) return -1;
    __atomic_store_n(&g_isa, isa, __ATOMIC_RELAXED);
    return 0;
}

/* The instruction set later calls run. */
int ple_current_isa(void) {
    const int forced = __atomic_load_n(&g_isa, __ATOMIC_RELAXED);
    if (forced >= 0) return forced;
    for (int isa = ISA_COUNT - 1; isa > 0; isa--)
        if (ple_isa_available(isa)) return isa;
    return ISA_PORTABLE;
}

static work_fn work_of(int isa) {
#ifdef PLE_X86
#ifdef PLE_X512
    if (isa == ISA_AVX512BF16) return work_avx512bf16;
#endif
    if (isa == ISA_AVX512) return work_avx512;
    if (isa == ISA_AVX2) return work_avx2;
#else
    (void)isa;
#endif
    return work_portable;
}

/* Scratch blocks are kept between calls (a few, behind a lock): a step allocates nothing once the first
 * steps of its geometry ran, and its scratch pages are already mapped. Each block starts with a run of
 * floats known to be zero (S->zero, never written), so a reused block only zeroes what it lacks. */
#define SCRATCH_KEPT 8

typedef struct {
    float *block;
    size_t floats, zeroed;
} kept_t;

static pthread_mutex_t g_kept_lock = PTHREAD_MUTEX_INITIALIZER;
static kept_t g_kept[SCRATCH_KEPT];
static int g_kept_n;

static void kept_lock(void) { pthread_mutex_lock(&g_kept_lock); }
static void kept_unlock(void) { pthread_mutex_unlock(&g_kept_lock); }
static void kept_after_fork(void) {
    /* the child's only thread: blocks a parent thread held stay with that thread (not the child's) */
    pthread_mutex_init(&g_kept_lock, 0);
}
static pthread_once_t g_kept_once = PTHREAD_ONCE_INIT;
static void kept_init(void) { pthread_atfork(kept_lock, kept_unlock, kept_after_fork); }

static int alloc_scratch(const job_t *J, scratch_t *S) {
    const size_t C = (size_t)J->channels, W1 = (size_t)J->window + 1;
    /* zero [C], ring [W+1, C], hist [W+1, C], res [C], acc [C], vrow [H], need [W+1] bytes */
    const size_t floats = C + 2 * W1 * C + 2 * C + (size_t)J->hidden_size + (W1 + 3) / 4;
    memset(S, 0, sizeof *S);
    kept_t k = {0, 0, 0};
    pthread_once(&g_kept_once, kept_init);
    kept_lock();
    for (int i = 0; i < g_kept_n; i++)
        if (g_kept[i].floats >= floats) {
            k = g_kept[i];
            g_kept[i] = g_kept[--g_kept_n];
            break;
        }
    kept_unlock();
    if (!k.block) {
        k.block = malloc(sizeof(float) * floats);
        k.floats = floats;
        k.zeroed = 0;
        if (!k.block) return 0;
    }
    if (k.zeroed < C) {
        memset(k.block, 0, sizeof(float) * C);
        k.zeroed = C;
    }
    S->block = k.block;
    S->floats = k.floats;
    S->zero = k.block;
    S->ring = S->zero + C;
    S->hist = S->ring + W1 * C;
    S->res = S->hist + W1 * C;
    S->acc = S->res + C;
    S->vrow = S->acc + C;
    S->need = (uint8_t *)(S->vrow + J->hidden_size);
    return 1;
}

static void free_scratch(scratch_t *S) {
    if (!S->block) return;
    /* the zero run is as long as the smallest channel count that used the block: C of this call */
    kept_t k = {S->block, S->floats, (size_t)(S->ring - S->zero)};
    kept_lock();
    if (g_kept_n < SCRATCH_KEPT) {
        g_kept[g_kept_n++] = k;
        k.block = 0;
    }
    kept_unlock();
    free(k.block);
    S->block = 0;
}

typedef struct {
    job_t *job;
    int bf;
    work_fn fn;
} thread_arg_t;

static void *thread_main(void *arg) {
    thread_arg_t *a = (thread_arg_t *)arg;
    scratch_t S;
    if (!alloc_scratch(a->job, &S)) {
        free_scratch(&S);
        return 0;
    }
    a->fn(a->job, &S, a->bf);
    free_scratch(&S);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Teams. ple_team_run runs fn(arg) on up to `threads` threads, the caller's among them, and returns
 * once every one returned; the work inside takes its pieces from a shared counter, so it finishes
 * whatever number of threads joined. Built with OpenMP (ple.kernels.native does so when the process's
 * PyTorch runs on GNU OpenMP, whose runtime the library then shares), the threads are the caller's
 * OpenMP team: PyTorch's own intra-op threads, already started, and still spinning after the step's
 * GEMM. A team then starts in about a microsecond and no idle thread competes with it for a core.
 * Without OpenMP the other threads are POSIX threads started per call (tens of microseconds). Returns
 * how many threads ran fn.
 */
static int g_forked; /* this process is a fork of one that may have run OpenMP teams */

/* GNU OpenMP cannot run a team in a child forked after its parent ran one (the child waits forever for
 * threads that were not copied), so a forked child runs its teams on POSIX threads: forks after this
 * library was loaded are seen here, forks before it by ple.kernels.native (os.register_at_fork). */
void ple_team_after_fork(void) { g_forked = 1; }

__attribute__((constructor)) static void team_init(void) { pthread_atfork(0, 0, ple_team_after_fork); }

int ple_team_kind(void) {
#ifdef _OPENMP
    return !g_forked;
#else
    return 0;
#endif
}

int ple_team_run(int threads, void *(*fn)(void *), void *arg) {
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    if (threads == 1) {
        fn(arg);
        return 1;
    }
#ifdef _OPENMP
    if (!g_forked) {
        int ran = 0;
#pragma omp parallel num_threads(threads)
        {
            fn(arg);
#pragma omp atomic
            ran++;
        }
        return ran;
    }
#endif
    pthread_t tid[256];
    int started = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tid[started], 0, fn, arg) != 0) break;
        started++;
    }
    fn(arg);
    for (int i = 0; i < started; i++) pthread_join(tid[i], 0);
    return started + 1;
}

/* One step of the layer after its projections, for a packed batch of `requests` requests.
 *
 * Gate mode (c_in null): key, value, hidden rows -> gate -> conv -> out; c_out receives the conv inputs
 * of every row when c_all, else only rows the state write reads from there (possibly none: a request
 * run as one work unit takes its new state columns from the unit's ring).
 * Conv mode (c_in given): the conv inputs c_in [T, C] (contiguous) and the residual rows res_in replace
 * the gate; key, value, hidden and c_out are not read or written. Rows of requests without a slot
 * (slots[r] = -1) get out = residual and need no other rows: a batch of one such request over all
 * tokens is the gate stage alone (out = residual, c_out = c).
 * has_init [R] (bool bytes), rejected [R] or null: a request resumes from its slot when it has one and
 * has_init; its history then ends `rejected` columns before the slot's end.
 *
 * Returns 0 on success; -1 bad geometry, -2 out of memory,
 * 1000 + r: request r has an out-of-range history (its slot cannot hold the window). */
int ple_gate_conv(int bf, int64_t tokens, int64_t hidden_size, int64_t hc, int64_t taps, int64_t dilation,
                  int64_t state_len, int64_t num_slots, int64_t requests, float eps, const void *key,
                  int64_t key_stride, const void *value, int64_t value_stride, const void *hidden,
                  int64_t hidden_stride, const float *wkq, const float *wc, const float *conv_w,
                  const int64_t *starts, const int64_t *slots, const uint8_t *has_init, const int64_t *rejected,
                  const uint8_t *mask, void *state, int64_t *ring_base, int add_hidden, const void *c_in,
                  const void *res_in, int64_t res_stride, void *out, void *c_out, int c_all, int64_t unit_tokens,
                  int threads) {
    job_t J;
    memset(&J, 0, sizeof J);
    J.hidden_size = hidden_size;
    J.hc = hc;
    J.channels = hc * hidden_size;
    J.taps = taps;
    J.dilation = dilation;
    J.window = (taps - 1) * dilation;
    J.state_len = state_len;
    J.eps = eps;
    J.key = key;
    J.value = value;
    J.hidden = hidden;
    J.key_stride = key_stride;
    J.value_stride = value_stride;
    J.hidden_stride = hidden_stride;
    J.wkq = wkq;
    J.wc = wc;
    J.conv_w = conv_w;
    J.starts = starts;
    J.slots = slots;
    J.has_init = has_init;
    J.rejected = rejected;
    J.mask = mask;
    J.state = state;
    J.ring_base = ring_base;
    J.add_hidden = add_hidden;
    J.c_in = c_in;
    J.res_in = res_in;
    J.res_stride = res_stride;
    J.out = out;
    J.c_out = c_in ? 0 : c_out;
    J.c_all = c_all;
    if (hidden_size < 1 || hc < 1 || taps < 1 || taps > MAX_TAPS || dilation < 1 || requests < 0 || unit_tokens < 1 ||
        state_len < J.window || (c_in == 0 && c_out == 0 && tokens > 0) || (c_in != 0 && res_in == 0) ||
        starts[0] != 0 || starts[requests] != tokens)
        return -1;
    int64_t units = 0;
    for (int64_t r = 0; r < requests; r++) {
        int64_t n = starts[r + 1] - starts[r];
        if (n < 0 || slots[r] < -1 || slots[r] >= num_slots) return -1;
        if (ring_base && slots[r] >= 0 && (ring_base[slots[r]] < 0 || ring_base[slots[r]] >= (state_len ? state_len : 1)))
            return -1;
        const int64_t h = history_end_of(&J, r);
        if (resumes_of(&J, r) && (h < J.window || h > state_len)) return (int)(1000 + r);
        units += n == 0 ? 1 : (n + unit_tokens - 1) / unit_tokens;
    }
    J.num_units = units;
    J.unit_request = malloc(sizeof(int64_t) * (size_t)(units + 1));
    J.unit_begin = malloc(sizeof(int64_t) * (size_t)(units + 1));
    J.unit_end = malloc(sizeof(int64_t) * (size_t)(units + 1));
    J.remaining = malloc(sizeof(int64_t) * (size_t)(requests + 1));
    int rc = 0;
    if (!J.unit_request || !J.unit_begin || !J.unit_end || !J.remaining) {
        rc = -2;
        goto done;
    }
    int64_t u = 0;
    for (int64_t r = 0; r < requests; r++) {
        int64_t n = starts[r + 1] - starts[r];
        int64_t parts = n == 0 ? 1 : (n + unit_tokens - 1) / unit_tokens;
        J.remaining[r] = parts;
        for (int64_t k = 0; k < parts; k++, u++) {
            J.unit_request[u] = r;
            J.unit_begin[u] = n * k / parts;
            J.unit_end[u] = n * (k + 1) / parts;
        }
    }
    if (threads < 1) threads = 1;
    if (threads > units) threads = (int)(units > 0 ? units : 1);
    if (threads > 256) threads = 256;
    J.ahead = threads;
    J.plan_lines = ple_prefetch_lines();
    thread_arg_t arg = {&J, bf, work_of(ple_current_isa())};
    ple_team_run(threads, thread_main, &arg);
    /* a thread that could not allocate its scratch takes no unit; the others (the caller's among them,
     * which runs whatever number of threads started) finish them all, unless none could */
    if (J.next_unit < J.num_units) rc = -2;
done:
    free(J.unit_request);
    free(J.unit_begin);
    free(J.unit_end);
    free(J.remaining);
    return rc;
}

/* ---------------------------------------------------------------------------------------------------
 * ple_ngram_ids: row ids [T, G] int64 of a packed batch, one token per iteration.
 * h = XOR_s (y_s * m_s) with wrapping multiplication; id = off_g + floor_mod(h, P_g). The modulo by
 * each head's prime uses a precomputed 128-bit reciprocal (exact for every 64-bit dividend), so no
 * hardware division runs per id.
 */

typedef struct {
    __uint128_t inverse; /* 2^128 / P rounded up */
    uint64_t prime;
    int64_t offset;
} head_t;

ALWAYS_INLINE uint64_t mod_u64(uint64_t a, const head_t *h) {
    __uint128_t low = h->inverse * a; /* the fractional part of a / P, scaled by 2^128 */
    __uint128_t hi = (__uint128_t)(uint64_t)(low >> 64) * h->prime;
    __uint128_t lo = (__uint128_t)(uint64_t)low * h->prime;
    return (uint64_t)((hi + (lo >> 64)) >> 64);
}

/* floor modulo of the signed value with bits `u`, in [0, P) */
ALWAYS_INLINE uint64_t floor_mod(uint64_t u, const head_t *h) {
    return (int64_t)u >= 0 ? mod_u64(u, h) : h->prime - 1 - mod_u64(~u, h);
}

typedef struct {
    const int64_t *tokens, *starts, *context, *multipliers;
    int64_t total, requests, order, per_order, heads, eos, chunk;
    const head_t *head;
    int64_t *out;
    int64_t next;
} ids_job_t;

static void *ids_worker(void *arg) {
    ids_job_t *J = (ids_job_t *)arg;
    const int64_t N = J->order, k = N - 1, G = J->heads, hpn = J->per_order;
    int64_t y[64];
    for (;;) {
        const int64_t a = __atomic_fetch_add(&J->next, J->chunk, __ATOMIC_RELAXED);
        if (a >= J->total) break;
        const int64_t b = a + J->chunk < J->total ? a + J->chunk : J->total;
        /* the request of token a: the last start <= a among requests with tokens */
        int64_t lo = 0, hi = J->requests - 1;
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (J->starts[mid] <= a)
                lo = mid;
            else
                hi = mid - 1;
        }
        int64_t r = lo;
        for (int64_t t = a; t < b; t++) {
            while (J->starts[r + 1] <= t) r++;
            const int64_t p = t - J->starts[r];
            const int64_t *ctx = J->context + r * k;
            y[0] = J->tokens[t];
            int alive = 1;
            for (int64_t s = 1; s < N; s++) {
                if (s >= 2 && y[s - 1] == J->eos) alive = 0;
                const int64_t raw = p - s >= 0 ? J->tokens[t - s] : ctx[k + p - s];
                y[s] = alive ? raw : J->eos;
            }
            int64_t *o = J->out + t * G;
            uint64_t h = (uint64_t)y[0] * (uint64_t)J->multipliers[0];
            for (int64_t s = 1; s < N; s++) {
                h ^= (uint64_t)y[s] * (uint64_t)J->multipliers[s];
                const int64_t g0 = (s - 1) * hpn;
                for (int64_t j = 0; j < hpn; j++) {
                    const head_t *hd = J->head + g0 + j;
                    o[g0 + j] = hd->offset + (int64_t)floor_mod(h, hd);
                }
            }
        }
    }
    return 0;
}

/* Returns 0, or -1 for a bad geometry (N outside 2..64, no heads), -2 out of memory, -3 offsets that
 * are not 0 .. total, non-decreasing. Token values are trusted (the checked entry point
 * ple.ngram.ngram_ids validates them first). */
int ple_ngram_ids(const int64_t *tokens, int64_t total, const int64_t *starts, int64_t requests,
                  const int64_t *context, int64_t order, int64_t per_order, const int64_t *multipliers,
                  const int64_t *sizes, const int64_t *offsets, int64_t eos, int64_t *out, int threads) {
    if (order < 2 || order > 64 || per_order < 1 || requests < 0) return -1;
    if (starts[0] != 0 || starts[requests] != total) return -3;
    for (int64_t r = 0; r < requests; r++)
        if (starts[r + 1] < starts[r]) return -3;
    const int64_t heads = (order - 1) * per_order;
    head_t *head = malloc(sizeof(head_t) * (size_t)heads);
    if (!head) return -2;
    for (int64_t g = 0; g < heads; g++) {
        if (sizes[g] < 1) {
            free(head);
            return -1;
        }
        head[g].prime = (uint64_t)sizes[g];
        head[g].inverse = ~(__uint128_t)0 / (uint64_t)sizes[g] + 1;
        head[g].offset = offsets[g];
    }
    ids_job_t J = {tokens, starts, context, multipliers, total, requests, order, per_order, heads, eos,
                   4096, head, out, 0};
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    if ((int64_t)threads > (total + J.chunk - 1) / J.chunk) threads = (int)((total + J.chunk - 1) / J.chunk);
    if (total > 0) ple_team_run(threads, ids_worker, &J);
    free(head);
    return 0;
}

/* The index of the first of n values outside [0, vocab), or -1 when every one lies in it: the engine
 * call's check of its tokens and n-gram context on the CPU (one pass each, no allocation). */
int64_t ple_first_outside(const int64_t *values, int64_t n, int64_t vocab) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)values[i] >= (uint64_t)vocab) return i;
    return -1;
}

/* A session's decode step reads its per-slot arrays in one pass: request i (slot slots[i], token
 * tokens[i]) gets its context row [ctx_len], has_state flag and rejected count. Returns -1 when every
 * token lies in [0, vocab), else the index of the first that does not (the outputs are then
 * unspecified); *all_has is 1 when every request's slot holds state. Slots are trusted (the session's
 * own). */
int64_t ple_slots_read(const int64_t *tokens, const int64_t *slots, int64_t n, int64_t vocab,
                       const int64_t *contexts, int64_t ctx_len, const uint8_t *has_state,
                       const int64_t *rejected, int64_t *ctx_out, uint8_t *has_out, int64_t *rej_out,
                       int32_t *all_has) {
    const int64_t bad = ple_first_outside(tokens, n, vocab);
    if (bad >= 0) return bad;
    int32_t all = 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slots[i];
        memcpy(ctx_out + i * ctx_len, contexts + s * ctx_len, sizeof(int64_t) * (size_t)ctx_len);
        has_out[i] = has_state[s] ? 1 : 0;
        all &= has_out[i];
        rej_out[i] = rejected[s];
    }
    *all_has = all;
    return -1;
}

/* After a session's decode step: each request's context row shifts in its token, its slot holds
 * state, nothing is rejected, its length grows by one. */
void ple_slots_advance(const int64_t *tokens, const int64_t *slots, int64_t n, int64_t *contexts,
                       int64_t ctx_len, uint8_t *has_state, int64_t *rejected, int64_t *length) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slots[i];
        if (ctx_len > 0) {
            int64_t *row = contexts + s * ctx_len;
            memmove(row, row + 1, sizeof(int64_t) * (size_t)(ctx_len - 1));
            row[ctx_len - 1] = tokens[i];
        }
        has_state[s] = 1;
        rejected[s] = 0;
        length[s] += 1;
    }
}
