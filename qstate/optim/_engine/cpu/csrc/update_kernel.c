/* Fused optimizer update over quantized states (8bit, 4bit, fp8), CPU.
 *
 * Built by qstate/optim/_engine/cpu/kernel.py (one shared object per kernel spec, never per shape), which
 * prepends the update rule's C, generated from its math for the spec's rule and static flags
 * (qstate/optim/_engine/cpu/rule_source.py: ``rule_consts_t``; ``rule_consts(h)``, the values of the scalars alone, once
 * per row segment; ``rule(p, g, s, h, c)``, one element: the decoded states s[] in, the new states in s[],
 * the new p returned; ``RULE_KEEPS_PARAM``: the rule returns p as it is, and p is never written), and before
 * it this configuration:
 *
 *   PARAM_BF16, GRAD_BF16                parameter / gradient stored as bfloat16 (the parameter
 *                                        is written rounded to nearest even, or with PARAM_SR
 *                                        stochastically: store_p_sr, from the caller's key)
 *                                        (ANY_SR, PARAM_SR or an S<i>_SR: the call reads keys and starts)
 *   NSTATES                              number of states (1 or more)
 *   S<i>_BITS, S<i>_BS, S<i>_SIGNED      state i: bits per code, block size, signedness
 *   S<i>_SHIFT, S<i>_BASE, S<i>_K, S<i>_ZERO   its encode table constants (qstate/formats/_codec.py)
 *   S<i>_SR, S<i>_N                      stochastic rounding (signed map states, unsigned fp8 states), map entries
 *   S<i>_FP8, S<i>_MAXCODE               an fp8 state (codes: float8_e4m3fn bits; ``qmap``: the
 *                                        256 values by code), and its scale divisor (448)
 *   S<i>_ENC8                            an 8-bit map state encoded by encode8_64 (its tables given)
 *   S<i>_ENC4                            a 16-entry map state encoded by map4_code16 (``threshold``: its
 *                                        16 code thresholds)
 *   ENC8_E_LOW                           encode8_64's lowest binade exponent (kernel._E_LOW)
 *   PREFETCH_AHEAD                       parameter / gradient elements ahead of the group being
 *                                        updated to prefetch (0: none; kernel._ENC8_PREFETCH_AHEAD)
 *   S<i>_PLAIN, S<i>_BF16                a plain state (``codes``: its float32, or bfloat16, values;
 *                                        read and written in place, rounded to nearest even)
 *   GROUP                                gcd of the block sizes: every state's scale is constant
 *                                        over an aligned group of GROUP elements
 *   UNIT                                 a row segment, whole blocks of every state (a multiple of
 *                                        the block sizes' lcm; kernel._MIN_ENC8_UNIT or more
 *                                        for kinds with an S<i>_ENC8 state), buffered on the stack
 *
 * Semantics: exactly the compiled inductor kernel's (qstate/optim/_engine/inductor.py):
 * the rule's math in float32 with float32 scalars ``h`` (in scalar_names order),
 * state values decoded as ``qmap[code] * scale``, new blocks scaled by their
 * absmax over valid elements (``scale == 0`` for a zero block, encoded with
 * divisor 1), and each element encoded as Codec.encode does: the packed-table nearest code
 * (then stochastic rounding for S<i>_SR states), or torch's float8_e4m3fn conversion for fp8 (then, for
 * S<i>_SR states, unsigned, stochastic rounding of positive values on the codes 0x00..0x7e, never to 0).
 * Stochastic rounding draws by position (qstate/formats/_rounding.py): the element at flat index n of the
 * full tensor (``starts`` + row * row_len + column) draws position_hash(key, n), from the caller's 64-bit key
 * for a PARAM_SR parameter (param_draw: its top 16 bits), from STATE_KEY(key, i) for state i (stochastic_code,
 * and the vector 4-bit encodes' sr_draw_W: the same draws lane by lane).
 * With AVX-512 VBMI, 8-bit map states rounded to nearest encode 64 values at a time without
 * the table's gathers (encode8_64: the same codes, from in-register tables) and fp8 states 16 at a
 * time (fp8_code16: fp8_code's steps in 32-bit lanes; equal on all 2**32 floats; fp8_sr_code16 for
 * stochastic rounding), 4-bit map states
 * 16 at a time (map4_code16: a search of the code thresholds, or of the map for stochastic rounding).
 * Blocks with an infinite or NaN scale (an infinity or a NaN among their values: block_absmax's
 * rule, an infinity outranking a NaN) take the scalar encode of every kind, whose ``normalized``
 * gives their infinities +-max_code and their NaNs 0 (BlockFormat.normalize).
 * With AVX2 (on machines without AVX-512 VBMI, and for what the 64- and 16-lane loops leave),
 * fp8 states encode 8 values at a time (fp8_code8) and decode from the codes' bits (fp8_value8), 4-bit map states encode 8 at a time (map4_code8, the same
 * search) and decode from two registers (lookup16), and 8-bit map states rounded to nearest encode 8
 * at a time (table_code8: ENCODE's steps in vectors around 8 loads from the packed table). Everything
 * else (stochastic rounding of 8-bit map states included; fp8 states rounded stochastically encode 8 at a
 * time, fp8_sr_code8), and every tail, uses the scalar
 * definitions, which the portable build runs throughout.
 * Compiled with -ffp-contract=off: no fused multiply-adds the eager ops lack.
 *
 * Plain states (S<i>_PLAIN) are read as float32 and written back in their dtype: the inductor
 * kernel's plain-state semantics; a kind's states are all plain or all quantized.
 *
 * Layout: ``rows`` rows of ``row_len`` elements; param/grad (and plain states) contiguous;
 * codes ``[rows, ceil(row_len * bits / 8)]`` (4-bit: element 2j in the low
 * nibble of byte j), scales ``[rows, ceil(row_len / bs)]``. Blocks never cross
 * rows. The work is split over (row, UNIT-element segment) items: decode + update per group,
 * then absmax and encode per block, while the segment is in L1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(QSTATE_SIMDE_AVX512) /* test builds: the AVX-512 VBMI paths through SIMDe (test/simde_avx512.h) */
#define HAVE_VBMI 1
#elif defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define HAVE_VBMI 1
#else
#define HAVE_VBMI 0
#endif
/* the 8-lane paths: on machines without AVX-512 VBMI, and after the 64- and 16-lane ones */
#if defined(__AVX2__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if HAVE_VBMI || HAVE_AVX2
#include <immintrin.h>
#endif

typedef struct {
    uint8_t *codes;
    float *scale;
    const float *qmap;
    const int32_t *table;
    int64_t code_stride;  /* bytes per row */
    int64_t scale_stride; /* scales per row */
    /* 8-bit map states, round to nearest: the in-register encode's tables (encode8_64), or NULL */
    const uint16_t *binade;  /* [64] per (sign, binade): first bucket | (8 - mantissa bits) << 9 */
    const uint8_t *bucket;   /* [512] lower code of each bucket */
    const float *threshold;  /* [256] (4-bit maps: [16]) t_c: the largest y whose nearest code is <= c */
} qstate_t;

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline float bf16_to_f(uint16_t v) { return u2f((uint32_t)v << 16); }

/* float -> bfloat16 bits, rounded to nearest even (a NaN stays a quiet NaN) */
static inline uint16_t f_to_bf16(float x) {
    uint32_t u = f2u(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if PARAM_BF16
typedef uint16_t param_t;
static inline float load_p(param_t v) { return bf16_to_f(v); }
static inline param_t store_p(float x) { return f_to_bf16(x); }
#else
typedef float param_t;
static inline float load_p(param_t v) { return v; }
static inline param_t store_p(float x) { return x; }
#endif

#if GRAD_BF16
typedef uint16_t grad_t;
static inline float load_g(grad_t v) { return bf16_to_f(v); }
#else
typedef float grad_t;
static inline float load_g(grad_t v) { return v; }
#endif

/* Chris Wellons' lowbias32: the 32-bit mix of every stochastic-rounding draw (qstate/_random.py) */
static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

/* whether the kernel draws (stochastic rounding of the parameter or of any state): then it reads the
 * caller's ``keys`` and ``starts`` */
#define SR_OR_(i) || S##i##_SR
#define ANY_SR (PARAM_SR FOR_STATES(SR_OR_))

/* The 32-bit draw of the element at flat index lo | hi << 32 of the full tensor under the 64-bit key
 * (qstate.formats.position_hash32): lowbias32(lo ^ key_lo ^ lowbias32(hi ^ key_hi)). For one key and hi it is
 * a bijection of lo: every element of a tensor (below 2**32 of them) gets its own hash; the inner hash is one
 * value per 2**32 elements (hoisted out of the vector loops). */
static inline uint32_t position_hash(uint64_t key, uint32_t lo, uint32_t hi) {
    return lowbias32(lo ^ (uint32_t)key ^ lowbias32(hi ^ (uint32_t)(key >> 32)));
}
static inline uint32_t position_hash64(uint64_t key, uint64_t n) {
    return position_hash(key, (uint32_t)n, (uint32_t)(n >> 32));
}

/* the draw key of state i under the parameter's key (qstate.formats.state_key: key ^ (i + 1) * the golden
 * ratio step, mod 2**64) */
#define STATE_KEY(key, i) ((uint64_t)(key) ^ ((uint64_t)((i) + 1) * 0x9E3779B97F4A7C15ull))

#if PARAM_SR
/* Stochastic rounding of a new bfloat16 parameter: qstate/optim/_engine/param_rounding.py's rule (round the magnitude up
 * when a uniform 16-bit draw is below the 16 low bits bfloat16 drops, so the expected value is x), with the
 * C kernel's own draws: the top 16 bits of position_hash of the caller's 64-bit key (one per parameter and
 * step) and the element's flat index lo | hi << 32 in the full tensor (qstate_update_many's ``starts``). */
static inline uint32_t param_draw(uint64_t key, uint32_t lo, uint32_t hi) { return position_hash(key, lo, hi) >> 16; }

static inline uint16_t store_p_sr(float x, uint32_t draw) {
    const uint32_t u = f2u(x), truncated = u & 0xffff0000u;
    return f_to_bf16(u2f(draw < (u & 0xffffu) ? truncated + 0x10000u : truncated));
}
#endif

/* stochastic_code's draws by position in each 32-bit lane of a W-bit vector (W: 512 or 256, the intrinsics'
 * width; defined for the widths the build has, before their map4_code): (float)(position_hash(key, n) >> 8)
 * for the lanes' flat indices n = base + lane, lane = 0 .. W / 32 - 1 (``lanes``: those numbers), the low
 * word's carry into the high word where it wraps (unsigned n_lo < base_lo, as a signed compare of both with
 * their top bits flipped: AVX2 has no unsigned compare; a carry lane is -1 and takes the next high word's hash) */
#define DEFINE_LOWBIAS32(W)                                                               \
    static inline __m##W##i lowbias32_##W(__m##W##i h) {                                  \
        h = _mm##W##_xor_si##W(h, _mm##W##_srli_epi32(h, 16));                            \
        h = _mm##W##_mullo_epi32(h, _mm##W##_set1_epi32((int32_t)0x7feb352du));           \
        h = _mm##W##_xor_si##W(h, _mm##W##_srli_epi32(h, 15));                            \
        h = _mm##W##_mullo_epi32(h, _mm##W##_set1_epi32((int32_t)0x846ca68bu));           \
        return _mm##W##_xor_si##W(h, _mm##W##_srli_epi32(h, 16));                         \
    }
#define DEFINE_SR_DRAW(W, CARRY)                                                          \
    DEFINE_LOWBIAS32(W)                                                                   \
    static inline __m##W sr_draw_##W(uint64_t key, uint64_t base, __m##W##i lanes) {      \
        const uint32_t lo = (uint32_t)base, hi = (uint32_t)(base >> 32);                  \
        const uint32_t k_lo = (uint32_t)key, k_hi = (uint32_t)(key >> 32);                \
        const __m##W##i base_lo = _mm##W##_set1_epi32((int32_t)lo);                       \
        const __m##W##i n_lo = _mm##W##_add_epi32(base_lo, lanes);                        \
        /* key_lo ^ lowbias32(n_hi ^ key_hi): one value unless the low word wraps in this vector (rare) */ \
        __m##W##i mix = _mm##W##_set1_epi32((int32_t)(k_lo ^ lowbias32(hi ^ k_hi)));      \
        if (lo > 0xffffffffu - (W / 32 - 1)) {                                            \
            const __m##W##i flip = _mm##W##_set1_epi32((int32_t)0x80000000u);             \
            const __m##W##i carry = CARRY(_mm##W##_xor_si##W(base_lo, flip), _mm##W##_xor_si##W(n_lo, flip)); \
            const __m##W##i next = _mm##W##_set1_epi32((int32_t)(k_lo ^ lowbias32((hi + 1u) ^ k_hi))); \
            mix = _mm##W##_or_si##W(_mm##W##_and_si##W(carry, next), _mm##W##_andnot_si##W(carry, mix)); \
        }                                                                                 \
        const __m##W##i h = lowbias32_##W(_mm##W##_xor_si##W(n_lo, mix));                 \
        return _mm##W##_cvtepi32_ps(_mm##W##_srli_epi32(h, 8));                           \
    }

/* The rank of x among the floats (qstate/formats/_rounding.py float_rank): neighbouring floats differ by 1,
 * both zeros rank 0 */
static inline int32_t float_rank(float x) {
    const int32_t b = (int32_t)f2u(x);
    return b < 0 ? -(b & 0x7fffffff) : b;
}

/* Stochastic rounding of y onto the sorted map from its nearest code c, with the 32-bit draw h (by position:
 * position_hash, qstate/_random.py; the spec: qstate/formats/_rounding.py): up with probability (y - lo) / (hi - lo); exact on map entries
 * and on their neighbouring floats. */
static inline int32_t stochastic_code(float y, int32_t c, const float *restrict qmap, int32_t n, uint32_t h) {
    c -= qmap[c] > y;
    c = c < 0 ? 0 : (c > n - 2 ? n - 2 : c);
    const float lo = qmap[c], hi = qmap[c + 1];
    const float draw = (float)(h >> 8);
    const int32_t r = float_rank(y);
    const int32_t up = (r >= float_rank(hi) - 1) | ((r > float_rank(lo) + 1) & (draw * (hi - lo) < (y - lo) * 16777216.0f));
    return c + up;
}

/* fp8 states: float -> float8_e4m3fn bits exactly as torch's conversion (c10's
 * fp8e4m3fn_from_fp32_value: round to nearest even; a value that rounds past 448, an infinity included,
 * saturates to 448 (0x7e); NaN -> 0x7f); unsigned states as qstate.formats.fp8.code_of: a positive value
 * never encodes as 0, a negative one as 0. */
static inline uint8_t fp8_code(float y, int is_signed) {
    const uint32_t bits = f2u(y), sign = bits & 0x80000000u, mag = bits ^ sign;
    const uint32_t denorm_mask = 141u << 23;
    const uint32_t sub = f2u(u2f(mag) + u2f(denorm_mask)) - denorm_mask;
    const uint32_t normal = (mag + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
    uint32_t code = mag < (121u << 23) ? sub : (normal < 0x7eu ? normal : 0x7eu);
    code = mag > 0x7f800000u ? 0x7fu : code;
    code |= sign >> 24;
    if (!is_signed) {
        code = (code == 0u && y > 0.0f) ? 1u : code;
        code = y < 0.0f ? 0u : code;
    }
    return (uint8_t)code;
}

/* Whether the values y = x / div of an fp8 block are all numbers below 464 in magnitude, which round to at
 * most 448: then the vector encodes may skip fp8_code's saturation and NaN steps (their ``bounded``). The
 * divisor is the block's scale fl(amax / 448) (or 1 for scale 0) and every |x| <= amax; a finite normal
 * divisor (Float8Format.scale_of: two more roundings) is within 2**-22 of amax / 448, so |y| <= 448 (1 + 2**-21). A subnormal one may be off by far
 * more (amax 1000 * 2**-149 has the divisor 2 * 2**-149, and y = 500), an infinite or NaN one gives NaN
 * values. */
/* fp8 stochastic rounding's map (qstate.formats.fp8.NON_NEGATIVE_VALUES): the codes 0x00..0x7e, the first
 * entries of an fp8 state's qmap (the values by code), sorted */
#define FP8_NON_NEGATIVE_CODES 127
static inline int fp8_bounded(float div) { return div >= 0x1p-126f && div < INFINITY; }

/* x / div, or the smallest subnormal of its sign where that underflows to 0 for x != 0 and a finite div: the
 * quotient's bits or 1 (qstate/formats/_base.py nonzero_quotient; over an infinite div a finite x stays 0, the
 * zero code, which decodes as NaN) */
static inline float nonzero_quotient(float x, float div) {
    const float y = x / div;
    return u2f(f2u(y) | (uint32_t)(y == 0.0f && x != 0.0f && div != INFINITY));
}

/* The normalized value of x in a block of divisor div (BlockFormat.normalize): nonzero_quotient(x, div), except
 * where that is NaN, which only a block whose scale is infinite or NaN gives: there x clamped to [-max_code,
 * max_code] (an infinity takes +-max_code), 0 for a NaN x, so infinities decode to their sign's infinity and
 * everything else in the block to NaN (selects; the vector encodes never see such blocks: NONFINITE_BLOCK) */
static inline float normalized(float x, float div, float max_code) {
    const float y = nonzero_quotient(x, div);
    const float clamped = x < -max_code ? -max_code : (x > max_code ? max_code : x);
    const float lost = x != x ? 0.0f : clamped;
    return y != y ? lost : y;
}

#if HAVE_VBMI
/* nonzero_quotient (of a finite divisor: the vector encodes never see non-finite blocks) and float_rank of 16
 * values */
static inline __m512 nonzero_quotient_512(__m512 x, __m512 div) {
    const __m512 y = _mm512_div_ps(x, div), zero = _mm512_setzero_ps();
    const __mmask16 under = _mm512_cmp_ps_mask(y, zero, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(x, zero, _CMP_NEQ_UQ);
    const __m512i b = _mm512_castps_si512(y);
    return _mm512_castsi512_ps(_mm512_mask_or_epi32(b, under, b, _mm512_set1_epi32(1)));
}
static inline __m512i float_rank_512(__m512 x) {
    const __m512i b = _mm512_castps_si512(x), zero = _mm512_setzero_si512();
    return _mm512_mask_sub_epi32(b, _mm512_cmplt_epi32_mask(b, zero), zero,
                                 _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)));
}
#endif
#if HAVE_AVX2
/* nonzero_quotient (of a finite divisor, as above) and float_rank of 8 values */
static inline __m256 nonzero_quotient_256(__m256 x, __m256 div) {
    const __m256 y = _mm256_div_ps(x, div), zero = _mm256_setzero_ps();
    const __m256 under = _mm256_and_ps(_mm256_cmp_ps(y, zero, _CMP_EQ_OQ), _mm256_cmp_ps(x, zero, _CMP_NEQ_UQ));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(y), _mm256_srli_epi32(_mm256_castps_si256(under), 31)));
}
static inline __m256i float_rank_256(__m256 x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i neg = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)));
    return _mm256_castps_si256(_mm256_blendv_ps(x, _mm256_castsi256_ps(neg), x));
}
#endif

/* an fp8 block's scale of its absmax (Float8Format.scale_of: re-encoding a decoded block keeps it) */
#define FP8_SCALE(amax, max_code) ((((amax) / (max_code)) * (max_code)) / (max_code))

/* whether a block of divisor div has an infinite or NaN scale: its elements take the scalar encode */
#define NONFINITE_BLOCK(div) (!((div) < INFINITY))
/* state i's normalized value of x in the block being encoded (ENCODE_BLOCKS' div) */
#define NORMALIZED(i, x) normalized((x), div, S##i##_MAXCODE)

/* Code of a normalized value (qstate/formats/_codec.py Codec.encode): nearest via the packed table,
 * then stochastic rounding for S<i>_SR states with the 32-bit draw h (evaluated only for those: SR_HASH) */
#define ENCODE(i, y, out, h)                                                           \
    do {                                                                               \
        if (S##i##_FP8) {                                                              \
            const float y8_ = (y);                                                     \
            (out) = fp8_code(y8_, S##i##_SIGNED);                                      \
            if (S##i##_SR && y8_ > 0.0f) { /* unsigned states only; never 0 */         \
                const int32_t c8_ = stochastic_code(y8_, (out), qmap##i, FP8_NON_NEGATIVE_CODES, (h)); \
                (out) = (uint8_t)(c8_ > 1 ? c8_ : 1);                                  \
            }                                                                          \
            break;                                                                     \
        }                                                                              \
        uint32_t bits_ = f2u(fabsf(y));                                                \
        int32_t neg_ = (y) < 0.0f;                                                     \
        int32_t key_ = (int32_t)(bits_ >> S##i##_SHIFT) - S##i##_BASE;                 \
        key_ = key_ < 0 ? 0 : (key_ > S##i##_K - 1 ? S##i##_K - 1 : key_);              \
        int32_t entry_ = tab##i[key_ + neg_ * S##i##_K];                               \
        int32_t low_ = (int32_t)(bits_ & ((1u << S##i##_SHIFT) - 1u));                 \
        low_ = neg_ ? (int32_t)((1u << S##i##_SHIFT) - 1u) - low_ : low_;              \
        int32_t c_ = (entry_ & 0xFF) + (low_ > (entry_ >> 8));                          \
        if (S##i##_SR) c_ = stochastic_code((y), c_, qmap##i, S##i##_N, (h));          \
        else if (!S##i##_SIGNED) c_ = (c_ == S##i##_ZERO && (y) > 0.0f) ? c_ + 1 : c_; \
        (out) = (uint8_t)c_;                                                           \
    } while (0)

#define DECLARE_STATE(i)                                                                  \
    const float *restrict qmap##i = st[i].qmap;                                           \
    const int32_t *restrict tab##i = st[i].table;                                         \
    float *restrict pf##i = (float *)st[i].codes + (S##i##_PLAIN ? r * st[i].code_stride : 0); \
    uint16_t *restrict pb##i = (uint16_t *)st[i].codes + (S##i##_PLAIN ? r * st[i].code_stride : 0);

/* Byte planes of a 256-entry float table: plane k holds byte k of every entry (for decode8). */
typedef struct {
    uint8_t b[4][256];
} planes_t;

static void make_planes(const float *qmap, planes_t *out) {
    for (int c = 0; c < 256; c++)
        for (int k = 0; k < 4; k++) out->b[k][c] = (uint8_t)(f2u(qmap[c]) >> (8 * k));
}

#if HAVE_VBMI
/* vpermt2b / vpermt2w indices interleaving elements 0..31 | 32..63 of two byte vectors, and
 * 0..15 | 16..31 of two word vectors */
static const uint8_t IL_B[2][64] __attribute__((aligned(64))) = {
    {0, 64, 1, 65, 2, 66, 3, 67, 4, 68, 5, 69, 6, 70, 7, 71,
     8, 72, 9, 73, 10, 74, 11, 75, 12, 76, 13, 77, 14, 78, 15, 79,
     16, 80, 17, 81, 18, 82, 19, 83, 20, 84, 21, 85, 22, 86, 23, 87,
     24, 88, 25, 89, 26, 90, 27, 91, 28, 92, 29, 93, 30, 94, 31, 95},
    {32, 96, 33, 97, 34, 98, 35, 99, 36, 100, 37, 101, 38, 102, 39, 103,
     40, 104, 41, 105, 42, 106, 43, 107, 44, 108, 45, 109, 46, 110, 47, 111,
     48, 112, 49, 113, 50, 114, 51, 115, 52, 116, 53, 117, 54, 118, 55, 119,
     56, 120, 57, 121, 58, 122, 59, 123, 60, 124, 61, 125, 62, 126, 63, 127}};
static const uint16_t IL_W[2][32] __attribute__((aligned(64))) = {
    {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
    {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
#endif

#if HAVE_VBMI
/* The 64 floats table[idx[k]] (k = 0..63) of a 256-entry float table held as byte planes t[byte][quarter]:
 * per plane two 128-entry in-register lookups (vpermi2b) and a blend on the index's top bit, then two
 * interleaves back into floats, exactly the table's bits. out[q] holds elements 16q .. 16q + 15. */
static inline void lookup_planes(const __m512i t[4][4], __m512i idx, __m512 out[4]) {
    const __mmask64 high = _mm512_movepi8_mask(idx);
    __m512i b[4];
    for (int k = 0; k < 4; k++) {
        const __m512i lo = _mm512_permutex2var_epi8(t[k][0], idx, t[k][1]);
        const __m512i hi = _mm512_permutex2var_epi8(t[k][2], idx, t[k][3]);
        b[k] = _mm512_mask_blend_epi8(high, lo, hi);
    }
    /* byte interleave of elements 0..31 / 32..63 of two planes; word interleave of two such */
    const __m512i iw0 = _mm512_load_si512(IL_W[0]), iw1 = _mm512_load_si512(IL_W[1]);
    for (int half = 0; half < 2; half++) {
        const __m512i ib = _mm512_load_si512(IL_B[half]);
        const __m512i w01 = _mm512_permutex2var_epi8(b[0], ib, b[1]);
        const __m512i w23 = _mm512_permutex2var_epi8(b[2], ib, b[3]);
        out[2 * half] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(w01, iw0, w23));
        out[2 * half + 1] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(w01, iw1, w23));
    }
}

static inline void load_planes(const planes_t *pl, __m512i t[4][4]) {
    for (int k = 0; k < 4; k++)
        for (int q = 0; q < 4; q++) t[k][q] = _mm512_loadu_si512((const void *)(pl->b[k] + 64 * q));
}
#endif

#if HAVE_AVX2
/* qmap[code] of 8 fp8 codes (float8_e4m3fn bits; qmap: their float32 values) without the table: the
 * magnitude bits as a float's exponent and mantissa bits, times 2**120 (exact: a normal code's value, and
 * m * 2**-9 for a subnormal code 0.m), with the sign bit put back; the NaN codes 0x7f and 0xff take the
 * table's own NaNs, nan[0] and nan[1]. Equal to the table on all 256 codes (a test checks). */
static inline __m256 fp8_value8(__m256i code, const __m256 nan[2]) {
    const __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7f));
    __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(code, 24)); /* bit 7 to bit 31 */
    v = _mm256_or_ps(v, _mm256_and_ps(sign, _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)0x80000000u))));
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
    return _mm256_blendv_ps(v, _mm256_blendv_ps(nan[0], nan[1], sign), is_nan);
}
#endif

/* out[j] = qmap[codes[j]] * sc for j < n: 64 codes at a time as in-register lookups (lookup_planes);
 * then for fp8 codes (fp8: S<i>_FP8) 8 at a time with AVX2 (fp8_value8); the rest (8-bit map codes on
 * machines without AVX-512 VBMI, and the tail) reads the table. */
static inline void decode8(const uint8_t *restrict codes, int64_t n, const float *restrict qmap,
                           const planes_t *restrict pl, float sc, int fp8, float *restrict out) {
    int64_t j = 0;
#if HAVE_VBMI
    const __m512 vs = _mm512_set1_ps(sc);
    __m512i t[4][4];
    load_planes(pl, t);
    for (; j + 64 <= n; j += 64) {
        __m512 f[4];
        lookup_planes(t, _mm512_loadu_si512((const void *)(codes + j)), f);
        for (int q = 0; q < 4; q++) _mm512_storeu_ps(out + j + 16 * q, _mm512_mul_ps(f[q], vs));
    }
#else
    (void)pl;
#endif
#if HAVE_AVX2
    if (fp8) {
        const __m256 vs8 = _mm256_set1_ps(sc), nan[2] = {_mm256_set1_ps(qmap[0x7f]), _mm256_set1_ps(qmap[0xff])};
        for (; j + 8 <= n; j += 8) {
            const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j)));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(fp8_value8(code, nan), vs8));
        }
    }
#else
    (void)fp8;
#endif
    for (; j < n; j++) out[j] = qmap[codes[j]] * sc;
}

/* The in-register encode of 8-bit map states (round to nearest), for machines with AVX-512 VBMI.
 * Its tables (qstate/optim/_engine/cpu/kernel.py, _binade_tables) split |y| by sign and binade (exponent
 * ENC8_E_LOW + j, j = 0..31 after clamping: below is one bucket, NaN falls in 1.0's) into buckets of the top
 * mantissa bits, as few per binade as keep every bucket within two adjacent codes; a bucket's lower
 * code c then gives the code c + (y > t_c), exactly the packed table's (Codec.encode). Per 64
 * values: the bucket index in 16-bit lanes from bits 30..15 of y (exponent | top 8 mantissa bits)
 * and a 64-entry in-register table of words (vpermt2w), the lower code from 512 in-register bytes,
 * t_c from byte planes (lookup_planes): no gathers. */
typedef struct {
    planes_t threshold; /* t_c as byte planes (unsigned states: t_zero is +0, kernel._encode_thresholds) */
    uint8_t bucket[512];
    uint16_t binade[64];
} enc8_t;

static void make_enc8(const qstate_t *s, enc8_t *out) {
    make_planes(s->threshold, &out->threshold);
    memcpy(out->bucket, s->bucket, sizeof out->bucket);
    memcpy(out->binade, s->binade, sizeof out->binade);
}

#if HAVE_VBMI
/* word k of the 32 words: the low word of dword k of a (k < 16) or of b */
static const uint16_t LOW_WORDS[32] __attribute__((aligned(64))) = {
    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
    32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
/* byte k of the 64 bytes: the low byte of word k of a (k < 32) or of b */
static const uint8_t LOW_BYTES[64] __attribute__((aligned(64))) = {
    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50,
    52, 54, 56, 58, 60, 62, 64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 92, 94, 96, 98, 100,
    102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};

/* encode8_64, the in-register encode of 64 values, in two stages: encode8_bucket gives y = x[0..63] / div
 * and each value's bucket's lower code c, encode8_finish writes c + (y > t_c). A row segment's encode
 * runs them pipelined: the bucket stage of chunk k + 1, then the finish of chunk k (ENCODE8_VECTOR), so
 * that each stage's long dependency chain overlaps the other's (0.8-0.88x the encode's time in one
 * thread, the same codes). */
typedef struct {
    __m512 y[4];
    __m512i code;
} enc8_part_t;

static inline enc8_part_t encode8_bucket(const float *restrict x, float div, const enc8_t *restrict E) {
    enc8_part_t part;
    __m512 *y = part.y;
    const __m512 vdiv = _mm512_set1_ps(div), vzero = _mm512_setzero_ps();
    const __m512i low_words = _mm512_load_si512(LOW_WORDS), low_bytes = _mm512_load_si512(LOW_BYTES);
    const __m512i b0 = _mm512_loadu_si512((const void *)(E->binade)), b1 = _mm512_loadu_si512((const void *)(E->binade + 32));
    const __m512i e_low = _mm512_set1_epi16(ENC8_E_LOW), j_max = _mm512_set1_epi16(31), neg_bit = _mm512_set1_epi16(32);
    const __m512i low8 = _mm512_set1_epi16(0xff), low9 = _mm512_set1_epi16(0x1ff), bit8 = _mm512_set1_epi16(256);
    __m512i idx[2];
    __mmask32 upper[2];
    __mmask16 neg[4];
    for (int q = 0; q < 4; q++) {
        y[q] = nonzero_quotient_512(_mm512_loadu_ps(x + 16 * q), vdiv);
        neg[q] = _mm512_cmp_ps_mask(y[q], vzero, _CMP_LT_OQ);
    }
    for (int h = 0; h < 2; h++) {
        /* w: bits 30..15 of y (exponent | top 8 mantissa bits), 32 values as words */
        const __m512i w = _mm512_permutex2var_epi16(_mm512_srli_epi32(_mm512_castps_si512(y[2 * h]), 15), low_words,
                                                    _mm512_srli_epi32(_mm512_castps_si512(y[2 * h + 1]), 15));
        __m512i j = _mm512_min_epu16(_mm512_subs_epu16(_mm512_srli_epi16(w, 8), e_low), j_max);
        j = _mm512_mask_add_epi16(j, _mm512_kunpackw(neg[2 * h + 1], neg[2 * h]), j, neg_bit);
        const __m512i pr = _mm512_permutex2var_epi16(b0, j, b1);
        idx[h] = _mm512_add_epi16(_mm512_and_si512(pr, low9),
                                  _mm512_srlv_epi16(_mm512_and_si512(w, low8), _mm512_srli_epi16(pr, 9)));
        upper[h] = _mm512_test_epi16_mask(idx[h], bit8);
    }
    const __m512i idx8 = _mm512_permutex2var_epi8(idx[0], low_bytes, idx[1]);
    /* lower code of each bucket: 512 bytes as four 128-entry lookups */
    const __mmask64 top7 = _mm512_movepi8_mask(idx8);
    __m512i c[8];
    for (int k = 0; k < 8; k++) c[k] = _mm512_loadu_si512((const void *)(E->bucket + 64 * k));
    const __m512i first = _mm512_mask_blend_epi8(top7, _mm512_permutex2var_epi8(c[0], idx8, c[1]),
                                                 _mm512_permutex2var_epi8(c[2], idx8, c[3]));
    const __m512i second = _mm512_mask_blend_epi8(top7, _mm512_permutex2var_epi8(c[4], idx8, c[5]),
                                                  _mm512_permutex2var_epi8(c[6], idx8, c[7]));
    part.code = _mm512_mask_blend_epi8(_mm512_kunpackd(upper[1], upper[0]), first, second);
    return part;
}

/* codes of the values of ``part`` into out[0..63] (unsigned: a positive value never takes the zero code, by
 * the thresholds: t_zero = +0) */
static inline void encode8_finish(const enc8_part_t *part, const __m512i t[4][4], uint8_t *restrict out) {
    __m512i code = part->code;
    __m512 th[4];
    lookup_planes(t, code, th);
    __mmask16 gt[4];
    for (int q = 0; q < 4; q++) gt[q] = _mm512_cmp_ps_mask(part->y[q], th[q], _CMP_GT_OQ);
    const __mmask64 up = _mm512_kunpackd(_mm512_kunpackw(gt[3], gt[2]), _mm512_kunpackw(gt[1], gt[0]));
    const __m512i one = _mm512_set1_epi8(1);
    code = _mm512_mask_add_epi8(code, up, code, one);
    _mm512_storeu_si512((void *)out, code);
}
#endif

#if HAVE_VBMI
/* fp8_code of 16 values at once, as bytes: the same integer and float steps in 32-bit lanes (the
 * subnormal sum is the same float addition); bounded: the values of an fp8_bounded block, which need
 * neither the saturation nor the NaN step */
static inline __m512i fp8_code16_lanes(__m512 y, int is_signed, int bounded) {
    const __m512i bits = _mm512_castps_si512(y), abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i mag = _mm512_and_si512(bits, abs_mask), denorm_mask = _mm512_set1_epi32(141 << 23);
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_castsi512_ps(denorm_mask))), denorm_mask);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32((int32_t)(((uint32_t)(7 - 127) << 23) + 0x7ffffu))), odd),
        20);
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(121 << 23)), normal, sub);
    if (!bounded) {
        code = _mm512_min_epu32(code, _mm512_set1_epi32(0x7e));
        code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000)),
                                     _mm512_set1_epi32(0x7f));
    }
    /* code | (bits >> 24 & 0x80): the sign bit */
    code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xf8);
    if (!is_signed) {
        const __m512 zero = _mm512_setzero_ps();
        const __mmask16 low_zero = _mm512_testn_epi32_mask(code, _mm512_set1_epi32(0xff));
        code = _mm512_mask_mov_epi32(code, low_zero & _mm512_cmp_ps_mask(y, zero, _CMP_GT_OQ), _mm512_set1_epi32(1));
        code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, zero, _CMP_LT_OQ), _mm512_setzero_si512());
    }
    return code;
}
static inline __m128i fp8_code16(__m512 y, int is_signed, int bounded) {
    return _mm512_cvtepi32_epi8(fp8_code16_lanes(y, is_signed, bounded));
}

/* The codes (32-bit lanes) of 16 values y of a 16-entry map state, as ENCODE gives them for y that are
 * not NaN (the packed table's NaN codes depend on the payload: callers take the scalar path for those).
 * s: the values the search counts below y, in four halvings (lane 15 unused; map4_search16's): rounded to
 * nearest (sr = 0) the code thresholds t_0..t_14 (kernel._encode_thresholds: an unsigned state's
 * t_zero = +0 keeps positive values off the zero code as ENCODE's bump does), whose count is the nearest
 * code; with stochastic rounding the map's entries q_1..q_15, whose count c (capped at 14) has
 * q_c < y <= q_c+1, then stochastic_code's steps (qmap: the map's 16 values), as map4_code8 explains, with
 * the draws of the flat indices base .. base + 15 under the state's key (sr_draw_512). */
#define CARRY_512(a, b) _mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask((a), (b)), _mm512_set1_epi32(-1))
DEFINE_SR_DRAW(512, CARRY_512)

/* stochastic_code's decision on 16 values: the lanes of y (between its codes' values lo and hi) that round up to
 * hi, with the draws of the flat indices base .. base + 15 under the state's key */
static inline __mmask16 sr_rounds_up_512(__m512 y, __m512 lo, __m512 hi, uint64_t key, uint64_t base) {
    const __m512i one = _mm512_set1_epi32(1);
    const __m512 draw = sr_draw_512(key, base, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i r = float_rank_512(y), r_lo = float_rank_512(lo), r_hi = float_rank_512(hi);
    return _mm512_cmpge_epi32_mask(r, _mm512_sub_epi32(r_hi, one)) |
           (_mm512_cmpgt_epi32_mask(r, _mm512_add_epi32(r_lo, one)) &
            _mm512_cmp_ps_mask(_mm512_mul_ps(draw, _mm512_sub_ps(hi, lo)),
                               _mm512_mul_ps(_mm512_sub_ps(y, lo), _mm512_set1_ps(16777216.0f)), _CMP_LT_OQ));
}

static inline __m512 map4_search16(const float *restrict thr, const float *restrict qmap, int sr) {
    if (!sr) return _mm512_loadu_ps(thr);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 15),
                                 _mm512_loadu_ps(qmap));
}

static inline __m512i map4_code16(__m512 y, __m512 s, __m512 qmap, int sr, uint64_t key, uint64_t base) {
    __m512i c = _mm512_setzero_si512();
    for (int step = 8; step >= 1; step /= 2) {
        const __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(c, _mm512_set1_epi32(step - 1)), s);
        c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(y, t, _CMP_GT_OQ), c, _mm512_set1_epi32(step));
    }
    if (!sr) return c;
    const __m512i one = _mm512_set1_epi32(1);
    c = _mm512_min_epi32(c, _mm512_set1_epi32(14));
    const __m512 lo = _mm512_permutexvar_ps(c, qmap), hi = _mm512_permutexvar_ps(_mm512_add_epi32(c, one), qmap);
    return _mm512_mask_add_epi32(c, sr_rounds_up_512(y, lo, hi, key, base), c, one);
}

/* the values of codes 0x00..0x7e in 32-bit lanes (fp8_non_negative_value8's steps) */
static inline __m512 fp8_non_negative_value16(__m512i code) {
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(code, 20)), _mm512_set1_ps(0x1p120f));
}

/* fp8_sr_code8 on 16 values, as bytes: the same steps with masks, the draws of the flat indices base .. base + 15
 * under the state's key (sr_draw_512) */
static inline __m128i fp8_sr_code16(__m512 y, uint64_t key, uint64_t base) {
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i nearest = fp8_code16_lanes(y, 0, 0);
    const __mmask16 positive = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ);
    __m512i c = _mm512_mask_mov_epi32(one, positive, nearest);
    c = _mm512_mask_sub_epi32(c, _mm512_cmp_ps_mask(fp8_non_negative_value16(c), y, _CMP_GT_OQ), c, one);
    c = _mm512_min_epi32(_mm512_max_epi32(c, _mm512_setzero_si512()), _mm512_set1_epi32(FP8_NON_NEGATIVE_CODES - 2));
    const __m512 lo = fp8_non_negative_value16(c), hi = fp8_non_negative_value16(_mm512_add_epi32(c, one));
    c = _mm512_max_epi32(_mm512_mask_add_epi32(c, sr_rounds_up_512(y, lo, hi, key, base), c, one), one);
    return _mm512_cvtepi32_epi8(_mm512_mask_mov_epi32(nearest, positive, c));
}
#endif

#if HAVE_AVX2
/* The 16-entry table t (t[0..7] | t[8..15]) at 8 indices 0..15: two vpermps and a blend on bit 3 */
static inline __m256 lookup16(__m256 t_low, __m256 t_high, __m256i idx) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t_low, idx), _mm256_permutevar8x32_ps(t_high, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* The code thresholds t_0..t_14 of a 16-entry map as map4_code8's search reads them: the candidates of each
 * halving in one register (t_7; t_3 and t_11; t_1, t_5, t_9, t_13 by c / 4; t_0, t_2, .. t_14 by c / 2) */
typedef struct {
    __m256 t7, t3, t11, quarter, even;
} search4_t;

static inline search4_t make_search4(const float *restrict thr) {
    return (search4_t){_mm256_set1_ps(thr[7]), _mm256_set1_ps(thr[3]), _mm256_set1_ps(thr[11]),
                       _mm256_setr_ps(thr[1], thr[5], thr[9], thr[13], thr[1], thr[5], thr[9], thr[13]),
                       _mm256_setr_ps(thr[0], thr[2], thr[4], thr[6], thr[8], thr[10], thr[12], thr[14])};
}

/* map4_code8's search for a state rounded to nearest (sr = 0): the code thresholds t_0..t_14; with stochastic
 * rounding: the map's entries q_1..q_15 */
static inline search4_t map4_search8(const float *restrict thr, const float *restrict qmap, int sr) {
    return make_search4(sr ? qmap + 1 : thr);
}

DEFINE_SR_DRAW(256, _mm256_cmpgt_epi32)

/* sr_rounds_up_512 on 8 values: all ones in the lanes that round up to hi */
static inline __m256 sr_rounds_up_256(__m256 y, __m256 lo, __m256 hi, uint64_t key, uint64_t base) {
    const __m256 draw = sr_draw_256(key, base, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i r = float_rank_256(y), r_lo = float_rank_256(lo), r_hi = float_rank_256(hi);
    return _mm256_or_ps(
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(r, _mm256_sub_epi32(r_hi, _mm256_set1_epi32(2)))),
        _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(r, _mm256_add_epi32(r_lo, _mm256_set1_epi32(1)))),
                      _mm256_cmp_ps(_mm256_mul_ps(draw, _mm256_sub_ps(hi, lo)),
                                    _mm256_mul_ps(_mm256_sub_ps(y, lo), _mm256_set1_ps(16777216.0f)), _CMP_LT_OQ)));
}

/* map4_code16 on 8 values: the same four halvings (c + step - 1 is the entry of s compared), each reading its
 * candidates from one register (s: map4_search8's); qmap: the map's values as halves (q[0..7], q[8..15]). With
 * stochastic rounding (sr) the search counts the entries q_1..q_15 below y, so q_c < y <= q_c+1 once c is capped
 * at 14 (the map holds y: q_0 = -1, q_15 = 1), and stochastic_code's steps follow, with the draws of the flat
 * indices base .. base + 7 under the state's key (sr_draw_256). Its own start (the nearest
 * code, one down if that entry is above y) is the same pair of a strictly increasing map, but for y equal to an
 * entry q_c: the pair from q_c, where this one is the pair below; both give c (r(y) >= r(hi) - 1 holds, or r(y) <= r(lo) + 1). */
static inline __m256i map4_code8(__m256 y, const search4_t *restrict s, const __m256 qmap[2], int sr, uint64_t key,
                                 uint64_t base) {
#define STEP4(t, step) \
    _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(y, (t), _CMP_GT_OQ)), _mm256_set1_epi32(step))
    __m256i c = STEP4(s->t7, 8);
    c = _mm256_add_epi32(c, STEP4(_mm256_blendv_ps(s->t3, s->t11, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28))), 4));
    c = _mm256_add_epi32(c, STEP4(_mm256_permutevar8x32_ps(s->quarter, _mm256_srli_epi32(c, 2)), 2));
    c = _mm256_add_epi32(c, STEP4(_mm256_permutevar8x32_ps(s->even, _mm256_srli_epi32(c, 1)), 1));
#undef STEP4
    if (!sr) return c;
    const __m256i one = _mm256_set1_epi32(1);
    c = _mm256_min_epi32(c, _mm256_set1_epi32(14));
    const __m256 lo = lookup16(qmap[0], qmap[1], c), hi = lookup16(qmap[0], qmap[1], _mm256_add_epi32(c, one));
    const __m256 up = sr_rounds_up_256(y, lo, hi, key, base);
    return _mm256_sub_epi32(c, _mm256_castps_si256(up));
}

/* fp8_code of 8 values, in 32-bit lanes (fp8_code16's steps, bounded as there; mag < 2**31, so signed
 * compares order it) */
static inline __m256i fp8_code8(__m256 y, int is_signed, int bounded) {
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i denorm_mask = _mm256_set1_epi32(141 << 23);
    const __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(denorm_mask))), denorm_mask);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_set1_epi32((int32_t)(((uint32_t)(7 - 127) << 23) + 0x7ffffu));
    const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, bias), odd), 20);
    __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), mag));
    if (!bounded) {
        code = _mm256_min_epi32(code, _mm256_set1_epi32(0x7e));
        code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000)));
    }
    code = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80)));
    if (!is_signed) {
        const __m256 zero = _mm256_setzero_ps();
        const __m256i low_zero = _mm256_cmpeq_epi32(code, _mm256_setzero_si256());
        const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(y, zero, _CMP_GT_OQ));
        code = _mm256_sub_epi32(code, _mm256_and_si256(low_zero, positive));
        code = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(y, zero, _CMP_LT_OQ)), code);
    }
    return code;
}

/* fp8_value8's values of codes 0x00..0x7e (no sign, no NaN): the code's bits as a float's exponent and mantissa,
 * rebiased (exact, subnormal codes included) */
static inline __m256 fp8_non_negative_value8(__m256i code) {
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(code, 20)), _mm256_set1_ps(0x1p120f));
}

/* ENCODE of 8 values of an unsigned fp8 state rounded stochastically (fp8_code, then for y > 0 stochastic_code on
 * the codes 0x00..0x7e, whose values fp8_non_negative_value8 gives, and never 0), with the draws of the flat
 * indices base .. base + 7 under the state's key (sr_draw_256) */
static inline __m256i fp8_sr_code8(__m256 y, uint64_t key, uint64_t base) {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i nearest = fp8_code8(y, 0, 0);
    const __m256 positive = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ);
    /* a positive y's nearest code is in [1, 126]; the other lanes keep theirs */
    __m256i c = _mm256_blendv_epi8(one, nearest, _mm256_castps_si256(positive));
    c = _mm256_add_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(fp8_non_negative_value8(c), y, _CMP_GT_OQ)));
    c = _mm256_min_epi32(_mm256_max_epi32(c, _mm256_setzero_si256()), _mm256_set1_epi32(FP8_NON_NEGATIVE_CODES - 2));
    const __m256 lo = fp8_non_negative_value8(c), hi = fp8_non_negative_value8(_mm256_add_epi32(c, one));
    const __m256 up = sr_rounds_up_256(y, lo, hi, key, base);
    c = _mm256_max_epi32(_mm256_sub_epi32(c, _mm256_castps_si256(up)), one);
    return _mm256_blendv_epi8(nearest, c, _mm256_castps_si256(positive));
}

/* tab[idx[k]] for the 8 lanes k (each index >= 0): scalar loads at the lanes' indices, extracted two at a time
 * as 64-bit words (on Zen 3, for the 8-bit encode's packed table, one at a time took 0.96x the kernel's time of
 * an AVX2 gather, and two at a time takes 0.90-0.95x that) */
static inline __m256i lookup8(const int32_t *restrict tab, __m256i idx) {
    const __m128i a = _mm256_castsi256_si128(idx), b = _mm256_extracti128_si256(idx, 1);
    const uint64_t a0 = (uint64_t)_mm_cvtsi128_si64(a), a1 = (uint64_t)_mm_extract_epi64(a, 1);
    const uint64_t b0 = (uint64_t)_mm_cvtsi128_si64(b), b1 = (uint64_t)_mm_extract_epi64(b, 1);
    return _mm256_setr_epi32(tab[(uint32_t)a0], tab[a0 >> 32], tab[(uint32_t)a1], tab[a1 >> 32], tab[(uint32_t)b0],
                             tab[b0 >> 32], tab[(uint32_t)b1], tab[b1 >> 32]);
}

/* ENCODE's packed-table nearest code (no stochastic rounding) of 8 values of an 8-bit map state, in 32-bit
 * lanes: ENCODE's integer steps lane by lane (key, low bits folded for negatives, the compare with the
 * entry's field, the unsigned zero step), the table read by lookup8. */
static inline __m256i table_code8(__m256 y, const int32_t *restrict tab, int shift, int32_t base, int32_t k,
                                  int is_signed, int32_t zero) {
    const __m256 z = _mm256_setzero_ps();
    const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(y, z, _CMP_LT_OQ));
    const __m256i mag = _mm256_and_si256(_mm256_castps_si256(y), _mm256_set1_epi32(0x7fffffff));
    __m256i key = _mm256_sub_epi32(_mm256_srli_epi32(mag, shift), _mm256_set1_epi32(base));
    key = _mm256_min_epi32(_mm256_max_epi32(key, _mm256_setzero_si256()), _mm256_set1_epi32(k - 1));
    key = _mm256_add_epi32(key, _mm256_and_si256(neg, _mm256_set1_epi32(k)));
    const __m256i entry = lookup8(tab, key);
    const __m256i mask = _mm256_set1_epi32((int32_t)((1u << shift) - 1u));
    /* ENCODE's mask - low for negatives: low <= mask, so the same as low ^ mask */
    const __m256i low = _mm256_xor_si256(_mm256_and_si256(mag, mask), _mm256_and_si256(neg, mask));
    __m256i c = _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xff)),
                                 _mm256_cmpgt_epi32(low, _mm256_srai_epi32(entry, 8)));
    if (!is_signed) {
        const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(y, z, _CMP_GT_OQ));
        c = _mm256_sub_epi32(c, _mm256_and_si256(positive, _mm256_cmpeq_epi32(c, _mm256_set1_epi32(zero))));
    }
    return c;
}

/* 32 codes (32-bit lanes, each 0..255; c[k] holds codes 8k .. 8k + 7) as 32 bytes */
static inline void store_codes32(const __m256i c[4], uint8_t *restrict out) {
    /* dword k of the packed bytes holds codes 0-3 of c[k % 4] (k < 4) or codes 4-7 of c[k % 4] */
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* 8 codes (32-bit lanes, each 0..255) as 8 bytes */
static inline void store_codes8(__m256i c, uint8_t *restrict out) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(w, w));
}

/* 8 4-bit codes (32-bit lanes) as 4 bytes: code 2k | code 2k + 1 << 4 */
static inline void store_nibbles8(__m256i c, uint8_t *restrict out) {
    const __m256i pairs = _mm256_or_si256(c, _mm256_srli_epi64(c, 28)); /* low byte of each 64-bit lane */
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
    const __m128i b = _mm_packus_epi16(w, w); /* bytes 0, 2, 4, 6 hold the pairs, 1, 3, 5, 7 zero */
    const int32_t packed = _mm_cvtsi128_si32(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, -1, -1, -1, -1, -1, -1,
                                                                                 -1, -1, -1, -1, -1, -1)));
    memcpy(out, &packed, 4);
}
#endif

/* out[j] = qmap[code j] * sc for j < n, 4-bit codes (code 2k: low nibble of byte k): 16 at a time
 * as one in-register lookup in the 16-entry map (vpermps) on AVX-512, then 8 at a time from two
 * registers (lookup16) with AVX2; the tail reads the table. */
static inline void decode4(const uint8_t *restrict bytes, int64_t n, const float *restrict qmap, float sc,
                           float *restrict out) {
    int64_t j = 0;
#if HAVE_VBMI
    const __m512 table = _mm512_loadu_ps(qmap), vs = _mm512_set1_ps(sc);
    const __m128i low4 = _mm_set1_epi8(15);
    for (; j + 16 <= n; j += 16) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(bytes + j / 2));
        const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), vs));
    }
#endif
#if HAVE_AVX2
    {
        const __m256 t_low = _mm256_loadu_ps(qmap), t_high = _mm256_loadu_ps(qmap + 8), vs = _mm256_set1_ps(sc);
        const __m128i low4 = _mm_set1_epi8(15);
        for (; j + 8 <= n; j += 8) {
            int32_t four;
            memcpy(&four, bytes + j / 2, 4);
            const __m128i b = _mm_cvtsi32_si128(four);
            const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(lookup16(t_low, t_high, idx), vs));
        }
    }
#endif
    for (; j < n; j++) {
        const uint8_t byte = bytes[j >> 1];
        out[j] = qmap[(j & 1) ? (byte >> 4) : (byte & 15)] * sc;
    }
}

/* decode n <= GROUP codes of state i at column col of row r into vals<i>[] */
#define DECODE_GROUP(i)                                                                   \
    {                                                                                     \
        const float sc = S##i##_PLAIN ? 0.0f : st[i].scale[r * st[i].scale_stride + col / S##i##_BS]; \
        const uint8_t *restrict cp = st[i].codes + r * st[i].code_stride;                 \
        if (S##i##_PLAIN) {                                                               \
        } else if (S##i##_BITS == 8) {                                                    \
            decode8(cp + col, n, qmap##i, planes + (i), sc, S##i##_FP8, vals##i);         \
        } else {                                                                          \
            decode4(cp + col / 2, n, qmap##i, sc, vals##i);                               \
        }                                                                                 \
    }

#define MAKE_PLANES(i) if (S##i##_BITS == 8) make_planes(st[i].qmap, planes + (i));
#define DECLARE_VALS(i) float vals##i[GROUP + 1];
#define LOAD_STATE(i) \
    s[i] = S##i##_PLAIN ? (S##i##_BF16 ? bf16_to_f(pb##i[col + j]) : pf##i[col + j]) : vals##i[j];
/* a plain state's new value in place; a quantized state's into the segment buffer, and |value| as bits
 * into the group's running max (integer order is float order for |x|, and a NaN is above every number,
 * so the max propagates NaN as torch.amax; ENCODE_BLOCKS then lets an infinity outrank it) */
#define STORE_STATE(i)                                                                    \
    if (S##i##_PLAIN) {                                                                   \
        if (S##i##_BF16) pb##i[col + j] = f_to_bf16(s[i]);                                \
        else pf##i[col + j] = s[i];                                                       \
    } else {                                                                              \
        newv##i[col - c0 + j] = s[i];                                                     \
        const uint32_t a_ = f2u(s[i]) & 0x7fffffffu;                                      \
        gmax##i = a_ > gmax##i ? a_ : gmax##i;                                            \
    }
#define DECLARE_NEWV(i) float newv##i[UNIT]; uint32_t gbits##i[UNIT / GROUP]; /* per group max |x| bits */
#define ZERO_GMAX(i) uint32_t gmax##i = 0;
#define SAVE_GMAX(i) gbits##i[(col - c0) / GROUP] = gmax##i;

/* whether state i encodes with encode8_64 (8-bit map, round to nearest, tables given) */
#define ENC8(i) (S##i##_ENC8)
#define MAKE_ENC8(i) if (HAVE_VBMI && ENC8(i)) make_enc8(st + (i), enc + (i));
/* whether state i's block with divisor div takes the vector 4-bit encodes (map4_code16, map4_code8): a
 * 16-entry map state, unless the block's scale is infinite or NaN: only such blocks hold NaN values
 * (|x| <= div otherwise), whose codes (the packed table's, by payload) the threshold search does not give */
#define ENC4_VECTOR_BLOCK(i, div) (S##i##_ENC4 && !NONFINITE_BLOCK(div))
#if HAVE_VBMI
#define DECLARE_ENC8(i)                                                                   \
    __m512i thr##i[4][4];                                                                 \
    enc8_part_t pend##i;             /* the chunk whose finish is pending, */             \
    uint8_t *pend_out##i = NULL;     /* and where its codes go (NULL: none) */            \
    if (ENC8(i)) load_planes(&enc[i].threshold, thr##i);
/* codes of x[j0..] / div, 64 at a time, while 64 remain (j0 moves past them): each chunk's bucket stage,
 * then the finish of the chunk before it (of this block or an earlier one); FLUSH_ENC8 finishes the last */
#define ENCODE8_VECTOR(i, x, bn, div, out, j0)                                            \
    if (ENC8(i))                                                                          \
        for (; (j0) + 64 <= (bn); (j0) += 64) {                                           \
            const enc8_part_t part_ = encode8_bucket((x) + (j0), (div), enc + (i));       \
            if (pend_out##i) encode8_finish(&pend##i, thr##i, pend_out##i);               \
            pend##i = part_;                                                              \
            pend_out##i = (out) + (j0);                                                   \
        }
#define FLUSH_ENC8(i)                                                                     \
    if (ENC8(i) && pend_out##i) encode8_finish(&pend##i, thr##i, pend_out##i);
/* 4-bit codes of x[j0..] / div, 16 at a time (8 bytes at bp + j0 / 2), while 16 remain (j0 moves past
 * them; the scalar loop takes the rest; ENC4_VECTOR_BLOCK); n0: x[0]'s flat index (the draws' place) */
#define ENCODE4_VECTOR(i, x, bn, div, bp, j0, n0)                                         \
    if (ENC4_VECTOR_BLOCK(i, div)) {                                                      \
        const __m512 vdiv_ = _mm512_set1_ps(div), q_ = _mm512_loadu_ps(qmap##i);          \
        const __m512 t_ = map4_search16(st[i].threshold, qmap##i, S##i##_SR);              \
        for (; (j0) + 16 <= (bn); (j0) += 16) {                                           \
            const __m512 y_ = nonzero_quotient_512(_mm512_loadu_ps((x) + (j0)), vdiv_);   \
            const __m512i c_ = map4_code16(y_, t_, q_, S##i##_SR, skey##i, (n0) + (uint64_t)(j0)); \
            /* code 2k | code 2k + 1 << 4 in the low byte of each 64-bit lane */         \
            _mm_storel_epi64((__m128i *)((bp) + (j0) / 2),                                \
                             _mm512_cvtepi64_epi8(_mm512_or_si512(c_, _mm512_srli_epi64(c_, 28)))); \
        }                                                                                 \
    }
/* fp8 codes of x[j0..] / div, 16 at a time, while 16 remain (j0 moves past them) */
#define ENCODE_FP8_VECTOR(i, x, bn, div, out, j0, n0)                                     \
    if (S##i##_FP8 && !S##i##_SR && fp8_bounded(div)) FP8_LOOP16(i, x, bn, div, out, j0, 1) \
    else if (S##i##_FP8 && !S##i##_SR) FP8_LOOP16(i, x, bn, div, out, j0, 0)               \
    else if (S##i##_FP8) FP8_SR_LOOP16(i, x, bn, div, out, j0, n0)
/* fp8 codes of x[j0..] / div rounded stochastically (fp8_sr_code16), 16 at a time while 16 remain (n0: x[0]'s
 * flat index) */
#define FP8_SR_LOOP16(i, x, bn, div, out, j0, n0)                                         \
    for (const __m512 vdiv_ = _mm512_set1_ps(div); (j0) + 16 <= (bn); (j0) += 16)          \
        _mm_storeu_si128((__m128i *)((out) + (j0)),                                       \
                         fp8_sr_code16(nonzero_quotient_512(_mm512_loadu_ps((x) + (j0)), vdiv_), skey##i, \
                                       (n0) + (uint64_t)(j0)));
#define FP8_LOOP16(i, x, bn, div, out, j0, bounded)                                       \
    for (const __m512 vdiv_ = _mm512_set1_ps(div); (j0) + 16 <= (bn); (j0) += 16)          \
        _mm_storeu_si128((__m128i *)((out) + (j0)),                                       \
                         fp8_code16(nonzero_quotient_512(_mm512_loadu_ps((x) + (j0)), vdiv_), S##i##_SIGNED, bounded));
#else
#define DECLARE_ENC8(i)
#define ENCODE8_VECTOR(i, x, bn, div, out, j0)
#define FLUSH_ENC8(i)
#define ENCODE4_VECTOR(i, x, bn, div, bp, j0, n0)
#define ENCODE_FP8_VECTOR(i, x, bn, div, out, j0, n0)
#endif
#if HAVE_AVX2
#define DIV8(x, j0) nonzero_quotient_256(_mm256_loadu_ps((x) + (j0)), vdiv_)
/* the code of 8 values y of 8-bit state i (fp8, or a map state rounded to nearest), in 32-bit lanes
 * (bounded: fp8_code8's, for values of an fp8_bounded block) */
#define CODE8(i, y, bounded) (S##i##_FP8 ? fp8_code8((y), S##i##_SIGNED, (bounded))                \
                                         : table_code8((y), tab##i, S##i##_SHIFT, S##i##_BASE, S##i##_K, \
                                                       S##i##_SIGNED, S##i##_ZERO))
/* 8-bit codes of x[j0..] / div, 32 at a time, then 8 at a time while 8 remain (j0 moves past them); map states
 * with stochastic rounding stay scalar, fp8 ones take FP8_SR_LOOP8 */
#define ENCODE8_AVX2(i, x, bn, div, out, j0, n0)                                          \
    if (S##i##_FP8 && !S##i##_SR && fp8_bounded(div)) ENCODE8_LOOPS8(i, x, bn, div, out, j0, 1) \
    else if (!S##i##_SR) ENCODE8_LOOPS8(i, x, bn, div, out, j0, 0)                         \
    else if (S##i##_FP8) FP8_SR_LOOP8(i, x, bn, div, out, j0, n0)
/* fp8 codes of x[j0..] / div rounded stochastically (fp8_sr_code8), 8 at a time while 8 remain (n0: x[0]'s
 * flat index) */
#define FP8_SR_LOOP8(i, x, bn, div, out, j0, n0)                                          \
    for (const __m256 vdiv_ = _mm256_set1_ps(div); (j0) + 8 <= (bn); (j0) += 8)           \
        store_codes8(fp8_sr_code8(DIV8(x, j0), skey##i, (n0) + (uint64_t)(j0)), (out) + (j0));
#define ENCODE8_LOOPS8(i, x, bn, div, out, j0, bounded)                                   \
    {                                                                                     \
        const __m256 vdiv_ = _mm256_set1_ps(div);                                         \
        for (; (j0) + 32 <= (bn); (j0) += 32) {                                           \
            __m256i c_[4];                                                                \
            for (int q_ = 0; q_ < 4; q_++) c_[q_] = CODE8(i, DIV8(x, (j0) + 8 * q_), bounded); \
            store_codes32(c_, (out) + (j0));                                              \
        }                                                                                 \
        for (; (j0) + 8 <= (bn); (j0) += 8) store_codes8(CODE8(i, DIV8(x, j0), bounded), (out) + (j0)); \
    }
/* 4-bit codes of x[j0..] / div, 8 at a time (4 bytes at bp + j0 / 2), while 8 remain (ENC4_VECTOR_BLOCK; n0:
 * x[0]'s flat index) */
#define ENCODE4_AVX2(i, x, bn, div, bp, j0, n0)                                           \
    if (ENC4_VECTOR_BLOCK(i, div)) {                                                      \
        const __m256 vdiv_ = _mm256_set1_ps(div);                                         \
        const search4_t s_ = map4_search8(st[i].threshold, qmap##i, S##i##_SR);            \
        const __m256 q_[2] = {_mm256_loadu_ps(qmap##i), _mm256_loadu_ps(qmap##i + 8)};   \
        for (; (j0) + 8 <= (bn); (j0) += 8)                                               \
            store_nibbles8(map4_code8(DIV8(x, j0), &s_, q_, S##i##_SR, skey##i, (n0) + (uint64_t)(j0)), \
                           (bp) + (j0) / 2);                                      \
    }
#else
#define ENCODE8_AVX2(i, x, bn, div, out, j0, n0)
#define ENCODE4_AVX2(i, x, bn, div, bp, j0, n0)
#endif

/* the draw of state i's element at flat index n (uint64_t; skey##i: the state's key) */
#define SR_HASH(i, n) position_hash64(skey##i, (uint64_t)(n))
/* state i's draw key (STATE_KEY) under the parameter's key */
#define DECLARE_SKEY(i) const uint64_t skey##i = STATE_KEY(key, i); (void)skey##i;
/* state i's new scales and codes in [c0, c0 + len) of row r */
#define ENCODE_STATE(i) ENCODE_BLOCKS(i) FLUSH_ENC8(i)
/* absmax of each block of state i in [c0, c0 + len) of row r (from the group maxima); new scales; codes */
#define ENCODE_BLOCKS(i)                                                                  \
    for (int64_t b0 = c0; !S##i##_PLAIN && b0 < c0 + len; b0 += S##i##_BS) {              \
        const int64_t bn = (c0 + len - b0) < S##i##_BS ? (c0 + len - b0) : S##i##_BS;     \
        const float *restrict x = newv##i + (b0 - c0);                                    \
        const uint64_t n0 = (uint64_t)(row_start + b0); /* x[0]'s flat index */          \
        (void)n0;                                                                         \
        /* the block's absmax: the max of its groups' (GROUP divides the block size) */   \
        uint32_t abits = 0;                                                               \
        for (int64_t k = (b0 - c0) / GROUP; k < (b0 - c0 + bn + GROUP - 1) / GROUP; k++)  \
            abits = gbits##i[k] > abits ? gbits##i[k] : abits;                            \
        /* block_absmax: an infinity outranks a NaN (rare blocks: the scan costs nothing otherwise) */ \
        if (abits > 0x7f800000u)                                                          \
            for (int64_t k = 0; k < bn; k++)                                              \
                if (fabsf(x[k]) == INFINITY) abits = 0x7f800000u;                         \
        const float amax = u2f(abits);                                                    \
        const float scale = S##i##_FP8 ? FP8_SCALE(amax, S##i##_MAXCODE) : amax;           \
        st[i].scale[r * st[i].scale_stride + b0 / S##i##_BS] = scale;                     \
        const float div = scale == 0.0f ? 1.0f : scale;                                   \
        uint8_t *restrict cp = st[i].codes + r * st[i].code_stride;                       \
        if (S##i##_BITS == 8) {                                                           \
            int64_t j0 = 0;                                                               \
            if (!NONFINITE_BLOCK(div)) {                                                  \
                ENCODE8_VECTOR(i, x, bn, div, cp + b0, j0)                                \
                ENCODE_FP8_VECTOR(i, x, bn, div, cp + b0, j0, n0)                         \
                ENCODE8_AVX2(i, x, bn, div, cp + b0, j0, n0)                              \
            }                                                                             \
            /* ivdep: codes never alias the tables; unrolled: independent lookups overlap */ \
            _Pragma("GCC ivdep") _Pragma("GCC unroll 4")                                  \
            for (int64_t j = j0; j < bn; j++) {                                           \
                uint8_t c;                                                                \
                ENCODE(i, NORMALIZED(i, x[j]), c, SR_HASH(i, n0 + j));                    \
                cp[b0 + j] = c;                                                           \
            }                                                                             \
        } else {                                                                          \
            uint8_t *restrict bp = cp + b0 / 2;                                           \
            const int64_t pairs = bn / 2;                                                 \
            int64_t j0 = 0;                                                               \
            ENCODE4_VECTOR(i, x, bn, div, bp, j0, n0)                                     \
            ENCODE4_AVX2(i, x, bn, div, bp, j0, n0)                                       \
            _Pragma("GCC ivdep") _Pragma("GCC unroll 4")                                  \
            for (int64_t j = j0 / 2; j < pairs; j++) {                                    \
                uint8_t lo, hi;                                                           \
                ENCODE(i, NORMALIZED(i, x[2 * j]), lo, SR_HASH(i, n0 + 2 * j));           \
                ENCODE(i, NORMALIZED(i, x[2 * j + 1]), hi, SR_HASH(i, n0 + 2 * j + 1));   \
                bp[j] = (uint8_t)(lo | (hi << 4));                                        \
            }                                                                             \
            if (bn & 1) {                                                                 \
                uint8_t lo;                                                               \
                ENCODE(i, NORMALIZED(i, x[bn - 1]), lo, SR_HASH(i, n0 + (bn - 1)));       \
                bp[pairs] = lo;                                                           \
            }                                                                             \
        }                                                                                 \
    }

/* One row segment [c0, c0 + len) (len <= UNIT, c0 a multiple of UNIT); ``row_start``: the flat index of the
 * row's first element in the full tensor, ``key``: the parameter's stochastic-rounding key (both read only
 * with ANY_SR: the parameter's draws take the key itself, state i's STATE_KEY(key, i)). */
static void update_segment(param_t *restrict p, const grad_t *restrict g, const qstate_t *st, const float *h,
                           const planes_t *planes, const enc8_t *enc, int64_t r, int64_t c0, int64_t len,
                           int64_t row_start, uint64_t key) {
    (void)enc, (void)row_start, (void)key;
    FOR_STATES(DECLARE_STATE)
    FOR_STATES(DECLARE_NEWV)
    FOR_STATES(DECLARE_VALS)
    const rule_consts_t consts = rule_consts(h);
    for (int64_t col = c0; col < c0 + len; col += GROUP) {
        const int64_t n = (c0 + len - col) < GROUP ? (c0 + len - col) : GROUP;
        FOR_STATES(DECODE_GROUP)
        param_t *restrict pp = p + col;
        const grad_t *restrict gp = g + col;
        /* a line per 16 elements (bf16: 2 each); addresses in integers: they may lie past the arrays */
        for (int64_t k = 0; PREFETCH_AHEAD && k < n; k += 16) {
            __builtin_prefetch((const void *)((uintptr_t)(pp + k) + PREFETCH_AHEAD * sizeof *pp), 1);
            __builtin_prefetch((const void *)((uintptr_t)(gp + k) + PREFETCH_AHEAD * sizeof *gp), 0);
        }
        FOR_STATES(ZERO_GMAX)
#if PARAM_SR
        /* element j's flat index: lo0 + j, carrying into hi0 where the low word wraps */
        const uint32_t lo0 = (uint32_t)(uint64_t)(row_start + col), hi0 = (uint32_t)((uint64_t)(row_start + col) >> 32);
#endif
        for (int64_t j = 0; j < n; j++) {
            float s[NSTATES];
            FOR_STATES(LOAD_STATE)
            const float new_p = rule(load_p(pp[j]), load_g(gp[j]), s, h, &consts);
#if RULE_KEEPS_PARAM
            (void)new_p; /* p is read only: a state writer's source values */
#elif PARAM_SR
            const uint32_t lo = lo0 + (uint32_t)j;
            pp[j] = store_p_sr(new_p, param_draw(key, lo, hi0 + (lo < lo0)));
#else
            pp[j] = store_p(new_p);
#endif
            FOR_STATES(STORE_STATE)
        }
        FOR_STATES(SAVE_GMAX)
    }
    FOR_STATES(DECLARE_ENC8)
    FOR_STATES(DECLARE_SKEY)
    FOR_STATES(ENCODE_STATE)
}

/* The update of n parameters of this kind in one parallel region: parameter k (rows[k] x row_len[k]
 * elements, its states st[k * NSTATES ...]) owns work items first[k] .. first[k + 1] - 1, one per
 * (row, UNIT-segment); ``first``: the caller's scratch of n + 1 entries. Every parameter's states
 * share the kind's tables (those of st[0 .. NSTATES-1]). ``keys``: each parameter's stochastic-rounding
 * key, ``starts``: the flat index of its first element in the full tensor it is a part of (a DTensor shard's
 * first row times row_len; 0 for a whole tensor), so that an element's draw depends on its place in the full
 * tensor, not on the sharding (both read only with ANY_SR: stochastic rounding of the parameter or of a
 * state; else may be NULL). */
void qstate_update_many(int64_t n, param_t *const *p, const grad_t *const *g, const qstate_t *st, const float *h,
                        const int64_t *rows, const int64_t *row_len, int64_t *first, int nthreads,
                        const uint64_t *keys, const int64_t *starts) {
    if (n <= 0) return;
    first[0] = 0;
    for (int64_t k = 0; k < n; k++) first[k + 1] = first[k] + rows[k] * ((row_len[k] + UNIT - 1) / UNIT);
    planes_t planes[NSTATES];
    enc8_t enc[NSTATES];
    FOR_STATES(MAKE_PLANES)
    FOR_STATES(MAKE_ENC8)
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t it = 0; it < first[n]; it++) {
        int64_t lo = 0, hi = n - 1; /* the k with first[k] <= it < first[k + 1] */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= it) lo = mid;
            else hi = mid - 1;
        }
        const int64_t k = lo, segs = (row_len[k] + UNIT - 1) / UNIT, local = it - first[k];
        const int64_t r = local / segs, c0 = (local % segs) * UNIT;
        const int64_t len = (row_len[k] - c0) < UNIT ? (row_len[k] - c0) : UNIT;
        update_segment(p[k] + r * row_len[k], g[k] + r * row_len[k], st + k * NSTATES, h, planes, enc, r, c0, len,
                       ANY_SR ? starts[k] + r * row_len[k] : 0, ANY_SR ? keys[k] : 0);
    }
}

/* The whole update of one parameter: rows x row_len elements (qstate_update_many with n = 1). */
void qstate_update(param_t *p, const grad_t *g, const qstate_t *st, const float *h, int64_t rows, int64_t row_len,
                   int nthreads, uint64_t key, int64_t start) {
    int64_t first[2];
    qstate_update_many(1, &p, &g, st, h, &rows, &row_len, first, nthreads, &key, &start);
}

/* State 0's values qmap[code] * scale (its decode in the update, alone), rows x row_len into ``out``
 * (float32, contiguous), block by block: the state readers' decode (qstate/optim/_engine/cpu/state_kernels.py). */
void qstate_decode(float *out, const qstate_t *st, int64_t rows, int64_t row_len, int nthreads) {
#if S0_PLAIN
    (void)out, (void)st, (void)rows, (void)row_len, (void)nthreads;
#else
    planes_t planes[1];
    if (S0_BITS == 8) make_planes(st[0].qmap, planes);
    const int64_t blocks = (row_len + S0_BS - 1) / S0_BS;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t it = 0; it < rows * blocks; it++) {
        const int64_t r = it / blocks, col = (it % blocks) * S0_BS;
        const int64_t n = (row_len - col) < S0_BS ? (row_len - col) : S0_BS;
        const float sc = st[0].scale[r * st[0].scale_stride + col / S0_BS];
        const uint8_t *restrict cp = st[0].codes + r * st[0].code_stride;
        if (S0_BITS == 8) decode8(cp + col, n, st[0].qmap, planes, sc, S0_FP8, out + r * row_len + col);
        else decode4(cp + col / 2, n, st[0].qmap, sc, out + r * row_len + col);
    }
#endif
}

