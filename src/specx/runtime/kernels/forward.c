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
 * then TILE fp16 scales. value = (code - zero) * scale, zero = 8 (int4) or 128 (int8).
 * Activations are quantized to int8 per block of QBLOCK (scale = max|x| / 127), as ONNX
 * Runtime's int4 builds do at accuracy level 4.
 *
 * One source, compiled once per instruction set (setup.py): SPX_VNNI selects AVX-512 VNNI,
 * otherwise AVX2 + FMA. The loader (kernels.py) picks the one the CPU runs.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define TILE 16   /* output columns a tile */
#define QBLOCK 32 /* inputs a register pass covers; a block is 1 to 8 of them */
#define ROWS 16   /* rows one pass over a tile's weights serves */
#define LANES 16  /* partial sums of a dot product, reduced in a fixed order */

typedef struct {
    const uint8_t *weight; /* [tiles][blocks][tile bytes] */
    const float *bias;     /* [n] or NULL */
    int32_t bits, k, n;    /* n: real columns (the last tile may be padded) */
    int32_t block;         /* inputs sharing a scale, weights' and activations' alike */
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
    int32_t tap_kind; /* 0 none, 1 the last hidden state after the final norm, 2 layer inputs */
    int32_t n_taps;
    int32_t tap_layers[8]; /* states entering these layers; == layers: the last one's output */
    int32_t threads;
} spx_model;

/* A tile's bytes per block: the codes, then TILE fp16 scales. */
static inline size_t tile_bytes(int bits, int block) {
    return (size_t)TILE * block * bits / 8 + TILE * 2;
}

/* fmaxf's NaN rules keep it a libm call; the inputs here are finite. */
static inline float larger(float a, float b) { return a > b ? a : b; }

/* ---- activations: int8 per block ---------------------------------------------------- */

typedef struct {
    int8_t *q;     /* [rows][k] */
    float *scale;  /* [rows][k / block] */
    int32_t *zero; /* [rows][k / block]: -zero point x the block's sum of codes */
    int k, block;
} spx_acts;

static void quantize_row(const float *x, int k, int block, int zero_point, int8_t *q,
                         float *scale, int32_t *zero) {
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
        zero[b] = -zero_point * sum;
    }
}

/* ---- the weight-only GEMM: out[m][n] = sum_k x[m][k] w[n][k] (+ bias) --------------- */

#ifdef SPX_VNNI
static inline __m512i broadcast4(const int8_t *x) {
    int32_t four;
    memcpy(&four, x, 4);
    return _mm512_set1_epi32(four);
}

/* R rows x C tiles (constants where it is called) over every block: R x C integer dots a
 * block, independent chains for the pipelines, each activation broadcast serving C tiles.
 * Register p of a pass holds inputs 4p..4p+3 of a tile's 16 columns (pack_codes). */
static inline __attribute__((always_inline)) void tile_group(const uint8_t *w, size_t stride,
                                                             const int C, int b0, int b1,
                                                             int bits, const spx_acts *a,
                                                             int row0, const int R,
                                                             float (*acc)[2 * TILE]) {
    const int block = a->block, nb = a->k / block, passes = block / QBLOCK;
    const size_t step = tile_bytes(bits, block), codes = step - TILE * 2;
    const size_t pass_bytes = (size_t)TILE * QBLOCK * bits / 8;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int8_t *x[4];
    for (int m = 0; m < R; m++) x[m] = a->q + (size_t)(row0 + m) * a->k;
    __m512 sum[4][2];
    for (int m = 0; m < R; m++)
        for (int c = 0; c < C; c++) sum[m][c] = _mm512_loadu_ps(acc[m] + TILE * c);
    w += b0 * step;
    for (int b = b0; b < b1; b++, w += step) {
        __m512i dot[4][2];
        for (int m = 0; m < R; m++)
            for (int c = 0; c < C; c++) dot[m][c] = _mm512_set1_epi32(a->zero[(row0 + m) * nb + b]);
        for (int pass = 0; pass < passes; pass++) {
            const int at = b * block + pass * QBLOCK;
            for (int p = 0; p < 8; p += 2) {
                __m512i lo[2], hi[2];
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
                    const __m512i first = broadcast4(xm + 4 * p), second = broadcast4(xm + 4 * p + 4);
                    for (int c = 0; c < C; c++) {
                        dot[m][c] = _mm512_dpbusd_epi32(dot[m][c], lo[c], first);
                        dot[m][c] = _mm512_dpbusd_epi32(dot[m][c], hi[c], second);
                    }
                }
            }
        }
        for (int c = 0; c < C; c++) {
            const __m512 ws =
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + c * stride + codes)));
            for (int m = 0; m < R; m++) {
                const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(a->scale[(row0 + m) * nb + b]));
                sum[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][c]), s, sum[m][c]);
            }
        }
    }
    for (int m = 0; m < R; m++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc[m] + TILE * c, sum[m][c]);
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
                                                           int bits, const spx_acts *a, int row0,
                                                           const int R, float (*acc)[2 * TILE],
                                                           int column) {
    const int block = a->block, nb = a->k / block, passes = block / QBLOCK;
    const size_t step = tile_bytes(bits, block), codes = step - TILE * 2;
    const size_t pass_bytes = (size_t)TILE * QBLOCK * bits / 8;
    for (int half = 0; half < 2; half++) {
        const uint8_t *w = w0 + b0 * step;
        __m256 sum[4];
        for (int m = 0; m < R; m++) sum[m] = _mm256_loadu_ps(acc[m] + column + 8 * half);
        for (int b = b0; b < b1; b++, w += step) {
            __m256i dots[4];
            for (int m = 0; m < R; m++) /* int8 computes sum q x directly: no zero term */
                dots[m] = _mm256_set1_epi32(bits == 4 ? a->zero[(row0 + m) * nb + b] : 0);
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
                                                             int bits, const spx_acts *a,
                                                             int row0, const int R,
                                                             float (*acc)[2 * TILE]) {
    for (int c = 0; c < C; c++) tile_one(w + c * stride, b0, b1, bits, a, row0, R, acc, TILE * c);
}
#endif

/* Up to ROWS rows of C (1 or 2) tiles. The blocks go in chunks whose weights fit the L1
 * cache, each chunk for every group of at most 4 rows (their sums in registers within it):
 * the weights come from memory once, later groups read them from L1. A row's sums still run
 * block after block in order, so its bits do not depend on the chunks or the groups. */
static void tile_rows(const uint8_t *w, size_t stride, int C, int blocks, int bits,
                      const spx_acts *a, int row0, int rows, float acc[ROWS][2 * TILE]) {
    const int chunk = (int)(16384 / (2 * tile_bytes(bits, a->block))) + 1;
    memset(acc, 0, sizeof(float) * ROWS * 2 * TILE);
    for (int b0 = 0; b0 < blocks; b0 += chunk) {
        const int b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
#define GROUP(R)                                                                          \
    do {                                                                                  \
        if (C == 2) tile_group(w, stride, 2, b0, b1, bits, a, row0 + m, R, acc + m);      \
        else tile_group(w, stride, 1, b0, b1, bits, a, row0 + m, R, acc + m);             \
    } while (0)
        int m = 0;
        for (; m + 4 <= rows; m += 4) GROUP(4);
        switch (rows - m) {
        case 3: GROUP(3); break;
        case 2: GROUP(2); break;
        case 1: GROUP(1); break;
        default: break;
        }
#undef GROUP
    }
}

/* This thread's share of the tiles (in pairs), every row. */
static void linear(const spx_linear *l, const spx_acts *a, int rows, float *out, int ldo,
                   int thread, int threads) {
    const int tiles = (l->n + TILE - 1) / TILE, blocks = l->k / l->block, pairs = (tiles + 1) / 2;
    const int first = 2 * (pairs * thread / threads);
    const int last = 2 * (pairs * (thread + 1) / threads) < tiles ? 2 * (pairs * (thread + 1) / threads) : tiles;
    const size_t stride = (size_t)blocks * tile_bytes(l->bits, l->block);
    float acc[ROWS][2 * TILE];
    for (int t = first; t < last; t += 2) {
        const int C = last - t >= 2 ? 2 : 1, n0 = t * TILE;
        const int width = l->n - n0 < C * TILE ? l->n - n0 : C * TILE;
        for (int row0 = 0; row0 < rows; row0 += ROWS) {
            const int count = rows - row0 < ROWS ? rows - row0 : ROWS;
            tile_rows(l->weight + t * stride, stride, C, blocks, l->bits, a, row0, count, acc);
            for (int m = 0; m < count; m++) {
                float *o = out + (size_t)(row0 + m) * ldo + n0;
                for (int j = 0; j < width; j++) o[j] = acc[m][j] + (l->bias ? l->bias[n0 + j] : 0.0f);
            }
        }
    }
}

/* ---- elementwise pieces ------------------------------------------------------------ */

static inline float reduce(const float lanes[LANES]) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += lanes[l];
    return s;
}

static inline float dot(const float *x, const float *y, int n) {
    float lanes[LANES] = {0};
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

/* exp on the floats softmax and SiLU need: Cephes' polynomial after x = n ln2 + r */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = floorf(x * 1.44269504f + 0.5f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    union { int32_t i; float f; } two = {.i = ((int32_t)n + 127) << 23};
    return p * two.f;
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

/* Queries of (sequence b, KV head g): all N rows x the heads sharing g. Each key and value
 * row is read once for all of them (the prefix is read once per forward, not per query). */
static void attend(const spx_model *m, const spx_step *s, int layer, int b, int g,
                   const float *qkv, int ldq, float *out, int ldo, float *scores) {
    const int D = m->head_dim, group = m->heads / m->kv_heads, L = s->slots, N = s->n;
    const float *keys = cache_rows(m, s, layer, 0, b, g), *values = cache_rows(m, s, layer, 1, b, g);
    for (int j = 0; j < L; j++) { /* scores[i * group + h][j] */
        const float *kj = keys + (size_t)j * D;
        for (int i = 0; i < N; i++) {
            if (!s->mask[((size_t)b * N + i) * L + j]) continue;
            const float *q = qkv + (size_t)(b * N + i) * ldq + (size_t)g * group * D;
            for (int h = 0; h < group; h++)
                scores[(size_t)(i * group + h) * L + j] = dot(q + h * D, kj, D) * m->attn_scale;
        }
    }
    for (int i = 0; i < N; i++) {
        const uint8_t *seen = s->mask + ((size_t)b * N + i) * L;
        for (int h = 0; h < group; h++) {
            float *p = scores + (size_t)(i * group + h) * L, top = -INFINITY, total = 0.0f;
            for (int j = 0; j < L; j++) if (seen[j]) top = larger(top, p[j]);
            for (int j = 0; j < L; j++) {
                p[j] = seen[j] ? exp_approx(p[j] - top) : 0.0f;
                total += p[j];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int j = 0; j < L; j++) p[j] *= inv;
            float *o = out + (size_t)(b * N + i) * ldo + (size_t)(g * group + h) * D;
            memset(o, 0, sizeof(float) * D);
        }
    }
    for (int j = 0; j < L; j++) {
        const float *vj = values + (size_t)j * D;
        for (int i = 0; i < N; i++) {
            if (!s->mask[((size_t)b * N + i) * L + j]) continue;
            for (int h = 0; h < group; h++) {
                const float p = scores[(size_t)(i * group + h) * L + j];
                float *o = out + (size_t)(b * N + i) * ldo + (size_t)(g * group + h) * D;
                for (int d = 0; d < D; d++) o[d] = fmaf(p, vj[d], o[d]);
            }
        }
    }
}

/* ---- the forward ------------------------------------------------------------------- */

static int widest_input(const spx_model *m) {
    const int attention = m->heads * m->head_dim;
    const int k = m->inter > m->hidden ? m->inter : m->hidden;
    return k > attention ? k : attention;
}

/* Bytes of scratch a forward of `rows` rows over `slots` slots needs. */
size_t spx_workspace_bytes(const spx_model *m, int rows, int slots) {
    const size_t d = m->hidden, q = (size_t)(m->heads + 2 * m->kv_heads) * m->head_dim;
    const size_t widest = (size_t)m->inter * 2 > q ? (size_t)m->inter * 2 : q;
    const size_t k_max = widest_input(m);
    const size_t floats = rows * (3 * d + widest + (size_t)m->heads * m->head_dim + 2 * m->rotary_half)
                          + (size_t)m->threads * rows * (m->heads / m->kv_heads) * slots
                          + (size_t)rows * (k_max / QBLOCK) * 2 + 64;
    return floats * 4 + rows * k_max + 256;
}

static int zero_point(const spx_linear *l) { return l->bits == 4 ? 8 : 128; }

/* This thread's rows of x [rows][ld] quantized as `l` reads them (its k inputs, its block). */
static void quantize_rows(const float *x, int rows, int ld, const spx_linear *l, spx_acts *a,
                          int thread, int threads) {
    const int k = l->k, nb = k / l->block;
    a->k = k;
    a->block = l->block;
    for (int r = thread; r < rows; r += threads)
        quantize_row(x + (size_t)r * ld, k, l->block, zero_point(l), a->q + (size_t)r * k,
                     a->scale + (size_t)r * nb, a->zero + (size_t)r * nb);
}

int spx_forward(const spx_model *m, int batch, int n, const int64_t *ids, const int64_t *pos,
                const uint8_t *mask, int slots, const int64_t *write_pos, float *kv,
                int64_t layer_stride, int64_t batch_stride, int cap, float *logits, float *taps,
                void *workspace) {
    const int rows = batch * n, d = m->hidden, D = m->head_dim, H = m->heads, G = m->kv_heads;
    const int qn = (H + 2 * G) * D, group = H / G, half = m->rotary_half;
    const int tap_width = m->tap_kind == 2 ? m->n_taps * d : d;
    float *h = workspace, *xn = h + (size_t)rows * d, *att = xn + (size_t)rows * d;
    float *wide = att + (size_t)rows * H * D, *scores = wide + (size_t)rows * (m->inter * 2 > qn ? m->inter * 2 : qn);
    float *rot = scores + (size_t)m->threads * rows * group * slots; /* [rows][cos | sin] */
    float *act_scale = rot + (size_t)rows * 2 * half;
    const int k_max = widest_input(m);
    int32_t *act_zero = (int32_t *)(act_scale + (size_t)rows * (k_max / QBLOCK));
    int8_t *act_q = (int8_t *)(act_zero + (size_t)rows * (k_max / QBLOCK));
    spx_acts acts = {act_q, act_scale, act_zero, d, QBLOCK};
    const spx_step step = {batch, n, slots, cap, mask, kv, layer_stride, batch_stride};

#pragma omp parallel num_threads(m->threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int r = t; r < rows; r += T) {
            for (int i = 0; i < d; i++) h[(size_t)r * d + i] = m->embed[(size_t)ids[r] * d + i] * m->embed_scale;
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
            for (int r = t; r < rows; r += T)
                rms_norm(h + (size_t)r * d, L->input_norm, d, m->eps, xn + (size_t)r * d);
#pragma omp barrier
            quantize_rows(xn, rows, d, &L->qkv, &acts, t, T);
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
                       scores + (size_t)t * rows * group * slots);
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
                for (int i = 0; i < m->inter; i++) g[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
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
        }
#pragma omp barrier
        quantize_rows(xn, rows, d, &m->lm_head, &acts, t, T);
#pragma omp barrier
        linear(&m->lm_head, &acts, rows, logits, m->vocab, t, T);
    }
    return 0;
}

/* The GEMM alone (tests, the kernel benchmark): out [rows][n] = x [rows][k] . w. */
int spx_linear_forward(const spx_linear *l, int rows, const float *x, float *out, void *workspace,
                       int threads) {
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
