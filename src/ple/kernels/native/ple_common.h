/* What the library's C files share: the team and instruction-set entry points of ple_cpu.c, the
 * targets of the AVX2 and AVX-512 variants a file compiles its loops for, and the vectorizable
 * exponential. Included by every file (the build hashes it with them). */
#ifndef PLE_COMMON_H
#define PLE_COMMON_H

#include <stdint.h>
#include <string.h>

/* ple_cpu.c: runs fn(arg) on up to `threads` threads (the caller's among them) and returns how many
 * ran it; the instruction set the kernels use: 0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 BF16 */
int ple_team_run(int threads, void *(*fn)(void *), void *arg);
int ple_current_isa(void);

#if defined(__x86_64__) && defined(__GNUC__)
#define PLE_TARGET_AVX2 "avx2,fma,bmi2,f16c"
#if defined(__clang__)
#define PLE_TARGET_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2,f16c"
#else
#define PLE_TARGET_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2,f16c,prefer-vector-width=512"
#endif
#endif

/* exp(x) within 2 ulp on [-87, 88] (clamped outside): 2^n * p(r), r = x - n ln2, Taylor degree 7.
 * The clamps are written as min/max selects: other spellings make gcc compute both sides under
 * masks, and the discarded lanes hit denormal assists (ten times slower). */
static inline __attribute__((always_inline)) float ple_exp_vec(float x) {
    x = x < 88.0f ? x : 88.0f;
    x = x > -87.0f ? x : -87.0f;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

#endif
