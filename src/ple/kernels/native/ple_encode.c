/* Table conversion kernels (ple.table.formats.encode): source rows decoded to float32, checked, encoded into a
 * block or per-row format, decoded again and compared, in one pass over each row; and scans of stored
 * rows for values that are not finite.
 *
 * Every encoder computes what its numpy reference in ple.table.formats.blocks / ple.table.formats.quantize computes,
 * bit for bit: float32 arithmetic, one rounding per operation in the reference's order (no fused
 * multiply-add: hence the pragma, and statements kept apart), the same tie rules (the first of equal
 * values, GGML's nearest-grid rule), fp16 and E4M3 rounding to nearest even as numpy's astype and
 * PyTorch's cast do. iq4_nl's scale search (16 candidate scales a block, each a sum over the block's
 * 32 values in order) runs its 16 candidates side by side in the lanes of one AVX-512 vector (or two
 * AVX2 vectors, chosen by ple_current_isa as the other kernels are); each lane adds in the reference's
 * order, so every variant gives the same bytes.
 *
 * ple_encode_rows returns 0; 1 when a decoded source value is not finite (fail[0] its row, fail[1] its
 * column); 2 when a block's scale (or q4_1 / q5_1 minimum) does not fit fp16 (fail[0] the row,
 * fail[1] the block's first column, *fail_value the block's value of largest magnitude); -1 for bad
 * arguments, -2 when memory runs out. With several failures the lowest row is reported.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ple_common.h"

/* source kinds */
enum { S_F32 = 0, S_F16, S_BF16, S_E4M3, S_E5M2, S_I8, S_NVFP4 };
/* targets: the block formats in ple_quant.c's numbering, then the per-row formats; -1 decodes only */
enum { T_Q8_0 = 0, T_Q5_1, T_Q5_0, T_Q4_1, T_Q4_0, T_IQ4_NL, T_MXFP4, T_NVFP4, T_FP8_ROW, T_INT8_ROW };
/* stored-row kinds of ple_first_nonfinite: the source kinds, then 10 + a GGML block format */
enum { K_BLOCKS = 10 };

static const int64_t BLOCK_BYTES[7] = {34, 24, 22, 20, 18, 18, 17};
static const float IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const float MXF4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const float E2M1V[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float as_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t as_u32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* ---------------------------------------------------------------------------------------------------
 * Conversions */

/* float -> fp16 bits, nearest even; beyond the largest half (65504) infinity, as numpy's astype. */
static uint16_t f16_of(float f) {
    const uint32_t u = as_u32(f), sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: a subnormal half; the value in units of 2^-24 is exact */
        const float v = as_f32(a) * 16777216.0f;
        return (uint16_t)(sign | (uint32_t)nearbyintf(v));
    }
    a = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((a - 0x38000000u) >> 13));
}

static inline int f16_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

static float f32_of_f16(uint32_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    if (e == 31) return as_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    return as_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* float -> float8 e4m3fn bits as PyTorch casts: nearest even, 480 and beyond NaN (callers clamp to 448) */
static uint8_t e4m3_of(float f) {
    uint32_t b = as_u32(f);
    const uint32_t sign = b & 0x80000000u;
    uint8_t r;
    b ^= sign;
    if (b >= (1087u << 20)) {
        r = 0x7f;
    } else if (b < (121u << 23)) { /* below 2^-6: subnormal, rounded by a float addition */
        const float t = as_f32(b) + as_f32(141u << 23);
        r = (uint8_t)(as_u32(t) - (141u << 23));
    } else {
        const uint32_t odd = (b >> 20) & 1u;
        b += (uint32_t)(7 - 127) * (1u << 23) + 0x7ffffu;
        b += odd;
        r = (uint8_t)(b >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

static float E4M3_LUT[256], E5M2_LUT[256];

__attribute__((constructor)) static void encode_init(void) {
    for (int b = 0; b < 256; b++) {
        const uint32_t e = ((uint32_t)b >> 3) & 15u, m = (uint32_t)b & 7u;
        float mag = e == 0 ? (float)m * 0.001953125f : as_f32(((e + 120u) << 23) | (m << 20));
        if ((b & 127) == 127) mag = NAN;
        E4M3_LUT[b] = (b & 128) ? -mag : mag;
        E5M2_LUT[b] = f32_of_f16((uint32_t)b << 8);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * Source rows -> float32 values, exactly as ple.table.files.transcode dequantizes them */

typedef struct {
    int src_kind, scale_kind; /* scale_kind 0 none, 1 global, 2 per row */
    const uint8_t *src;
    int64_t src_stride, n, D;
    const float *scale;
    float src_global; /* nvfp4 source: the table's float32 scale */
    int target;
    float target_global;
    uint8_t *out;
    int64_t out_bytes;
    float *out_scale;
    double *err_sq, *ref_sq, *max_rel;
    int64_t next, fail_row; /* work counter; lowest failing row so far (n: none) */
    int64_t fail_col;
    int fail_kind;
    float fail_value;
    int isa, oom;
    pthread_mutex_t lock; /* guards the fail_ fields */
} job_t;

static void decode_source(const job_t *J, int64_t i, float *x) {
    const uint8_t *row = J->src + i * J->src_stride;
    const int64_t D = J->D;
    int64_t j;
    switch (J->src_kind) {
    case S_F32:
        memcpy(x, row, (size_t)D * 4);
        break;
    case S_F16:
        for (j = 0; j < D; j++) x[j] = f32_of_f16((uint32_t)row[2 * j] | ((uint32_t)row[2 * j + 1] << 8));
        break;
    case S_BF16:
        for (j = 0; j < D; j++) x[j] = as_f32(((uint32_t)row[2 * j] | ((uint32_t)row[2 * j + 1] << 8)) << 16);
        break;
    case S_E4M3:
        for (j = 0; j < D; j++) x[j] = E4M3_LUT[row[j]];
        break;
    case S_E5M2:
        for (j = 0; j < D; j++) x[j] = E5M2_LUT[row[j]];
        break;
    case S_I8:
        for (j = 0; j < D; j++) x[j] = (float)(int8_t)row[j];
        break;
    default: { /* nvfp4: (E2M1 value * block scale) * global */
        const uint8_t *sc = row + D / 2;
        for (j = 0; j < D; j += 2) {
            const float s = E4M3_LUT[sc[j / 16]];
            const uint8_t byte = row[j / 2];
            float t = E2M1V[byte & 15u] * s;
            x[j] = t * J->src_global;
            t = E2M1V[byte >> 4] * s;
            x[j + 1] = t * J->src_global;
        }
        return;
    }
    }
    if (J->scale_kind) {
        const float s = J->scale_kind == 1 ? J->scale[0] : J->scale[i];
        for (j = 0; j < D; j++) x[j] = x[j] * s;
    }
}

/* ---------------------------------------------------------------------------------------------------
 * Block encoders: 32 values -> one GGML block. Each returns 0, or 1 when its fp16 scale is not finite. */

static void pack_nibbles(const uint8_t *codes, uint8_t *qs) {
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((codes[j] & 15u) | ((codes[j + 16] & 15u) << 4));
}

static void put_f16(uint8_t *p, uint16_t h) {
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static void put_qh(const uint8_t *codes, uint8_t *p) {
    uint32_t qh = 0;
    for (int j = 0; j < 32; j++) qh |= (uint32_t)((codes[j] >> 4) & 1u) << j;
    p[0] = (uint8_t)qh;
    p[1] = (uint8_t)(qh >> 8);
    p[2] = (uint8_t)(qh >> 16);
    p[3] = (uint8_t)(qh >> 24);
}

static inline float inverse(float d) { return d == 0.0f ? 0.0f : 1.0f / d; }

/* the value of largest magnitude, the first of equals, its sign kept; +0 when every value is a zero of
 * either sign (GGML's loop starts from max = 0.0f and takes only a strictly larger magnitude) */
static float signed_max(const float *x) {
    float amax = 0.0f, big = 0.0f;
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            big = x[j];
        }
    return big;
}

static int enc_q8_0(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float d = amax / 127.0f, id = inverse(d);
    const uint16_t h = f16_of(d);
    put_f16(out, h);
    for (int j = 0; j < 32; j++) {
        const float v = x[j] * id, a = fabsf(v), whole = floorf(a);
        const float r = whole + (a - whole >= 0.5f ? 1.0f : 0.0f); /* half away from zero */
        /* a subnormal d has an infinite inverse: the reference's NaN or infinite codes cast to 0 */
        const int q = !(r < 256.0f) ? 0 : v > 0.0f ? (int)r : v < 0.0f ? -(int)r : 0;
        out[2 + j] = (uint8_t)(int8_t)q;
    }
    return !f16_finite(h);
}

/* q4_0 (levels 8) and q5_0 (levels 16): d = max / -levels, code trunc(x / d + levels + 0.5) */
static int enc_sym(const float *x, uint8_t *out, int levels) {
    const float d = signed_max(x) / (float)(-levels), id = inverse(d), top = (float)(2 * levels - 1);
    const float half = (float)levels + 0.5f;
    uint8_t codes[32];
    for (int j = 0; j < 32; j++) {
        /* a subnormal d has an infinite inverse: the reference's NaN or infinite codes cast to 0 */
        float q = truncf(x[j] * id + half);
        q = !isfinite(q) ? 0.0f : q < 0.0f ? 0.0f : q > top ? top : q;
        codes[j] = (uint8_t)q;
    }
    const uint16_t h = f16_of(d);
    put_f16(out, h);
    if (levels == 16) {
        put_qh(codes, out + 2);
        pack_nibbles(codes, out + 6);
    } else {
        pack_nibbles(codes, out + 2);
    }
    return !f16_finite(h);
}

/* q4_1 (top 15) and q5_1 (top 31): d = (max - min) / top, code trunc((x - min) / d + 0.5); the min
 * and max are the first of equal values, as GGML's reference loop finds them */
static int enc_affine(const float *x, uint8_t *out, int top) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < 32; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    const float d = (hi - lo) / (float)top, id = inverse(d), ftop = (float)top;
    uint8_t codes[32];
    for (int j = 0; j < 32; j++) {
        float q = truncf((x[j] - lo) * id + 0.5f);
        q = !isfinite(q) ? 0.0f : q < 0.0f ? 0.0f : q > ftop ? ftop : q; /* as enc_sym: non-finite codes 0 */
        codes[j] = (uint8_t)q;
    }
    const uint16_t hd = f16_of(d), hm = f16_of(lo);
    put_f16(out, hd);
    put_f16(out + 2, hm);
    if (top == 31) {
        put_qh(codes, out + 4);
        pack_nibbles(codes, out + 8);
    } else {
        pack_nibbles(codes, out + 4);
    }
    return !(f16_finite(hd) && f16_finite(hm));
}

/* E8M0 exponent of a block's largest magnitude: floor(log2(amax)) + 125 as uint8 (numpy's float32 log2
 * and cast: the float32 rounding of the logarithm, then a wrap to 8 bits), 0 for an all-zero block */
static uint8_t mx_exponent(float amax) {
    if (!(amax > 0.0f)) return 0;
    const float l = (float)log2((double)amax);
    return (uint8_t)(int32_t)(floorf(l) + 125.0f);
}

static int enc_mxfp4(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const uint8_t e = mx_exponent(amax);
    const uint32_t e32 = e;
    const float half = as_f32(e32 < 2 ? (0x00200000u << e32) : ((e32 - 1u) << 23));
    uint8_t codes[32];
    for (int j = 0; j < 32; j++) {
        float best = fabsf(half * MXF4[0] - x[j]);
        int c = 0;
        for (int k = 1; k < 16; k++) {
            const float t = half * MXF4[k];
            const float err = fabsf(t - x[j]);
            if (err < best) {
                best = err;
                c = k;
            }
        }
        codes[j] = (uint8_t)c;
    }
    out[0] = e;
    pack_nibbles(codes, out + 1);
    return 0;
}

/* GGML's nearest grid point: the upper one unless the lower is strictly nearer (halfway goes up). Without branches (a
 * binary search through the grid, then the two neighbours compared): the values are data, a branch on
 * each would be mispredicted half the time. */
static const float IQ4_PAD[17] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113, 113};

static inline int nearest_iq4(float v) {
    int p = 0; /* the last grid point <= v (0 when none is) */
    p += (IQ4_PAD[p + 8] <= v) << 3;
    p += (IQ4_PAD[p + 4] <= v) << 2;
    p += (IQ4_PAD[p + 2] <= v) << 1;
    p += (IQ4_PAD[p + 1] <= v);
    const int down = v - IQ4_PAD[p] < IQ4_PAD[p + 1] - v;
    const int r = p + 1 - down;
    const int low = v <= IQ4[0], high = v >= IQ4[15];
    return (r & -(1 - low - high)) | (15 & -high);
}

/* the 16 candidate inverse scales of a block (GGML's search without weights: 1/d0, then (k + v0) / max
 * for k = -7 ... 7), its squared values, and whether it is live (largest magnitude >= 1e-15) */
static int iq4_setup(const float *x, float *inv, float *w) {
    float amax = fabsf(x[0]), big = x[0];
    for (int j = 0; j < 32; j++) {
        w[j] = x[j] * x[j];
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            big = x[j];
        }
    }
    const int live = amax >= 1e-15f;
    const float sbig = live ? big : 1.0f;
    const float d0 = -sbig / IQ4[0];
    inv[0] = 1.0f / d0;
    for (int t = 1; t < 16; t++) inv[t] = ((float)(t - 8) + IQ4[0]) / sbig;
    return live;
}

/* the reference's choice among the candidates: the block's scale d */
static float iq4_choose(const float *sqx, const float *sq2, int live) {
    float d = sqx[0] / sq2[0];
    float best = d * sqx[0];
    for (int t = 1; t < 16; t++) {
        const float a = sqx[t] * sqx[t], b = best * sq2[t];
        if (sq2[t] > 0.0f && a > b) {
            d = sqx[t] / sq2[t];
            best = d * sqx[t];
        }
    }
    return live ? d : 0.0f;
}

static int iq4_store(float d, const uint8_t *codes, uint8_t *out) {
    const uint16_t h = f16_of(d);
    put_f16(out, h);
    pack_nibbles(codes, out + 2);
    return !f16_finite(h);
}

static int enc_iq4_nl(const float *x, uint8_t *out) {
    float inv[16], w[32], sqx[16], sq2[16];
    const int live = iq4_setup(x, inv, w);
    for (int t = 0; t < 16; t++) {
        float a = 0.0f, b = 0.0f;
        for (int j = 0; j < 32; j++) { /* in order, as the reference adds */
            const float q = IQ4[nearest_iq4(inv[t] * x[j])];
            const float wq = w[j] * q;
            const float u = wq * x[j], v = wq * q;
            a = a + u;
            b = b + v;
        }
        sqx[t] = a;
        sq2[t] = b;
    }
    const float d = iq4_choose(sqx, sq2, live), id = inverse(d);
    uint8_t codes[32];
    for (int j = 0; j < 32; j++) codes[j] = (uint8_t)nearest_iq4(id * x[j]); /* every value to its nearest point */
    return iq4_store(d, codes, out);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ENC_X512 __attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq")))
#define ENC_X256 __attribute__((noinline, target("avx2")))

/* the nearest grid point of each of 16 lanes (nearest_iq4's steps): a 4-step binary search through
 * VPERMPS lookups of the 16-value grid, then the two neighbours compared */
__attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq"))) static inline __m512i
x512_nearest(__m512 al, __m512 grid) {
    __m512i p = _mm512_setzero_si512();
    for (int s = 8; s; s >>= 1) {
        const __m512i t = _mm512_add_epi32(p, _mm512_set1_epi32(s));
        const __mmask16 le = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(t, grid), al, _CMP_LE_OQ);
        p = _mm512_mask_mov_epi32(p, le, t);
    }
    const __m512i p1 = _mm512_add_epi32(p, _mm512_set1_epi32(1));
    const __m512 lower = _mm512_permutexvar_ps(p, grid), upper = _mm512_permutexvar_ps(p1, grid);
    const __mmask16 down = _mm512_cmp_ps_mask(_mm512_sub_ps(al, lower), _mm512_sub_ps(upper, al), _CMP_LT_OQ);
    __m512i idx = _mm512_mask_mov_epi32(p1, down, p);
    idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(al, _mm512_set1_ps(IQ4[0]), _CMP_LE_OQ), _mm512_setzero_si512());
    return _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(al, _mm512_set1_ps(IQ4[15]), _CMP_GE_OQ),
                                 _mm512_set1_epi32(15));
}

/* the 16 candidates in the lanes of one vector, each lane adding in the reference's order */
ENC_X512 static int enc_iq4_nl_x512(const float *x, uint8_t *out) {
    float inv[16], w[32], sqx[16], sq2[16];
    const int live = iq4_setup(x, inv, w);
    const __m512 grid = _mm512_loadu_ps(IQ4), vinv = _mm512_loadu_ps(inv);
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int j = 0; j < 32; j++) {
        const __m512 xv = _mm512_set1_ps(x[j]);
        const __m512 q = _mm512_permutexvar_ps(x512_nearest(_mm512_mul_ps(vinv, xv), grid), grid);
        const __m512 wq = _mm512_mul_ps(_mm512_set1_ps(w[j]), q);
        a = _mm512_add_ps(a, _mm512_mul_ps(wq, xv));
        b = _mm512_add_ps(b, _mm512_mul_ps(wq, q));
    }
    _mm512_storeu_ps(sqx, a);
    _mm512_storeu_ps(sq2, b);
    const float d = iq4_choose(sqx, sq2, live);
    const __m512 id = _mm512_set1_ps(inverse(d));
    uint8_t codes[32];
    for (int h = 0; h < 32; h += 16) {
        const __m512i idx = x512_nearest(_mm512_mul_ps(id, _mm512_loadu_ps(x + h)), grid);
        _mm_storeu_si128((__m128i *)(codes + h), _mm512_cvtepi32_epi8(idx));
    }
    return iq4_store(d, codes, out);
}

/* grid[idx] for 8 lanes of indices 0..15: two 8-value tables and a select */
__attribute__((always_inline, target("avx2"))) static inline __m256 x256_grid(__m256i idx, __m256 lo, __m256 hi) {
    const __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
    const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
    return _mm256_blendv_ps(a, b, upper);
}

/* nearest_iq4 of 8 lanes */
__attribute__((always_inline, target("avx2"))) static inline __m256i x256_nearest(__m256 al, __m256 lo, __m256 hi) {
    __m256i p = _mm256_setzero_si256();
    for (int s = 8; s; s >>= 1) {
        const __m256i t = _mm256_add_epi32(p, _mm256_set1_epi32(s));
        const __m256 le = _mm256_cmp_ps(x256_grid(t, lo, hi), al, _CMP_LE_OQ);
        p = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(p), _mm256_castsi256_ps(t), le));
    }
    const __m256i p1 = _mm256_min_epi32(_mm256_add_epi32(p, _mm256_set1_epi32(1)), _mm256_set1_epi32(15));
    const __m256 lower = x256_grid(p, lo, hi), upper = x256_grid(p1, lo, hi);
    const __m256 down = _mm256_cmp_ps(_mm256_sub_ps(al, lower), _mm256_sub_ps(upper, al), _CMP_LT_OQ);
    __m256 idx = _mm256_blendv_ps(_mm256_castsi256_ps(p1), _mm256_castsi256_ps(p), down);
    idx = _mm256_blendv_ps(idx, _mm256_setzero_ps(), _mm256_cmp_ps(al, _mm256_set1_ps(IQ4[0]), _CMP_LE_OQ));
    idx = _mm256_blendv_ps(idx, _mm256_castsi256_ps(_mm256_set1_epi32(15)),
                           _mm256_cmp_ps(al, _mm256_set1_ps(IQ4[15]), _CMP_GE_OQ));
    return _mm256_castps_si256(idx);
}

/* the 16 candidates in two vectors of 8 */
ENC_X256 static int enc_iq4_nl_x256(const float *x, uint8_t *out) {
    float inv[16], w[32], sqx[16], sq2[16];
    const int live = iq4_setup(x, inv, w);
    const __m256 lo = _mm256_loadu_ps(IQ4), hi = _mm256_loadu_ps(IQ4 + 8);
    const __m256 inv0 = _mm256_loadu_ps(inv), inv1 = _mm256_loadu_ps(inv + 8);
    __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), a1 = a0, b1 = b0;
    for (int j = 0; j < 32; j++) {
        const __m256 xv = _mm256_set1_ps(x[j]), wv = _mm256_set1_ps(w[j]);
        const __m256 q0 = x256_grid(x256_nearest(_mm256_mul_ps(inv0, xv), lo, hi), lo, hi);
        const __m256 q1 = x256_grid(x256_nearest(_mm256_mul_ps(inv1, xv), lo, hi), lo, hi);
        const __m256 wq0 = _mm256_mul_ps(wv, q0), wq1 = _mm256_mul_ps(wv, q1);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(wq0, xv));
        b0 = _mm256_add_ps(b0, _mm256_mul_ps(wq0, q0));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(wq1, xv));
        b1 = _mm256_add_ps(b1, _mm256_mul_ps(wq1, q1));
    }
    _mm256_storeu_ps(sqx, a0);
    _mm256_storeu_ps(sqx + 8, a1);
    _mm256_storeu_ps(sq2, b0);
    _mm256_storeu_ps(sq2 + 8, b1);
    const float d = iq4_choose(sqx, sq2, live);
    const __m256 id = _mm256_set1_ps(inverse(d));
    int32_t idx[32];
    for (int h = 0; h < 32; h += 8)
        _mm256_storeu_si256((__m256i *)(idx + h), x256_nearest(_mm256_mul_ps(id, _mm256_loadu_ps(x + h)), lo, hi));
    uint8_t codes[32];
    for (int j = 0; j < 32; j++) codes[j] = (uint8_t)idx[j];
    return iq4_store(d, codes, out);
}
#endif

static int enc_block(int target, int isa, const float *x, uint8_t *out) {
    switch (target) {
    case T_Q8_0:
        return enc_q8_0(x, out);
    case T_Q5_1:
        return enc_affine(x, out, 31);
    case T_Q5_0:
        return enc_sym(x, out, 16);
    case T_Q4_1:
        return enc_affine(x, out, 15);
    case T_Q4_0:
        return enc_sym(x, out, 8);
    case T_IQ4_NL:
#if defined(__x86_64__) && defined(__GNUC__)
        if (isa >= 2) return enc_iq4_nl_x512(x, out);
        if (isa == 1) return enc_iq4_nl_x256(x, out);
#endif
        (void)isa;
        return enc_iq4_nl(x, out);
    default:
        return enc_mxfp4(x, out);
    }
}

/* one GGML block -> its 32 values (ple.table.formats.blocks' definitions) */
static void dec_block(int target, const uint8_t *b, float *v) {
    const float d = f32_of_f16((uint32_t)b[0] | ((uint32_t)b[1] << 8));
    int j;
    switch (target) {
    case T_Q8_0:
        for (j = 0; j < 32; j++) v[j] = (float)(int8_t)b[2 + j] * d;
        return;
    case T_Q4_0:
        for (j = 0; j < 16; j++) {
            v[j] = d * (float)((int)(b[2 + j] & 15u) - 8);
            v[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
        }
        return;
    case T_IQ4_NL:
        for (j = 0; j < 16; j++) {
            v[j] = d * IQ4[b[2 + j] & 15u];
            v[j + 16] = d * IQ4[b[2 + j] >> 4];
        }
        return;
    case T_Q4_1: {
        const float m = f32_of_f16((uint32_t)b[2] | ((uint32_t)b[3] << 8));
        for (j = 0; j < 16; j++) {
            float t = d * (float)(b[4 + j] & 15u);
            v[j] = t + m;
            t = d * (float)(b[4 + j] >> 4);
            v[j + 16] = t + m;
        }
        return;
    }
    case T_Q5_0: {
        const uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
        for (j = 0; j < 16; j++) {
            const int lo = (int)((b[6 + j] & 15u) | (((qh >> j) & 1u) << 4));
            const int hi = (int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
            v[j] = d * ((float)lo - 16.0f);
            v[j + 16] = d * ((float)hi - 16.0f);
        }
        return;
    }
    case T_Q5_1: {
        const float m = f32_of_f16((uint32_t)b[2] | ((uint32_t)b[3] << 8));
        const uint32_t qh = (uint32_t)b[4] | ((uint32_t)b[5] << 8) | ((uint32_t)b[6] << 16) | ((uint32_t)b[7] << 24);
        for (j = 0; j < 16; j++) {
            const int lo = (int)((b[8 + j] & 15u) | (((qh >> j) & 1u) << 4));
            const int hi = (int)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
            float t = d * (float)lo;
            v[j] = t + m;
            t = d * (float)hi;
            v[j + 16] = t + m;
        }
        return;
    }
    default: { /* mxfp4 */
        const uint32_t e = b[0];
        const float h = as_f32(e < 2 ? (0x00200000u << e) : ((e - 1u) << 23));
        for (j = 0; j < 16; j++) {
            v[j] = h * MXF4[b[1 + j] & 15u];
            v[j + 16] = h * MXF4[b[1 + j] >> 4];
        }
        return;
    }
    }
}

/* nearest E2M1 code, ties to even, sign in bit 3 (the thresholds of ple.table.formats.blocks._e2m1_codes) */
static uint8_t e2m1_code(float v) {
    const float a = fabsf(v);
    const int mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return (uint8_t)(mag | (signbit(v) ? 8 : 0));
}

/* a row of D values -> nvfp4: D/2 bytes of codes, then D/16 E4M3 block scales */
static void enc_nvfp4_row(const float *x, int64_t D, float g, uint8_t *out, float *y) {
    uint8_t *sbytes = out + D / 2;
    for (int64_t c = 0; c < D; c += 16) {
        float amax = 0.0f;
        for (int j = 0; j < 16; j++) amax = fabsf(x[c + j]) > amax ? fabsf(x[c + j]) : amax;
        float want = amax / 6.0f;
        want = want / g;
        const uint8_t sb = e4m3_of(want < 448.0f ? want : 448.0f);
        const float step = E4M3_LUT[sb] * g;
        sbytes[c / 16] = sb;
        uint8_t codes[16];
        for (int j = 0; j < 16; j++) codes[j] = e2m1_code(step > 0.0f ? x[c + j] / step : 0.0f);
        for (int j = 0; j < 16; j += 2) out[(c + j) / 2] = (uint8_t)((codes[j] & 15u) | ((codes[j + 1] & 15u) << 4));
        if (y) {
            const float s = E4M3_LUT[sb];
            for (int j = 0; j < 16; j++) {
                const float t = E2M1V[codes[j]] * s;
                y[c + j] = t * g;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------
 * One row: decode, check, encode, and the error of the encoded row against the decoded one */

static void note_fail(job_t *J, int64_t row, int64_t col, int kind, float value) {
    pthread_mutex_lock(&J->lock);
    if (row < J->fail_row) { /* the lowest row wins */
        J->fail_col = col;
        J->fail_kind = kind;
        J->fail_value = value;
        __atomic_store_n(&J->fail_row, row, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&J->lock);
}

static float block_big(const float *x, int64_t n) {
    float amax = fabsf(x[0]), big = x[0];
    for (int64_t j = 1; j < n; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            big = x[j];
        }
    return big;
}

/* returns 0, or 1 when the row failed (noted) */
static int do_row(job_t *J, int64_t i, float *x, float *y) {
    const int64_t D = J->D;
    decode_source(J, i, x);
    for (int64_t j = 0; j < D; j++)
        if (!isfinite(x[j])) {
            note_fail(J, i, j, 1, x[j]);
            return 1;
        }
    if (J->target < 0) { /* decode only: the row's largest magnitude */
        float amax = 0.0f;
        for (int64_t j = 0; j < D; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        J->out_scale[i] = amax;
        return 0;
    }
    uint8_t *o = J->out + i * J->out_bytes;
    const int want_stats = J->err_sq != NULL;
    if (J->target <= T_MXFP4) {
        const int64_t bn = BLOCK_BYTES[J->target];
        for (int64_t c = 0, k = 0; c < D; c += 32, k++) {
            if (enc_block(J->target, J->isa, x + c, o + k * bn)) {
                note_fail(J, i, c, 2, block_big(x + c, 32));
                return 1;
            }
            if (want_stats) dec_block(J->target, o + k * bn, y + c);
        }
    } else if (J->target == T_NVFP4) {
        enc_nvfp4_row(x, D, J->target_global, o, want_stats ? y : NULL);
    } else { /* fp8_row / int8_row: scale = amax / qmax (1 for a zero row), q = x / scale */
        const int fp8 = J->target == T_FP8_ROW;
        float amax = 0.0f;
        for (int64_t j = 0; j < D; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        const float s = amax > 0.0f ? amax / (fp8 ? 448.0f : 127.0f) : 1.0f;
        J->out_scale[i] = s;
        for (int64_t j = 0; j < D; j++) {
            float v = x[j] / s;
            if (fp8) {
                v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
                o[j] = e4m3_of(v);
                y[j] = E4M3_LUT[o[j]] * s;
            } else {
                v = rintf(v);
                v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
                o[j] = (uint8_t)(int8_t)(int)v;
                y[j] = v * s;
            }
        }
    }
    if (want_stats) {
        double e2 = 0.0, r2 = 0.0, emax = 0.0, amax = 0.0;
        for (int64_t j = 0; j < D; j++) {
            const double xd = (double)x[j], err = (double)y[j] - xd;
            e2 += err * err;
            r2 += xd * xd;
            emax = fabs(err) > emax ? fabs(err) : emax;
            amax = fabs(xd) > amax ? fabs(xd) : amax;
        }
        J->err_sq[i] = e2;
        J->ref_sq[i] = r2;
        J->max_rel[i] = amax > 0.0 ? emax / amax : 0.0;
    }
    return 0;
}

#define ENCODE_CHUNK 64 /* rows a thread takes at a time */

static void *encode_worker(void *arg) {
    job_t *J = (job_t *)arg;
    float *x = (float *)malloc((size_t)J->D * 2 * sizeof(float));
    if (!x) {
        __atomic_store_n(&J->oom, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    float *y = x + J->D;
    for (;;) {
        const int64_t a = __atomic_fetch_add(&J->next, ENCODE_CHUNK, __ATOMIC_RELAXED);
        if (a >= J->n || a > __atomic_load_n(&J->fail_row, __ATOMIC_RELAXED)) break;
        const int64_t b = a + ENCODE_CHUNK < J->n ? a + ENCODE_CHUNK : J->n;
        for (int64_t i = a; i < b; i++)
            if (do_row(J, i, x, y)) break;
    }
    free(x);
    return NULL;
}

/* Rows [0, n) of `src` (rows src_stride bytes apart, in source kind src_kind with the given scale)
 * encoded into `out` (rows out_bytes apart) in format `target` (or, for target -1, each row's largest
 * magnitude into out_scale); out_scale receives the per-row scales of fp8_row / int8_row; err_sq,
 * ref_sq, max_rel (each [n] or all null) the error statistics of ple.table.formats.quantize.RowStats. */
int ple_encode_rows(int src_kind, const uint8_t *src, int64_t src_stride, int64_t n, int64_t D, int scale_kind,
                    const float *scale, float src_global, int target, float target_global, uint8_t *out,
                    int64_t out_bytes, float *out_scale, double *err_sq, double *ref_sq, double *max_rel,
                    int threads, int64_t *fail, float *fail_value) {
    if (src_kind < S_F32 || src_kind > S_NVFP4 || target < -1 || target > T_INT8_ROW || n < 0 || D < 1) return -1;
    if (target >= 0 && target <= T_MXFP4 && D % 32) return -1;
    if ((target == T_NVFP4 || src_kind == S_NVFP4) && D % 16) return -1;
    if (scale_kind < 0 || scale_kind > 2 || (scale_kind && !scale)) return -1;
    if ((target == -1 || target >= T_FP8_ROW) && !out_scale) return -1;
    job_t J;
    memset(&J, 0, sizeof J);
    J.src_kind = src_kind;
    J.scale_kind = scale_kind;
    J.src = src;
    J.src_stride = src_stride;
    J.n = n;
    J.D = D;
    J.scale = scale;
    J.src_global = src_global;
    J.target = target;
    J.target_global = target_global;
    J.out = out;
    J.out_bytes = out_bytes;
    J.out_scale = out_scale;
    J.err_sq = err_sq;
    J.ref_sq = ref_sq;
    J.max_rel = max_rel;
    J.fail_row = n;
    J.isa = ple_current_isa();
    pthread_mutex_init(&J.lock, NULL);
    const int64_t chunks = (n + ENCODE_CHUNK - 1) / ENCODE_CHUNK;
    if (threads < 1) threads = 1;
    if (threads > chunks) threads = chunks > 0 ? (int)chunks : 1;
    ple_team_run(threads, encode_worker, &J);
    pthread_mutex_destroy(&J.lock);
    if (J.oom) return -2;
    if (J.fail_row < n) {
        fail[0] = J.fail_row;
        fail[1] = J.fail_col;
        *fail_value = J.fail_value;
        return J.fail_kind;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Stored rows that hold a value that is not finite */

static int64_t row_bad_col(int kind, const uint8_t *r, int64_t D) {
    int64_t j;
    switch (kind) {
    case S_F32:
        for (j = 0; j < D; j++) {
            uint32_t u;
            memcpy(&u, r + 4 * j, 4);
            if ((u & 0x7f800000u) == 0x7f800000u) return j;
        }
        return -1;
    case S_F16:
        for (j = 0; j < D; j++)
            if ((r[2 * j + 1] & 0x7cu) == 0x7cu) return j;
        return -1;
    case S_BF16:
        for (j = 0; j < D; j++)
            if ((((uint32_t)r[2 * j + 1] << 8 | r[2 * j]) & 0x7f80u) == 0x7f80u) return j;
        return -1;
    case S_E4M3:
        for (j = 0; j < D; j++)
            if ((r[j] & 0x7fu) == 0x7fu) return j;
        return -1;
    case S_E5M2:
        for (j = 0; j < D; j++)
            if ((r[j] & 0x7cu) == 0x7cu) return j;
        return -1;
    case S_I8:
        return -1;
    case S_NVFP4: /* the E4M3 block scales after the D/2 bytes of codes */
        for (j = 0; j < D / 16; j++)
            if ((r[D / 2 + j] & 0x7fu) == 0x7fu) return 16 * j;
        return -1;
    default: { /* a GGML block format: its fp16 scale (and minimum), or mxfp4's decoded values */
        const int t = kind - K_BLOCKS;
        const int64_t bn = BLOCK_BYTES[t];
        for (int64_t c = 0, k = 0; c < D; c += 32, k++) {
            const uint8_t *b = r + k * bn;
            if (t == T_MXFP4) {
                float v[32];
                dec_block(t, b, v);
                for (j = 0; j < 32; j++)
                    if (!isfinite(v[j])) return c + j;
                continue;
            }
            if ((b[1] & 0x7cu) == 0x7cu) return c;
            if ((t == T_Q4_1 || t == T_Q5_1) && (b[3] & 0x7cu) == 0x7cu) return c;
        }
        return -1;
    }
    }
}

/* whether a row of plain values holds a NaN or infinity, without a branch per value (vectorizes) */
static int row_any_bad(int kind, const uint8_t *r, int64_t D) {
    unsigned bad = 0;
    int64_t j;
    switch (kind) {
    case S_F32: {
        for (j = 0; j < D; j++) {
            uint32_t u;
            memcpy(&u, r + 4 * j, 4);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
        return bad != 0;
    }
    case S_F16:
    case S_BF16: {
        const uint16_t m = kind == S_F16 ? 0x7c00u : 0x7f80u;
        for (j = 0; j < D; j++) {
            uint16_t h;
            memcpy(&h, r + 2 * j, 2);
            bad |= (h & m) == m;
        }
        return bad != 0;
    }
    case S_E4M3:
        for (j = 0; j < D; j++) bad |= (r[j] & 0x7fu) == 0x7fu;
        return bad != 0;
    case S_E5M2:
        for (j = 0; j < D; j++) bad |= (r[j] & 0x7cu) == 0x7cu;
        return bad != 0;
    case S_I8:
        return 0;
    default:
        return row_bad_col(kind, r, D) >= 0;
    }
}

/* The first of rows [0, n) (stride bytes apart, D values each, stored as `kind`) holding a value that
 * is not finite: its index, with the column in *col; -1 when every value is finite, -2 for a bad kind. */
int64_t ple_first_nonfinite(int kind, const uint8_t *data, int64_t stride, int64_t n, int64_t D, int64_t *col) {
    if (kind < S_F32 || (kind > S_NVFP4 && kind < K_BLOCKS) || kind > K_BLOCKS + T_MXFP4 || D < 1) return -2;
    if (kind >= K_BLOCKS && D % 32) return -2;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = data + i * stride;
        if (row_any_bad(kind, r, D)) {
            *col = row_bad_col(kind, r, D);
            return i;
        }
    }
    return -1;
}
