/* Force-included (gcc -include) into test builds of qstate/optim/csrc/update_kernel.c with
 * -DQSTATE_SIMDE_AVX512 (test/simde_kernel.py): the kernel's AVX-512 VBMI paths on any x86-64 machine
 * with AVX2, their intrinsics from SIMDe's portable implementations (Debian's libsimde-dev, headers
 * only), so that an AVX2-only machine (CI's) tests those paths against the inductor kernel and the
 * scalar encodes. Slow, and never used by the library's own builds.
 *
 * SIMDe 0.7 lacks a few of the intrinsics the kernel uses; they follow, lane by lane through arrays,
 * as Intel's guide defines them. */
#ifndef QSTATE_SIMDE_AVX512_H
#define QSTATE_SIMDE_AVX512_H

#include <stdint.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* dst = a:b, each the low half of the result's width */
#define _mm512_kunpackw(a, b) ((__mmask32)((uint32_t)(uint16_t)(a) << 16 | (uint16_t)(b)))
#define _mm512_kunpackd(a, b) ((__mmask64)((uint64_t)(uint32_t)(a) << 32 | (uint32_t)(b)))

/* a lane function of 16 int32 lanes: x[16] holds a's lanes (and y[16] b's) */
#define QSTATE_SIMDE_LANES_A(x, a)                                                        \
    int32_t x[16];                                                                        \
    _mm512_storeu_si512((void *)x, (a))

static inline __m512 qstate_simde_cvtepi32_ps(__m512i a) {
    QSTATE_SIMDE_LANES_A(x, a);
    float r[16];
    for (int k = 0; k < 16; k++) r[k] = (float)x[k]; /* round to nearest even, as vcvtdq2ps */
    return _mm512_loadu_ps(r);
}

/* truncations: the low byte of each lane, zeros above */
static inline __m128i qstate_simde_cvtepi32_epi8(__m512i a) {
    QSTATE_SIMDE_LANES_A(x, a);
    uint8_t r[16];
    for (int k = 0; k < 16; k++) r[k] = (uint8_t)x[k];
    return _mm_loadu_si128((const __m128i *)r);
}

static inline __m128i qstate_simde_cvtepi64_epi8(__m512i a) {
    int64_t x[8];
    _mm512_storeu_si512((void *)x, a);
    uint8_t r[16] = {0};
    for (int k = 0; k < 8; k++) r[k] = (uint8_t)x[k];
    return _mm_loadu_si128((const __m128i *)r);
}

static inline __m512i qstate_simde_cvtepu8_epi32(__m128i a) {
    uint8_t x[16];
    _mm_storeu_si128((__m128i *)x, a);
    int32_t r[16];
    for (int k = 0; k < 16; k++) r[k] = x[k];
    return _mm512_loadu_si512((const void *)r);
}

/* bit k: lanes k of a and b compared as uint32 (cmplt, cmpgt), or their AND zero (testn) */
#define QSTATE_SIMDE_MASK16(name, expr)                                                   \
    static inline __mmask16 name(__m512i a, __m512i b) {                                  \
        QSTATE_SIMDE_LANES_A(x, a);                                                       \
        QSTATE_SIMDE_LANES_A(y, b);                                                       \
        __mmask16 m = 0;                                                                  \
        for (int k = 0; k < 16; k++) {                                                    \
            const uint32_t u = (uint32_t)x[k], v = (uint32_t)y[k];                        \
            m |= (__mmask16)((expr) << k);                                                \
        }                                                                                 \
        return m;                                                                         \
    }
QSTATE_SIMDE_MASK16(qstate_simde_cmplt_epu32_mask, u < v)
QSTATE_SIMDE_MASK16(qstate_simde_cmpgt_epu32_mask, u > v)
QSTATE_SIMDE_MASK16(qstate_simde_testn_epi32_mask, (u & v) == 0)

#define _mm512_cvtepi32_ps qstate_simde_cvtepi32_ps
#define _mm512_cvtepi32_epi8 qstate_simde_cvtepi32_epi8
#define _mm512_cvtepi64_epi8 qstate_simde_cvtepi64_epi8
#define _mm512_cvtepu8_epi32 qstate_simde_cvtepu8_epi32
#define _mm512_cmplt_epu32_mask qstate_simde_cmplt_epu32_mask
#define _mm512_cmpgt_epu32_mask qstate_simde_cmpgt_epu32_mask
#define _mm512_testn_epi32_mask qstate_simde_testn_epi32_mask

#endif
