/* specx's CPU target forward: a Llama-family decoder over weight-only int4 / int8 weights.
 *
 * The contract is the exported graph's (specx/export/decoder.py): N new tokens per sequence
 * at cache slots write_pos[b] + i, a bool mask [B, N, L] over the first L slots, logits
 * [B, N, V], the taps, keys and values written in place into specx's KVCache.
 *
 * Why it exists (docs/decisions.md#cpu-kernels): the borrowed kernels stream the weights again
 * for every row or two of a verify, so N tokens cost several times one. Here every weight tile
 * is loaded once per forward and used for every row (up to ROWS at a time), with int8 dot
 * products (AVX-512 VNNI, or AVX2), so a forward of up to ~16 tokens costs about what one does.
 *
 * Rows are independent by construction: a row's every value is computed by the same
 * operations in the same order whatever the other rows are, how many there are and how many
 * threads run (a column, a row's norm, a query's attention are each one thread's, in a fixed
 * order). So a token's logits are bit-identical alone (a decode step) and among a verify's
 * rows, and a tree node's equal the same token's in a chain: greedy speculation is exact with
 * no pad rows and no spine rule. Attention sums over slots in slot order, and skips unseen
 * slots, so where a token's ancestors sit does not change its sums.
 *
 * Weights: per tile of TILE output columns and block of QBLOCK inputs, the codes (int4: two a
 * byte, register r's 4 codes of column j at byte 4j of nibble-plane r; int8: u8 = q + 128)
 * then TILE fp16 scales, then (int4 with zero points) TILE zero-point bytes. value = (code -
 * zero) * scale, zero = the column's zero point, else 8 (int4) or 128 (int8).
 * Activations are quantized to int8 per block of QBLOCK (scale = max|x| / 127), as ONNX
 * Runtime's int4 builds do at accuracy level 4.
 *
 * One source, compiled once per instruction set (setup.py): SPX_VNNI selects AVX-512 VNNI,
 * otherwise AVX2 + FMA. The loader (kernels.py) picks the one the CPU runs.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define TILE 16   /* output columns a tile */
#define QBLOCK 32 /* inputs a register pass covers; a block is 1 to 8 of them */
#define ROWS 16   /* rows one pass over a tile's weights serves */
#define MAX_GROUP 5 /* rows a register pass takes: 5 as one group (a chain of 4's verify),
                     * more in groups of 4 (a group of 6 spilled registers: slower) */
#define MAX_TILES 4 /* tiles a register pass takes: more streams from memory in flight, and
                     * each activation read serves 4 tiles (4 x 5 dots fit the registers
                     * with the float sums kept in L1) */
#define LANES 16  /* partial sums of a dot product, reduced in a fixed order */
#define SLOT_CHUNK 64 /* cache slots attention keeps in L1 for all of a forward's queries */

typedef struct {
    const uint8_t *weight; /* [tiles][blocks][tile bytes] */
    const float *bias;     /* [n] or NULL */
    int32_t bits, k, n;    /* n: real columns (the last tile may be padded) */
    int32_t block;         /* inputs sharing a scale, weights' and activations' alike */
    int32_t zero_points;   /* 1: int4 blocks carry a zero point per column (asymmetric) */
} spx_linear;

typedef struct {
    const float *input_norm, *post_norm; /* [d] */
    spx_linear qkv, o, gate_up, down;    /* qkv: q | k | v columns; gate_up: gate | up */
} spx_layer;

typedef struct {
    int32_t hidden, layers, heads, kv_heads, head_dim, inter, vocab;
    int32_t rotary_half; /* inv_freq's length: the first 2 * rotary_half dims turn */
    float eps, attn_scale, rope_scaling, embed_scale;
    const float *embed;     /* [vocab, hidden] */
    const float *inv_freq;  /* [rotary_half] */
    const float *final_norm;
    spx_linear lm_head;
    const spx_layer *layer;
    int32_t tap_kind; /* 0 none, 1 the last hidden state after the final norm, 2 layer inputs,
                       * 3 the last hidden state before the final norm (a head's `hidden`) */
    int32_t n_taps;
    int32_t tap_layers[8]; /* states entering these layers; == layers: the last one's output */
    int32_t threads;
    /* An EAGLE-3 head (one layer) where set: the residual starts from `features` [rows, d],
     * not the embedding, and its layer's q/k/v read [input_norm(embed) | hidden_norm(features)]
     * (2d inputs). NULL: a target. */
    const float *hidden_norm;
} spx_model;

/* A tile's bytes per block: the codes, then TILE fp16 scales (and TILE zero points). */
static inline size_t tile_bytes(int bits, int block, int zero_points) {
    return (size_t)TILE * block * bits / 8 + TILE * 2 + (zero_points ? TILE : 0);
}

/* The codes' bytes of a tile's block: its scales follow, then its zero points. */
static inline size_t code_bytes(int bits, int block) { return (size_t)TILE * block * bits / 8; }

/* fmaxf's NaN rules keep it a libm call; the inputs here are finite. */
static inline float larger(float a, float b) { return a > b ? a : b; }

/* ---- activations: int8 per block ---------------------------------------------------- */

typedef struct {
    int8_t *q;     /* [rows][k] */
    float *scale;  /* [rows][k / block] */
    int32_t *sum;  /* [rows][k / block]: the block's sum of codes (times a zero point: the
                    * term the integer dot takes off) */
    int k, block;
} spx_acts;

static void quantize_row(const float *x, int k, int block, int8_t *q, float *scale, int32_t *sums) {
    for (int b = 0; b < k / block; b++) {
        const float *xb = x + b * block;
        float amax = 0.0f;
        for (int i = 0; i < block; i++) amax = larger(amax, fabsf(xb[i]));
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < block; i++) {
            const int32_t c = (int32_t)nearbyintf(xb[i] * inv);
            q[b * block + i] = (int8_t)c;
            sum += c;
        }
        scale[b] = d;
        sums[b] = sum;
    }
}

/* ---- the weight-only GEMM: out[m][n] = sum_k x[m][k] w[n][k] (+ bias) --------------- */

#ifdef SPX_VNNI
/* acc += w (u8) . x's 4 bytes broadcast (s8), the broadcast folded into the instruction's
 * memory operand ({1to16}): a separate vpbroadcastd per row took a vector pipe beside the
 * dots, and with it 5 rows of pyref-1b cost 28.5 ms, without 24.8 (docs/decisions.md). */
static inline __m512i dot_broadcast(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

/* R rows x C tiles (constants where it is called) over every block: R x C integer dots a
 * block, independent chains for the pipelines; the float sums stay in `acc` (L1), updated
 * once a block, so the registers hold 4 tiles' dots for up to 5 rows. Register p of a pass
 * holds inputs 4p..4p+3 of a tile's 16 columns (pack_codes). */
static inline __attribute__((always_inline)) void tile_group(const uint8_t *w, size_t stride,
                                                             const int C, int b0, int b1,
                                                             int bits, int zero_points,
                                                             const spx_acts *a, int row0,
                                                             const int R,
                                                             float (*acc)[MAX_TILES * TILE]) {
    const int block = a->block, nb = a->k / block, passes = block / QBLOCK;
    const size_t step = tile_bytes(bits, block, zero_points), codes = code_bytes(bits, block);
    const int zero = bits == 4 ? 8 : 128;
    const size_t pass_bytes = (size_t)TILE * QBLOCK * bits / 8;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int8_t *x[MAX_GROUP];
    for (int m = 0; m < R; m++) x[m] = a->q + (size_t)(row0 + m) * a->k;
    w += b0 * step;
    for (int b = b0; b < b1; b++, w += step) {
        __m512i dot[MAX_GROUP][MAX_TILES]; /* from -zero x sum of codes: then sum (w - zero) x */
        if (zero_points) {
            for (int c = 0; c < C; c++) {
                const __m512i zeros = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(w + c * stride + codes + TILE * 2)));
                for (int m = 0; m < R; m++)
                    dot[m][c] = _mm512_mullo_epi32(zeros, _mm512_set1_epi32(-a->sum[(row0 + m) * nb + b]));
            }
        } else {
            for (int m = 0; m < R; m++)
                for (int c = 0; c < C; c++)
                    dot[m][c] = _mm512_set1_epi32(-zero * a->sum[(row0 + m) * nb + b]);
        }
        for (int pass = 0; pass < passes; pass++) {
            const int at = b * block + pass * QBLOCK;
            for (int p = 0; p < 8; p += 2) {
                __m512i lo[MAX_TILES], hi[MAX_TILES];
                for (int c = 0; c < C; c++) {
                    const uint8_t *source = w + c * stride + pass * pass_bytes;
                    if (bits == 4) {
                        const __m512i packed = _mm512_loadu_si512(source + 32 * p);
                        lo[c] = _mm512_and_si512(packed, low);
                        hi[c] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                    } else {
                        lo[c] = _mm512_loadu_si512(source + 64 * p);
                        hi[c] = _mm512_loadu_si512(source + 64 * p + 64);
                    }
                }
                for (int m = 0; m < R; m++) {
                    const int8_t *xm = x[m] + at;
                    for (int c = 0; c < C; c++) {
                        dot[m][c] = dot_broadcast(dot[m][c], lo[c], xm + 4 * p);
                        dot[m][c] = dot_broadcast(dot[m][c], hi[c], xm + 4 * p + 4);
                    }
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const __m512 ws =
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + c * stride + codes)));
            for (int m = 0; m < R; m++) {
                const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(a->scale[(row0 + m) * nb + b]));
                float *sum = acc[m] + TILE * c;
                _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][c]), s,
                                                      _mm512_loadu_ps(sum)));
            }
        }
    }
}
#else
/* The same sums on AVX2, a half tile (8 columns) at a time for want of registers: u8 x s8
 * pairs, which cannot overflow at these ranges (int4 codes <= 15; int8 codes as |q| with the
 * sign moved to the activation). */
static inline __m256i dot4(__m256i dot, __m256i w, __m256i x, int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i pairs = bits == 4 ? _mm256_maddubs_epi16(w, x)
                                    : _mm256_maddubs_epi16(_mm256_abs_epi8(w),
                                                           _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
}

static inline void unpack(const uint8_t *w, int bits, int half, __m256i r[8]) {
    const __m256i low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    if (bits == 4) {
        for (int p = 0; p < 4; p++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 64 * p + 32 * half));
            r[2 * p] = _mm256_and_si256(packed, low);
            r[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
    } else { /* u8 = q + 128 back to s8 q */
        for (int p = 0; p < 8; p++)
            r[p] = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(w + 64 * p + 32 * half)), flip);
    }
}

static inline __attribute__((always_inline)) void tile_one(const uint8_t *w0, int b0, int b1,
                                                           int bits, int zero_points,
                                                           const spx_acts *a, int row0,
                                                           const int R,
                                                           float (*acc)[MAX_TILES * TILE],
                                                           int column) {
    const int block = a->block, nb = a->k / block, passes = block / QBLOCK;
    const size_t step = tile_bytes(bits, block, zero_points), codes = code_bytes(bits, block);
    const size_t pass_bytes = (size_t)TILE * QBLOCK * bits / 8;
    for (int half = 0; half < 2; half++) {
        const uint8_t *w = w0 + b0 * step;
        __m256 sum[MAX_GROUP];
        for (int m = 0; m < R; m++) sum[m] = _mm256_loadu_ps(acc[m] + column + 8 * half);
        for (int b = b0; b < b1; b++, w += step) {
            __m256i dots[MAX_GROUP];
            if (zero_points) {
                const __m256i zeros = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(w + codes + TILE * 2 + 8 * half)));
                for (int m = 0; m < R; m++)
                    dots[m] = _mm256_mullo_epi32(zeros, _mm256_set1_epi32(-a->sum[(row0 + m) * nb + b]));
            } else { /* int8 computes sum q x directly: no zero term */
                for (int m = 0; m < R; m++)
                    dots[m] = _mm256_set1_epi32(bits == 4 ? -8 * a->sum[(row0 + m) * nb + b] : 0);
            }
            for (int pass = 0; pass < passes; pass++) {
                __m256i r[8];
                unpack(w + pass * pass_bytes, bits, half, r);
                for (int m = 0; m < R; m++) {
                    const int8_t *x =
                        a->q + (size_t)(row0 + m) * a->k + b * block + pass * QBLOCK;
                    __m256i even = dots[m], odd = _mm256_setzero_si256();
                    for (int p = 0; p < 8; p += 2) {
                        int32_t four[2];
                        memcpy(four, x + 4 * p, 8);
                        even = dot4(even, r[p], _mm256_set1_epi32(four[0]), bits);
                        odd = dot4(odd, r[p + 1], _mm256_set1_epi32(four[1]), bits);
                    }
                    dots[m] = _mm256_add_epi32(even, odd);
                }
            }
            const __m256 ws =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + codes + 16 * half)));
            for (int m = 0; m < R; m++) {
                const __m256 s = _mm256_mul_ps(ws, _mm256_set1_ps(a->scale[(row0 + m) * nb + b]));
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]), s, sum[m]);
            }
        }
        for (int m = 0; m < R; m++) _mm256_storeu_ps(acc[m] + column + 8 * half, sum[m]);
    }
}

static inline __attribute__((always_inline)) void tile_group(const uint8_t *w, size_t stride,
                                                             const int C, int b0, int b1,
                                                             int bits, int zero_points,
                                                             const spx_acts *a, int row0,
                                                             const int R,
                                                             float (*acc)[MAX_TILES * TILE]) {
    for (int c = 0; c < C; c++)
        tile_one(w + c * stride, b0, b1, bits, zero_points, a, row0, R, acc, TILE * c);
}
#endif

/* Up to ROWS rows of C (1 to MAX_TILES) tiles. The blocks go in chunks whose weights fit the
 * L1 cache, each chunk for every group of rows (4, the last up to MAX_GROUP; their sums in
 * registers within it): the weights come from memory once, later groups read them from L1. A row's sums still
 * run block after block in order, so its bits do not depend on the chunks, groups or tiles. */
static void tile_rows(const uint8_t *w, size_t stride, int C, int blocks, int bits,
                      int zero_points, const spx_acts *a, int row0, int rows,
                      float acc[ROWS][MAX_TILES * TILE]) {
    const int chunk = (int)(16384 / (C * tile_bytes(bits, a->block, zero_points))) + 1;
    memset(acc, 0, sizeof(float) * ROWS * MAX_TILES * TILE);
    for (int b0 = 0; b0 < blocks; b0 += chunk) {
        const int b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
#define TILES(R, c) tile_group(w, stride, c, b0, b1, bits, zero_points, a, row0 + m, R, acc + m)
#define GROUP(R)                                                                          \
    do {                                                                                  \
        switch (C) {                                                                      \
        case 4: TILES(R, 4); break;                                                       \
        case 3: TILES(R, 3); break;                                                       \
        case 2: TILES(R, 2); break;                                                       \
        default: TILES(R, 1); break;                                                      \
        }                                                                                 \
    } while (0)
        int m = 0;
        for (; rows - m > MAX_GROUP; m += 4) GROUP(4);
        switch (rows - m) { /* the last group whole: 5 rows as 4 + 1 paid a pass for one */
        case 5: GROUP(5); break;
        case 4: GROUP(4); break;
        case 3: GROUP(3); break;
        case 2: GROUP(2); break;
        case 1: GROUP(1); break;
        default: break;
        }
#undef GROUP
#undef TILES
    }
}

/* This thread's share of the tiles, every row, in spans of MAX_TILES tiles. */
static void linear(const spx_linear *l, const spx_acts *a, int rows, float *out, int ldo,
                   int thread, int threads) {
    const int span = MAX_TILES;
    const int tiles = (l->n + TILE - 1) / TILE, blocks = l->k / l->block;
    const int spans = (tiles + span - 1) / span;
    const int first = span * (spans * thread / threads);
    const int end = span * (spans * (thread + 1) / threads), last = end < tiles ? end : tiles;
    const size_t stride = (size_t)blocks * tile_bytes(l->bits, l->block, l->zero_points);
    float acc[ROWS][MAX_TILES * TILE];
    for (int t = first; t < last; t += span) {
        const int C = last - t >= span ? span : last - t, n0 = t * TILE;
        const int width = l->n - n0 < C * TILE ? l->n - n0 : C * TILE;
        for (int row0 = 0; row0 < rows; row0 += ROWS) {
            const int count = rows - row0 < ROWS ? rows - row0 : ROWS;
            tile_rows(l->weight + t * stride, stride, C, blocks, l->bits, l->zero_points, a, row0,
                      count, acc);
            for (int m = 0; m < count; m++) {
                float *o = out + (size_t)(row0 + m) * ldo + n0;
                for (int j = 0; j < width; j++) o[j] = acc[m][j] + (l->bias ? l->bias[n0 + j] : 0.0f);
            }
        }
    }
}

/* ---- elementwise pieces ------------------------------------------------------------ */

/* The lanes' sum, halves folded onto halves (a fixed order the compiler vectorizes). */
static inline float reduce(float lanes[LANES]) {
    for (int l = 0; l < 8; l++) lanes[l] += lanes[l + 8];
    for (int l = 0; l < 4; l++) lanes[l] += lanes[l + 4];
    for (int l = 0; l < 2; l++) lanes[l] += lanes[l + 2];
    return lanes[0] + lanes[1];
}

/* exp on the floats softmax and SiLU need: Cephes' polynomial after x = n ln2 + r, the same
 * operations on one float (exp_one) as on a vector of them (the exp_* loops), so a value's
 * exp does not depend on where in an array it sits. */
#define EXP_POLY(type, fma, mul, add, r)                                                      \
    ({                                                                                    \
        type p_ = fma(SPLAT(1.9875691500e-4f), r, SPLAT(1.3981999507e-3f));               \
        p_ = fma(p_, r, SPLAT(8.3334519073e-3f));                                          \
        p_ = fma(p_, r, SPLAT(4.1665795894e-2f));                                          \
        p_ = fma(p_, r, SPLAT(1.6666665459e-1f));                                          \
        p_ = fma(p_, r, SPLAT(5.0000001201e-1f));                                          \
        add(fma(mul(p_, r), r, r), SPLAT(1.0f));                                           \
    })

static inline float exp_one(float x) {
#define SPLAT(c) (c)
#define MUL(a, b) ((a) * (b))
#define ADD(a, b) ((a) + (b))
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = floorf(fmaf(x, 1.44269504f, 0.5f));
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, x));
    const float p = EXP_POLY(float, fmaf, MUL, ADD, r);
    const int32_t exponent = ((int32_t)n + 127) << 23;
    float two;
    memcpy(&two, &exponent, sizeof two);
    return p * two;
#undef SPLAT
#undef MUL
#undef ADD
}

#ifdef SPX_VNNI
#define VLEN 16
typedef __m512 vfloat;
static inline vfloat exp_vec(vfloat x) {
#define SPLAT(c) _mm512_set1_ps(c)
    x = _mm512_min_ps(_mm512_max_ps(x, SPLAT(-87.0f)), SPLAT(88.0f));
    const vfloat n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, SPLAT(1.44269504f), SPLAT(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const vfloat r = _mm512_fmadd_ps(n, SPLAT(2.12194440e-4f),
                                     _mm512_fmadd_ps(n, SPLAT(-0.693359375f), x));
    const vfloat p = EXP_POLY(vfloat, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, r);
    const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
#undef SPLAT
}
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSPLAT _mm512_set1_ps
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VDIV _mm512_div_ps
#define VFMA _mm512_fmadd_ps
#else
#define VLEN 8
typedef __m256 vfloat;
static inline vfloat exp_vec(vfloat x) {
#define SPLAT(c) _mm256_set1_ps(c)
    x = _mm256_min_ps(_mm256_max_ps(x, SPLAT(-87.0f)), SPLAT(88.0f));
    const vfloat n = _mm256_floor_ps(_mm256_fmadd_ps(x, SPLAT(1.44269504f), SPLAT(0.5f)));
    const vfloat r = _mm256_fmadd_ps(n, SPLAT(2.12194440e-4f),
                                     _mm256_fmadd_ps(n, SPLAT(-0.693359375f), x));
    const vfloat p = EXP_POLY(vfloat, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, r);
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
#undef SPLAT
}
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSPLAT _mm256_set1_ps
#define VMUL _mm256_mul_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VDIV _mm256_div_ps
#define VFMA _mm256_fmadd_ps
#endif


/* 16 lanes of floats: one AVX-512 register or two AVX2 ones, the same sums either way. */
typedef struct {
    vfloat v[16 / VLEN];
} lanes16;

static inline lanes16 load16(const float *x) {
    lanes16 r;
    for (int i = 0; i < 16 / VLEN; i++) r.v[i] = VLOAD(x + VLEN * i);
    return r;
}

static inline void store16(float *x, lanes16 a) {
    for (int i = 0; i < 16 / VLEN; i++) VSTORE(x + VLEN * i, a.v[i]);
}

static inline lanes16 splat16(float x) {
    lanes16 r;
    for (int i = 0; i < 16 / VLEN; i++) r.v[i] = VSPLAT(x);
    return r;
}

static inline lanes16 mul16(lanes16 a, lanes16 b) {
    for (int i = 0; i < 16 / VLEN; i++) a.v[i] = VMUL(a.v[i], b.v[i]);
    return a;
}

static inline lanes16 fma16(lanes16 a, lanes16 b, lanes16 c) { /* a b + c, rounded once */
    for (int i = 0; i < 16 / VLEN; i++) c.v[i] = VFMA(a.v[i], b.v[i], c.v[i]);
    return c;
}

/* x . y: lane l sums the products at indices = l mod 16 in order, then the lanes fold. */
static inline float dot(const float *x, const float *y, int n) {
    float lanes[LANES] = {0};
    if (n % LANES == 0) {
        lanes16 acc = mul16(load16(x), load16(y)); /* = fma(x, y, 0) but for a zero's sign */
        for (int i = LANES; i < n; i += LANES) acc = fma16(load16(x + i), load16(y + i), acc);
        store16(lanes, acc);
        return reduce(lanes);
    }
    const int whole = n - n % LANES;
    for (int i = 0; i < whole; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = fmaf(x[i + l], y[i + l], lanes[l]);
    for (int l = 0; l < n - whole; l++) lanes[l] = fmaf(x[whole + l], y[whole + l], lanes[l]);
    return reduce(lanes);
}

static void rms_norm(const float *x, const float *w, int d, float eps, float *out) {
    const float inv = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int i = 0; i < d; i++) out[i] = x[i] * inv * w[i];
}

/* x[i] = exp(x[i] - shift) */
static void exp_shifted(float *x, int n, float shift) {
    int i = 0;
    for (; i + VLEN <= n; i += VLEN) VSTORE(x + i, exp_vec(VSUB(VLOAD(x + i), VSPLAT(shift))));
    for (; i < n; i++) x[i] = exp_one(x[i] - shift);
}

/* g[i] = SiLU(g[i]) u[i] = g[i] / (1 + exp(-g[i])) u[i] */
static void silu_mul(float *g, const float *u, int n) {
    int i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        const vfloat x = VLOAD(g + i), e = exp_vec(VSUB(VSPLAT(0.0f), x));
        VSTORE(g + i, VMUL(VDIV(x, VADD(VSPLAT(1.0f), e)), VLOAD(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + exp_one(-g[i])) * u[i];
}

static void rope(float *x, int heads, int head_dim, const float *cosv, const float *sinv,
                 int half) {
    for (int h = 0; h < heads; h++) {
        float *v = x + h * head_dim;
        for (int i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cosv[i] - b * sinv[i];
            v[i + half] = b * cosv[i] + a * sinv[i];
        }
    }
}

/* ---- attention: a query reads every slot its mask shows, in slot order ---------------- */

typedef struct {
    int batch, n, slots, cap; /* cap: slots a cache row holds (spare included) */
    const uint8_t *mask;      /* [B][N][slots] */
    float *kv;                /* every layer's keys, then every layer's values: [Hkv][cap][D] */
    int64_t layer_stride, batch_stride; /* floats between layers' and sequences' caches */
} spx_step;

/* Sequence b's cache of KV head g in layer l: keys, or values with `values` set. */
static inline float *cache_rows(const spx_model *m, const spx_step *s, int l, int values, int b,
                                int g) {
    return s->kv + (size_t)(values * m->layers + l) * s->layer_stride + (size_t)b * s->batch_stride
           + (size_t)g * s->cap * m->head_dim;
}

/* o[0 .. 16 C) += p[t] v_j for each slot j in [j0, j1) the query sees, t counting them, one
 * fma after another per output; C (a constant where called) registers of o across the slots,
 * independent chains for the pipelines. Returns t. */
static inline __attribute__((always_inline)) int values16(float *o, const float *p, int t,
                                                          const uint8_t *seen, int j0, int j1,
                                                          const float *v, int D, const int C) {
    lanes16 acc[8];
    for (int c = 0; c < C; c++) acc[c] = load16(o + 16 * c);
    for (int j = j0; j < j1; j++) {
        if (!seen[j]) continue;
        const lanes16 pt = splat16(p[t++]);
        for (int c = 0; c < C; c++) acc[c] = fma16(pt, load16(v + (size_t)j * D + 16 * c), acc[c]);
    }
    for (int c = 0; c < C; c++) store16(o + 16 * c, acc[c]);
    return t;
}

/* The same for any D, one output at a time. */
static int values_any(float *o, const float *p, int t, const uint8_t *seen, int j0, int j1,
                      const float *v, int D) {
    for (int j = j0; j < j1; j++) {
        if (!seen[j]) continue;
        const float pt = p[t++];
        for (int d = 0; d < D; d++) o[d] = fmaf(pt, v[(size_t)j * D + d], o[d]);
    }
    return t;
}

static int values(float *o, const float *p, int t, const uint8_t *seen, int j0, int j1,
                  const float *v, int D) {
    switch (D % 16 ? 0 : D / 16) {
    case 4: return values16(o, p, t, seen, j0, j1, v, D, 4);
    case 5: return values16(o, p, t, seen, j0, j1, v, D, 5);
    case 6: return values16(o, p, t, seen, j0, j1, v, D, 6);
    case 8: return values16(o, p, t, seen, j0, j1, v, D, 8);
    default: return values_any(o, p, t, seen, j0, j1, v, D);
    }
}

#ifdef SPX_VNNI
/* The 16 lanes of each of acc[0..15] summed, into out[0..15]: the same folds as `reduce`
 * (8 onto 8, 4 onto 4, 2 onto 2, 1 onto 1), done for 16 sums at once by shuffles. */
static inline void fold16(const __m512 acc[16], float out[16]) {
    __m512 eight[8], four[4], two[2];
    for (int s = 0; s < 8; s++) /* [slot 2s lanes l + l+8 | slot 2s+1 ...], l < 8 */
        eight[s] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * s], acc[2 * s + 1], 0x44),
                                 _mm512_shuffle_f32x4(acc[2 * s], acc[2 * s + 1], 0xEE));
    for (int s = 0; s < 4; s++) /* per 128-bit lane, one slot's l + l+4, l < 4 */
        four[s] = _mm512_add_ps(_mm512_shuffle_f32x4(eight[2 * s], eight[2 * s + 1], 0x88),
                                _mm512_shuffle_f32x4(eight[2 * s], eight[2 * s + 1], 0xDD));
    for (int s = 0; s < 2; s++) /* per lane k: slots k, 4 + k (of 8): l + l+2, l < 2 */
        two[s] = _mm512_add_ps(_mm512_shuffle_ps(four[2 * s], four[2 * s + 1], 0x44),
                               _mm512_shuffle_ps(four[2 * s], four[2 * s + 1], 0xEE));
    const __m512 one = _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], 0x88),
                                     _mm512_shuffle_ps(two[0], two[1], 0xDD));
    /* lane 4k + r holds slot 4r + k */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, one));
}


/* dot(q_h, k_{j+s}, D) for HP heads (q in registers, C = D / 16 chunks) and the 16 slots s
 * from j, each key read once for the heads: out[h][s]. HP and C are constants where called. */
static inline __attribute__((always_inline)) void dots16(const __m512 (*q)[8], const float *k,
                                                         const int HP, const int C,
                                                         float (*out)[16]) {
    __m512 acc[4][16];
    for (int s = 0; s < 16; s++, k += 16 * C) {
        __m512 lanes[4];
        const __m512 k0 = _mm512_loadu_ps(k);
        for (int h = 0; h < HP; h++) lanes[h] = _mm512_mul_ps(q[h][0], k0);
        for (int c = 1; c < C; c++) {
            const __m512 kc = _mm512_loadu_ps(k + 16 * c);
            for (int h = 0; h < HP; h++) lanes[h] = _mm512_fmadd_ps(q[h][c], kc, lanes[h]);
        }
        for (int h = 0; h < HP; h++) acc[h][s] = lanes[h];
    }
    for (int h = 0; h < HP; h++) fold16(acc[h], out[h]);
}

/* HP heads' scores (q_h at q + h D, its row at score + h L) over the slots [j0, j1) the
 * query sees, in blocks of 16 by dots16, the rest one by one; returns the new count. */
static inline __attribute__((always_inline)) int scores_heads(const float *q, const float *keys,
                                                              const uint8_t *seen, int j0, int j1,
                                                              const int HP, const int C, int L,
                                                              float scale, float *score, int t0) {
    const int D = 16 * C;
    __m512 qv[4][8];
    for (int h = 0; h < HP; h++)
        for (int c = 0; c < C; c++) qv[h][c] = _mm512_loadu_ps(q + h * D + 16 * c);
    float sixteen[4][16];
    int j = j0, t = t0;
    for (; j + 16 <= j1; j += 16) {
        dots16(qv, keys + (size_t)j * D, HP, C, sixteen);
        const __m128i shown = _mm_loadu_si128((const __m128i *)(seen + j));
        if (_mm_movemask_epi8(_mm_cmpeq_epi8(shown, _mm_setzero_si128())) == 0) {
            /* all 16 seen (a prefix's usual case): the same products, stored at once */
            for (int h = 0; h < HP; h++)
                _mm512_storeu_ps(score + (size_t)h * L + t0,
                                 _mm512_mul_ps(_mm512_loadu_ps(sixteen[h]), _mm512_set1_ps(scale)));
            t0 += 16;
            continue;
        }
        for (int h = 0; h < HP; h++) {
            t = t0;
            for (int s = 0; s < 16; s++)
                if (seen[j + s]) score[(size_t)h * L + t++] = sixteen[h][s] * scale;
        }
        t0 = t;
    }
    for (int h = 0; h < HP; h++) {
        t = t0;
        for (int jj = j; jj < j1; jj++)
            if (seen[jj]) score[(size_t)h * L + t++] = dot(q + h * D, keys + (size_t)jj * D, D) * scale;
    }
    return t;
}

/* o_h += p_h[t] v_j for HP heads (o_h at o + h D, p_h at p + h L) and the slots [j0, j1)
 * the query sees, one fma after another per output; each value row read once for the heads,
 * HP x C registers of outputs across the slots. Returns the new count. */
static inline __attribute__((always_inline)) int values_heads(float *o, const float *p, int t,
                                                              const uint8_t *seen, int j0, int j1,
                                                              const float *v, const int HP,
                                                              const int C, int L) {
    const int D = 16 * C;
    __m512 acc[4][8];
    for (int h = 0; h < HP; h++)
        for (int c = 0; c < C; c++) acc[h][c] = _mm512_loadu_ps(o + h * D + 16 * c);
    for (int j = j0; j < j1; j++) {
        if (!seen[j]) continue;
        __m512 pt[4];
        for (int h = 0; h < HP; h++) pt[h] = _mm512_set1_ps(p[(size_t)h * L + t]);
        t++;
        for (int c = 0; c < C; c++) {
            const __m512 vc = _mm512_loadu_ps(v + (size_t)j * D + 16 * c);
            for (int h = 0; h < HP; h++) acc[h][c] = _mm512_fmadd_ps(pt[h], vc, acc[h][c]);
        }
    }
    for (int h = 0; h < HP; h++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(o + h * D + 16 * c, acc[h][c]);
    return t;
}

/* The heads a pass of attention takes together (1, 2 or 4) and D / 16, or 0 where the
 * grouped passes do not apply (D not a multiple of 16 or over 128). */
static int head_block(int D, int group) {
    const int C = D % 16 ? 0 : D / 16;
    if (C != 4 && C != 5 && C != 6 && C != 8) return 0;
    return group % 4 == 0 && C <= 6 ? 4 : group % 2 == 0 ? 2 : 1;
}

#define HEAD_SHAPES(X) X(4, 4) X(4, 5) X(4, 6) X(2, 4) X(2, 5) X(2, 6) X(2, 8) \
    X(1, 4) X(1, 5) X(1, 6) X(1, 8)

static int scores_block(const float *q, const float *keys, const uint8_t *seen, int j0, int j1,
                        int HP, int D, int L, float scale, float *score, int t) {
#define CASE(hp, c) \
    if (HP == hp && D == 16 * c) return scores_heads(q, keys, seen, j0, j1, hp, c, L, scale, score, t);
    HEAD_SHAPES(CASE)
#undef CASE
    return t;
}

static int values_block(float *o, const float *p, int t, const uint8_t *seen, int j0, int j1,
                        const float *v, int HP, int D, int L) {
#define CASE(hp, c) \
    if (HP == hp && D == 16 * c) return values_heads(o, p, t, seen, j0, j1, v, hp, c, L);
    HEAD_SHAPES(CASE)
#undef CASE
    return t;
}
#endif

/* Query q's scores against the slots [j0, j1) it sees, appended at score[t]; returns t. */
static int scores_of(const float *q, const float *keys, const uint8_t *seen, int j0, int j1,
                     int D, float scale, float *score, int t) {
    for (int j = j0; j < j1; j++)
        if (seen[j]) score[t++] = dot(q, keys + (size_t)j * D, D) * scale;
    return t;
}

/* Queries of (sequence b, KV head g): all N rows x the heads sharing g.
 *
 * Slots go in chunks of SLOT_CHUNK, each chunk's keys and values read from memory once and
 * used from L1 by every query (the prefix is read once per forward, not once per query).
 * A query's scores are kept compact, in slot order over the slots its mask shows, and every
 * sum runs over that compact order (softmax's in 16 lanes by compact index, the values' one
 * fma after another): a tree node sees the same keys in the same order as the same token in a
 * chain, wherever the node sits, so its sums and output are the same bits. */
static void attend(const spx_model *m, const spx_step *s, int layer, int b, int g,
                   const float *qkv, int ldq, float *out, int ldo, float *scores, int *counts) {
    const int D = m->head_dim, group = m->heads / m->kv_heads, L = s->slots, N = s->n;
    const float *keys = cache_rows(m, s, layer, 0, b, g);
    const float *value_rows = cache_rows(m, s, layer, 1, b, g);
#ifdef SPX_VNNI
    const int HP = head_block(D, group) ? head_block(D, group) : 1; /* heads a pass takes */
    const int grouped = head_block(D, group) != 0;
#else
    const int HP = 1; /* the grouped passes are AVX-512's */
#endif
    for (int i = 0; i < N; i++) counts[i] = 0;
    for (int j0 = 0; j0 < L; j0 += SLOT_CHUNK) { /* scores[i * group + h][compact index] */
        const int j1 = j0 + SLOT_CHUNK < L ? j0 + SLOT_CHUNK : L;
        for (int i = 0; i < N; i++) {
            const uint8_t *seen = s->mask + ((size_t)b * N + i) * L;
            const float *q = qkv + (size_t)(b * N + i) * ldq + (size_t)g * group * D;
            int t = counts[i];
            for (int h = 0; h < group; h += HP) {
                float *score = scores + (size_t)(i * group + h) * L;
#ifdef SPX_VNNI
                if (grouped) {
                    t = scores_block(q + h * D, keys, seen, j0, j1, HP, D, L, m->attn_scale, score,
                                     counts[i]);
                    continue;
                }
#endif
                t = scores_of(q + h * D, keys, seen, j0, j1, D, m->attn_scale, score, counts[i]);
            }
            counts[i] = t;
        }
    }
    for (int i = 0; i < N; i++) {
        const int n = counts[i];
        for (int h = 0; h < group; h++) {
            float *p = scores + (size_t)(i * group + h) * L, top = -INFINITY;
            for (int t = 0; t < n; t++) top = larger(top, p[t]);
            exp_shifted(p, n, top);
            float lanes[LANES] = {0};
            const int whole = n - n % LANES;
            for (int t = 0; t < whole; t += LANES)
                for (int l = 0; l < LANES; l++) lanes[l] += p[t + l];
            for (int l = 0; l < n - whole; l++) lanes[l] += p[whole + l];
            const float total = reduce(lanes), inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int t = 0; t < n; t++) p[t] *= inv;
            memset(out + (size_t)(b * N + i) * ldo + (size_t)(g * group + h) * D, 0, sizeof(float) * D);
        }
        counts[i] = 0;
    }
    for (int j0 = 0; j0 < L; j0 += SLOT_CHUNK) { /* out += p . values, slot after slot */
        const int j1 = j0 + SLOT_CHUNK < L ? j0 + SLOT_CHUNK : L;
        for (int i = 0; i < N; i++) {
            const uint8_t *seen = s->mask + ((size_t)b * N + i) * L;
            int t = counts[i];
            for (int h = 0; h < group; h += HP) {
                const float *p = scores + (size_t)(i * group + h) * L;
                float *o = out + (size_t)(b * N + i) * ldo + (size_t)(g * group + h) * D;
#ifdef SPX_VNNI
                if (grouped) {
                    t = values_block(o, p, counts[i], seen, j0, j1, value_rows, HP, D, L);
                    continue;
                }
#endif
                t = values(o, p, counts[i], seen, j0, j1, value_rows, D);
            }
            counts[i] = t;
        }
    }
}

/* ---- the forward ------------------------------------------------------------------- */

static int widest_input(const spx_model *m) {
    const int attention = m->heads * m->head_dim;
    const int hidden = m->hidden_norm ? 2 * m->hidden : m->hidden;
    const int k = m->inter > hidden ? m->inter : hidden;
    return k > attention ? k : attention;
}

/* Bytes of scratch a forward of `rows` rows over `slots` slots needs. */
size_t spx_workspace_bytes(const spx_model *m, int rows, int slots) {
    const size_t d = m->hidden, q = (size_t)(m->heads + 2 * m->kv_heads) * m->head_dim;
    const size_t widest = (size_t)m->inter * 2 > q ? (size_t)m->inter * 2 : q;
    const size_t k_max = widest_input(m);
    const size_t floats = rows * (4 * d + widest + (size_t)m->heads * m->head_dim + 2 * m->rotary_half)
                          + (size_t)m->threads * rows * (m->heads / m->kv_heads) * slots
                          + (size_t)rows * (k_max / QBLOCK) * 2 + 64;
    const size_t counts = (size_t)m->threads * rows; /* attention's per query */
    return floats * 4 + rows * k_max + counts * 4 + 256;
}

/* This thread's rows of x [rows][ld] quantized as `l` reads them (its k inputs, its block). */
static void quantize_rows(const float *x, int rows, int ld, const spx_linear *l, spx_acts *a,
                          int thread, int threads) {
    const int k = l->k, nb = k / l->block;
    a->k = k;
    a->block = l->block;
    for (int r = thread; r < rows; r += threads)
        quantize_row(x + (size_t)r * ld, k, l->block, a->q + (size_t)r * k, a->scale + (size_t)r * nb,
                     a->sum + (size_t)r * nb);
}

static int forward_here(const spx_model *m, int batch, int n, const int64_t *ids, const int64_t *pos,
                const uint8_t *mask, int slots, const int64_t *write_pos, float *kv,
                int64_t layer_stride, int64_t batch_stride, int cap, const float *features,
                float *logits, float *taps, void *workspace) {
    const int rows = batch * n, d = m->hidden, D = m->head_dim, H = m->heads, G = m->kv_heads;
    const int qn = (H + 2 * G) * D, group = H / G, half = m->rotary_half;
    const int tap_width = m->tap_kind == 2 ? m->n_taps * d : d;
    const int head = m->hidden_norm != NULL, in = head ? 2 * d : d; /* the q/k/v inputs */
    float *h = workspace, *xn = h + (size_t)rows * d, *att = xn + (size_t)rows * 2 * d;
    float *wide = att + (size_t)rows * H * D, *scores = wide + (size_t)rows * (m->inter * 2 > qn ? m->inter * 2 : qn);
    float *rot = scores + (size_t)m->threads * rows * group * slots; /* [rows][cos | sin] */
    float *act_scale = rot + (size_t)rows * 2 * half;
    const int k_max = widest_input(m);
    int32_t *act_zero = (int32_t *)(act_scale + (size_t)rows * (k_max / QBLOCK));
    int8_t *act_q = (int8_t *)(act_zero + (size_t)rows * (k_max / QBLOCK));
    int *counts = (int *)(act_q + ((size_t)rows * k_max + 3) / 4 * 4);
    spx_acts acts = {act_q, act_scale, act_zero, d, QBLOCK};
    const spx_step step = {batch, n, slots, cap, mask, kv, layer_stride, batch_stride};

#pragma omp parallel num_threads(m->threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int r = t; r < rows; r += T) {
            float *x = h + (size_t)r * d;
            for (int i = 0; i < d; i++) x[i] = m->embed[(size_t)ids[r] * d + i] * m->embed_scale;
            if (head) { /* [input_norm(embed) | hidden_norm(features)], then h = features */
                rms_norm(x, m->layer[0].input_norm, d, m->eps, xn + (size_t)r * in);
                rms_norm(features + (size_t)r * d, m->hidden_norm, d, m->eps, xn + (size_t)r * in + d);
                memcpy(x, features + (size_t)r * d, sizeof(float) * d);
            }
            for (int i = 0; i < half; i++) {
                const float angle = (float)pos[r] * m->inv_freq[i];
                rot[(size_t)r * 2 * half + i] = cosf(angle) * m->rope_scaling;
                rot[(size_t)r * 2 * half + half + i] = sinf(angle) * m->rope_scaling;
            }
        }
#pragma omp barrier
        for (int l = 0; l <= m->layers; l++) {
            for (int k = 0; k < m->n_taps && m->tap_kind == 2; k++)
                if (m->tap_layers[k] == l)
                    for (int r = t; r < rows; r += T)
                        memcpy(taps + (size_t)r * tap_width + (size_t)k * d, h + (size_t)r * d, sizeof(float) * d);
            if (l == m->layers) break;
            const spx_layer *L = m->layer + l;
            for (int r = t; r < rows && !head; r += T)
                rms_norm(h + (size_t)r * d, L->input_norm, d, m->eps, xn + (size_t)r * d);
#pragma omp barrier
            quantize_rows(xn, rows, in, &L->qkv, &acts, t, T);
#pragma omp barrier
            linear(&L->qkv, &acts, rows, wide, qn, t, T);
#pragma omp barrier
            for (int r = t; r < rows; r += T) { /* RoPE, then the new keys and values to their slots */
                float *q = wide + (size_t)r * qn;
                rope(q, H + G, D, rot + (size_t)r * 2 * half, rot + (size_t)r * 2 * half + half, half);
                const int b = r / n, slot = (int)write_pos[b] + r % n;
                for (int g = 0; g < G; g++) {
                    memcpy(cache_rows(m, &step, l, 0, b, g) + (size_t)slot * D, q + (size_t)(H + g) * D, sizeof(float) * D);
                    memcpy(cache_rows(m, &step, l, 1, b, g) + (size_t)slot * D, q + (size_t)(H + G + g) * D, sizeof(float) * D);
                }
            }
#pragma omp barrier
            for (int w = t; w < batch * G; w += T)
                attend(m, &step, l, w / G, w % G, wide, qn, att, H * D,
                       scores + (size_t)t * rows * group * slots, counts + (size_t)t * rows);
#pragma omp barrier
            quantize_rows(att, rows, H * D, &L->o, &acts, t, T);
#pragma omp barrier
            linear(&L->o, &acts, rows, xn, d, t, T);
#pragma omp barrier
            for (int r = t; r < rows; r += T) {
                float *x = h + (size_t)r * d, *y = xn + (size_t)r * d;
                for (int i = 0; i < d; i++) x[i] += y[i];
                rms_norm(x, L->post_norm, d, m->eps, y);
            }
#pragma omp barrier
            quantize_rows(xn, rows, d, &L->gate_up, &acts, t, T);
#pragma omp barrier
            linear(&L->gate_up, &acts, rows, wide, 2 * m->inter, t, T);
#pragma omp barrier
            for (int r = t; r < rows; r += T) { /* SiLU(gate) * up, into the gate's half */
                float *g = wide + (size_t)r * 2 * m->inter, *u = g + m->inter;
                silu_mul(g, u, m->inter);
            }
#pragma omp barrier
            quantize_rows(wide, rows, 2 * m->inter, &L->down, &acts, t, T);
#pragma omp barrier
            linear(&L->down, &acts, rows, xn, d, t, T);
#pragma omp barrier
            for (int r = t; r < rows; r += T)
                for (int i = 0; i < d; i++) h[(size_t)r * d + i] += xn[(size_t)r * d + i];
#pragma omp barrier
        }
        for (int r = t; r < rows; r += T) {
            rms_norm(h + (size_t)r * d, m->final_norm, d, m->eps, xn + (size_t)r * d);
            if (m->tap_kind == 1) memcpy(taps + (size_t)r * d, xn + (size_t)r * d, sizeof(float) * d);
            if (m->tap_kind == 3) memcpy(taps + (size_t)r * d, h + (size_t)r * d, sizeof(float) * d);
        }
#pragma omp barrier
        quantize_rows(xn, rows, d, &m->lm_head, &acts, t, T);
#pragma omp barrier
        linear(&m->lm_head, &acts, rows, logits, m->vocab, t, T);
    }
    return 0;
}

/* The GEMM alone, on the calling thread: out [rows][n] = x [rows][k] . w. */
static int linear_forward_here(const spx_linear *l, int rows, const float *x, float *out,
                               void *workspace, int threads) {
    float *scale = workspace;
    int32_t *zero = (int32_t *)(scale + (size_t)rows * (l->k / QBLOCK));
    spx_acts acts = {(int8_t *)(zero + (size_t)rows * (l->k / QBLOCK)), scale, zero, l->k, l->block};
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        quantize_rows(x, rows, l->k, l, &acts, t, T);
#pragma omp barrier
        linear(l, &acts, rows, out, l->n, t, T);
    }
    return 0;
}

/* ---- one OpenMP team per process ------------------------------------------------------
 *
 * libgomp keeps a team of threads for every thread that starts a parallel region, and once
 * the teams' threads outnumber the CPUs it stops spinning at barriers: each thread sleeps and
 * is woken at every one, and a forward passes ~400. A process that drafts or times on one
 * thread and decodes on another (`specx serve`: a drafter checked on the main thread, rounds
 * on the scheduler's) paid ~6 ms a verify for it: 31,000 futex sleeps per thread over 8
 * requests, the server at 0.85x the engine's speed (docs/decisions.md#kernels-one-team). So
 * every forward runs on one thread of this library's, started at the first call; the caller
 * (its GIL released by ctypes) waits for it, one call at a time. */
typedef struct {
    int (*run)(void *);
    void *args;
    int pending, result;
} team_call;

static pthread_mutex_t calls = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t posted = PTHREAD_COND_INITIALIZER, finished = PTHREAD_COND_INITIALIZER;
static team_call current;
static int team_thread_started;

static void *team_thread(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!current.pending) pthread_cond_wait(&posted, &lock);
        pthread_mutex_unlock(&lock);
        const int result = current.run(current.args);
        pthread_mutex_lock(&lock);
        current.result = result;
        current.pending = 0;
        pthread_cond_signal(&finished);
    }
    return NULL;
}

/* A forked child has no team thread (only the forking thread survives): start another. */
static void forked_child(void) {
    pthread_mutex_init(&calls, NULL);
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&posted, NULL);
    pthread_cond_init(&finished, NULL);
    current.pending = 0;
    team_thread_started = 0;
}

static int on_team_thread(int (*run)(void *), void *args) {
    pthread_mutex_lock(&calls);
    pthread_mutex_lock(&lock);
    if (!team_thread_started) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, team_thread, NULL);
        pthread_attr_destroy(&attr);
        if (failed) { /* no thread to be had: run here, as before */
            pthread_mutex_unlock(&lock);
            const int result = run(args);
            pthread_mutex_unlock(&calls);
            return result;
        }
        team_thread_started = 1;
    }
    current.run = run;
    current.args = args;
    current.pending = 1;
    pthread_cond_signal(&posted);
    while (current.pending) pthread_cond_wait(&finished, &lock);
    const int result = current.result;
    pthread_mutex_unlock(&lock);
    pthread_mutex_unlock(&calls);
    return result;
}

typedef struct {
    const spx_model *m;
    int batch, n;
    const int64_t *ids, *pos;
    const uint8_t *mask;
    int slots;
    const int64_t *write_pos;
    float *kv;
    int64_t layer_stride, batch_stride;
    int cap;
    const float *features;
    float *logits, *taps;
    void *workspace;
} forward_args;

static int run_forward(void *p) {
    const forward_args *a = p;
    return forward_here(a->m, a->batch, a->n, a->ids, a->pos, a->mask, a->slots, a->write_pos, a->kv,
                        a->layer_stride, a->batch_stride, a->cap, a->features, a->logits, a->taps,
                        a->workspace);
}

int spx_forward(const spx_model *m, int batch, int n, const int64_t *ids, const int64_t *pos,
                const uint8_t *mask, int slots, const int64_t *write_pos, float *kv,
                int64_t layer_stride, int64_t batch_stride, int cap, const float *features,
                float *logits, float *taps, void *workspace) {
    forward_args a = {m, batch, n, ids, pos, mask, slots, write_pos, kv, layer_stride,
                      batch_stride, cap, features, logits, taps, workspace};
    return on_team_thread(run_forward, &a);
}

typedef struct {
    const spx_linear *l;
    int rows;
    const float *x;
    float *out;
    void *workspace;
    int threads;
} linear_args;

static int run_linear(void *p) {
    const linear_args *a = p;
    return linear_forward_here(a->l, a->rows, a->x, a->out, a->workspace, a->threads);
}

/* The GEMM alone (tests, the kernel benchmark, a head's projection): out = x . w. */
int spx_linear_forward(const spx_linear *l, int rows, const float *x, float *out, void *workspace,
                       int threads) {
    linear_args a = {l, rows, x, out, workspace, threads};
    return on_team_thread(run_linear, &a);
}

__attribute__((constructor)) static void register_fork_handler(void) {
    pthread_atfork(NULL, NULL, forked_child);
}

/* exp of n floats in place (tests: a value's exp is the same wherever it sits). */
void spx_exp(float *x, int n) { exp_shifted(x, n, 0.0f); }
