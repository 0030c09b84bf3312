/* The portable kernel's CPU loops (kernels/torch_kernel.py), as plain C on raw buffers.
 *
 * setup.py builds this file with the package (lightning_shardrec/kernels/_rows.<suffix>) and
 * lightning_shardrec/kernels/native.py loads it with ctypes; kernels/row_updates.py and torch_kernel.py call
 * it for fp32 CPU tensors after checking dtypes, shapes and strides; the index values that address memory
 * (ids, rows) are checked here, in a pass before any write. Where the library is missing the same functions
 * run as tensor ops (row_updates.py), to within fp32 rounding (the reductions' order differs); each path is
 * deterministic, so a sharded run equals the one-process run on the same machine bit for bit.
 * One thread, no OpenMP (a rank owns one core).
 *
 * shardrec_bag_forward: SUM-pooled lookup written straight into the [B, F*D] output.
 *   Bag k = f * B + b (key-major, as a KJT's offsets) sums rows base[f] + ids[i], i in [offsets[k],
 *   offsets[k+1]), in id order (times psw[i] when psw != NULL), into out + b * ldo + f * D. Every id is
 *   checked against its feature's rows[f] before it is read; returns -1, or the index of the first bad id
 *   (the output is then partly written), or BAD_BAG_OFFSETS for offsets that fall outside the n ids or
 *   decrease (nothing read). flat != NULL: base[f] + ids[i] -> flat[i] (backward's rows).
 *
 * shardrec_group_rows: the unique rows of a batch's ids and, per row, its ids in batch order.
 *   A stable LSD radix sort of ids (11 bits a pass; ids < nrows <= 2^31). Writes rows[U] (ascending),
 *   starts[U + 1] and, per sorted id k, pos[k] (its index in ids) and src[k] (the element offset of its
 *   gradient row: offsets == NULL: pos * ldg; else its bag k' = f * B + b: b * ldg + f * fstride).
 *   Returns U, or -2 - i for the first id i outside [0, nrows), or BAD_OFFSETS (nothing written).
 *
 * shardrec_sum_rows: out[u] = sum over k in [starts[u], starts[u+1]) of grad[src[k] .. + D] (* psw[pos[k]]),
 *   in batch order: acc = 0, acc += g (as embedding_bag's sum; with weights: acc += w * g, two roundings).
 *
 * shardrec_apply_rule: one optimizer step on unique rows[U] of weight [R, D] with their summed gradient
 *   grad [U, D] (contiguous) and state s1, s2 (NULL where the rule has none): the formulas of row_updates.py's
 *   rules (torch.optim's SGD, Adagrad, Adam/AdamW with bias1/2 = 1 - beta1/2 ** step; row-wise Adagrad as
 *   fbgemm's). Returns -1, or the index of the first row outside [0, nrows) (nothing written).
 *
 * shardrec_update_rows: shardrec_sum_rows and shardrec_apply_rule in one pass, without the [U, D] sums (the
 *   same results bit for bit).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SHARDREC_SOURCE
#define SHARDREC_SOURCE "unknown" /* setup.py defines it: the first 16 hex digits of this file's sha256 */
#endif

#define BAD_OFFSETS (-1) /* shardrec_group_rows: offsets not non-decreasing within [0, n] */
#define NO_MEMORY (-3)   /* a scratch allocation failed */
#define BAD_BAG_OFFSETS (-4) /* shardrec_bag_forward: offsets not non-decreasing within [0, n] (nothing read) */
#define MAX_DIM 1024     /* widest row the loops take (native.py sends wider ones to the tensor ops) */

#define RULE_SGD 0
#define RULE_ADAGRAD 1
#define RULE_ROWWISE_ADAGRAD 2
#define RULE_ADAM 3
#define RULE_ADAMW 4

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_R(p) __builtin_prefetch((p), 0, 1)
#define PREFETCH_W(p) __builtin_prefetch((p), 1, 1)
#else
#define PREFETCH_R(p) ((void)0)
#define PREFETCH_W(p) ((void)0)
#endif
#define AHEAD 8 /* rows ahead: they are scattered, so ask for later ones while this one is summed */

/* The hot loops also in an AVX2 build, chosen at load time where the CPU has it (GCC on x86-64 Linux): the
 * same additions and products lane by lane (no FMA: -ffp-contract=off), so the same bits, 10-20% less CPU. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

/* The source this library was built from: native.py refuses a library built from another native_rows.c. */
const char *shardrec_rows_source(void) { return SHARDREC_SOURCE; }

HOT int64_t shardrec_bag_forward(int64_t nfeat, int64_t batch, const int64_t *offsets, int64_t n, const int64_t *ids,
                             const int64_t *base, const int64_t *rows, const float *weight, int64_t ldw, int64_t dim,
                             const float *psw, float *out, int64_t ldo, int64_t *flat) {
    if (dim > MAX_DIM) return -2;
    if (offsets[0] < 0 || offsets[nfeat * batch] > n) return BAD_BAG_OFFSETS;
    for (int64_t k = 0; k < nfeat * batch; k++)
        if (offsets[k + 1] < offsets[k]) return BAD_BAG_OFFSETS;
    float acc[MAX_DIM];
    for (int64_t f = 0; f < nfeat; f++) {
        const int64_t lim = rows[f], off = base[f];
        for (int64_t b = 0; b < batch; b++) {
            const int64_t k = f * batch + b, lo = offsets[k], hi = offsets[k + 1], end = offsets[(f + 1) * batch];
            for (int64_t j = 0; j < dim; j++) acc[j] = 0.0f;
            for (int64_t i = lo; i < hi; i++) {
                const int64_t id = ids[i];
                if (id < 0 || id >= lim) return i;
                if (i + AHEAD < end) { /* this feature's later ids, in later bags too */
                    const int64_t nx = ids[i + AHEAD];
                    if (nx >= 0 && nx < lim) PREFETCH_R(weight + (off + nx) * ldw);
                }
                const float *src = weight + (off + id) * ldw;
                if (psw == NULL) {
                    for (int64_t j = 0; j < dim; j++) acc[j] += src[j];
                } else {
                    const float s = psw[i];
                    for (int64_t j = 0; j < dim; j++) acc[j] += s * src[j];
                }
                if (flat != NULL) flat[i] = off + id;
            }
            memcpy(out + b * ldo + f * dim, acc, (size_t)dim * sizeof(float));
        }
    }
    return -1;
}

int64_t shardrec_group_rows(int64_t n, const int64_t *ids, int64_t nrows, const int64_t *offsets, int64_t nbags,
                            int64_t batch, int64_t ldg, int64_t fstride, int64_t *rows, int64_t *starts,
                            int64_t *src, int64_t *pos) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= nrows) return -2 - i;
    if (offsets != NULL) {
        if (offsets[0] != 0 || offsets[nbags] != n) return BAD_OFFSETS;
        for (int64_t k = 0; k < nbags; k++)
            if (offsets[k + 1] < offsets[k]) return BAD_OFFSETS;
    }
    if (n == 0) {
        starts[0] = 0;
        return 0;
    }
    uint32_t *key = malloc((size_t)n * 2 * sizeof(uint32_t));
    uint32_t *idx = malloc((size_t)n * 2 * sizeof(uint32_t));
    if (key == NULL || idx == NULL) {
        free(key);
        free(idx);
        return NO_MEMORY;
    }
    uint32_t *key2 = key + n, *idx2 = idx + n;
    for (int64_t i = 0; i < n; i++) {
        key[i] = (uint32_t)ids[i];
        idx[i] = (uint32_t)i;
    }
    int bits = 0;
    while (bits < 32 && ((int64_t)1 << bits) < nrows) bits++;
    enum { DIGIT = 11, BUCKETS = 1 << DIGIT };
    for (int shift = 0; shift < bits; shift += DIGIT) {
        int64_t count[BUCKETS + 1];
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < n; i++) count[((key[i] >> shift) & (BUCKETS - 1)) + 1]++;
        for (int d = 0; d < BUCKETS; d++) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = count[(key[i] >> shift) & (BUCKETS - 1)]++;
            key2[at] = key[i];
            idx2[at] = idx[i];
        }
        uint32_t *t = key;
        key = key2;
        key2 = t;
        t = idx;
        idx = idx2;
        idx2 = t;
    }
    /* per id its bag (offsets given) as a gradient element offset; written in sorted order */
    int64_t u = 0;
    if (offsets != NULL) {
        int64_t *bag_off = malloc((size_t)n * sizeof(int64_t));
        if (bag_off == NULL) {
            free(key < key2 ? key : key2);
            free(idx < idx2 ? idx : idx2);
            return NO_MEMORY;
        }
        for (int64_t k = 0; k < nbags; k++) {
            const int64_t at = (k % batch) * ldg + (k / batch) * fstride;
            for (int64_t i = offsets[k]; i < offsets[k + 1]; i++) bag_off[i] = at;
        }
        for (int64_t k = 0; k < n; k++) src[k] = bag_off[idx[k]];
        free(bag_off);
    } else {
        for (int64_t k = 0; k < n; k++) src[k] = (int64_t)idx[k] * ldg;
    }
    for (int64_t k = 0; k < n; k++) {
        pos[k] = idx[k];
        if (k == 0 || key[k] != key[k - 1]) {
            rows[u] = key[k];
            starts[u++] = k;
        }
    }
    starts[u] = n;
    free(key < key2 ? key : key2);
    free(idx < idx2 ? idx : idx2);
    return u;
}

/* out[0:dim] = the sum of group u's gradient rows, in batch order */
static inline void sum_group(int64_t lo, int64_t hi, const int64_t *src, const int64_t *pos, const float *grad,
                             const float *psw, int64_t dim, float *out) {
    for (int64_t j = 0; j < dim; j++) out[j] = 0.0f;
    for (int64_t k = lo; k < hi; k++) {
        const float *g = grad + src[k];
        if (psw == NULL) {
            for (int64_t j = 0; j < dim; j++) out[j] += g[j];
        } else {
            const float s = psw[pos[k]];
            for (int64_t j = 0; j < dim; j++) out[j] += s * g[j];
        }
    }
}

HOT void shardrec_sum_rows(int64_t nu, const int64_t *starts, const int64_t *src, const int64_t *pos, const float *grad,
                       const float *psw, int64_t dim, float *out) {
    for (int64_t u = 0; u < nu; u++) {
        if (u + AHEAD < nu) PREFETCH_R(grad + src[starts[u + AHEAD]]);
        sum_group(starts[u], starts[u + 1], src, pos, grad, psw, dim, out + u * dim);
    }
}

/* sum of squares in a fixed order: 8 interleaved partial sums, combined pairwise */
static inline float sum_squares(const float *g, int64_t dim) {
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8)
        for (int l = 0; l < 8; l++) p[l] += g[j + l] * g[j + l];
    for (int l = 0; j < dim; j++, l++) p[l] += g[j] * g[j];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

typedef struct {
    int rule;
    int64_t dim, ldw, lds1, lds2;
    float *weight, *s1, *s2;
    float lr, eps, wd, b1, b2, om1, om2, bias2s, adam_lr, decay;
} Rule;

static Rule make_rule(int rule, int64_t dim, float *weight, int64_t ldw, float *s1, int64_t lds1, float *s2,
                      int64_t lds2, double lr, double eps, double beta1, double beta2, double wd, double bias1,
                      double bias2) {
    Rule r;
    r.rule = rule, r.dim = dim, r.ldw = ldw, r.lds1 = lds1, r.lds2 = lds2, r.weight = weight, r.s1 = s1, r.s2 = s2;
    r.lr = (float)lr, r.eps = (float)eps, r.wd = (float)wd, r.b1 = (float)beta1, r.b2 = (float)beta2;
    r.om1 = (float)(1.0 - beta1), r.om2 = (float)(1.0 - beta2);
    r.bias2s = (float)sqrt(bias2), r.adam_lr = (float)(lr / bias1); /* Adam's 1 - beta ** step */
    r.decay = (float)(1.0 - lr * wd);
    return r;
}

static inline void prefetch_row(const Rule *r, int64_t row) {
    PREFETCH_W(r->weight + row * r->ldw);
    if (r->s1 != NULL) PREFETCH_W(r->s1 + row * r->lds1);
    if (r->s2 != NULL) PREFETCH_W(r->s2 + row * r->lds2);
}

/* one step of the rule on one row with its summed gradient g (buf: dim floats of scratch) */
static inline void rule_row(const Rule *r, int64_t row, const float *g, float *buf) {
    const int64_t dim = r->dim;
    float *w = r->weight + row * r->ldw;
    if (r->wd != 0.0f && r->rule != RULE_ADAMW) { /* L2: g + wd * w */
        for (int64_t j = 0; j < dim; j++) buf[j] = g[j] + r->wd * w[j];
        g = buf;
    }
    switch (r->rule) {
    case RULE_SGD:
        for (int64_t j = 0; j < dim; j++) w[j] = w[j] - r->lr * g[j];
        break;
    case RULE_ADAGRAD: {
        float *s = r->s1 + row * r->lds1;
        for (int64_t j = 0; j < dim; j++) {
            s[j] += g[j] * g[j];
            w[j] -= r->lr * (g[j] / (sqrtf(s[j]) + r->eps));
        }
        break;
    }
    case RULE_ROWWISE_ADAGRAD: { /* fbgemm's: the row's mean square gradient, one state value a row */
        float *s = r->s1 + row;
        const float sum = *s + sum_squares(g, dim) / (float)dim;
        *s = sum;
        const float scale = (1.0f / (sqrtf(sum) + r->eps)) * r->lr;
        for (int64_t j = 0; j < dim; j++) w[j] = w[j] - g[j] * scale;
        break;
    }
    default: { /* Adam / AdamW (lazy: only these rows) */
        float *m = r->s1 + row * r->lds1, *v = r->s2 + row * r->lds2;
        if (r->rule == RULE_ADAMW && r->wd != 0.0f)
            for (int64_t j = 0; j < dim; j++) w[j] *= r->decay;
        for (int64_t j = 0; j < dim; j++) {
            m[j] = m[j] * r->b1 + r->om1 * g[j];
            v[j] = v[j] * r->b2 + r->om2 * (g[j] * g[j]);
            w[j] -= r->adam_lr * (m[j] / (sqrtf(v[j]) / r->bias2s + r->eps));
        }
    }
    }
}

HOT int64_t shardrec_apply_rule(int rule, int64_t nu, const int64_t *rows, int64_t nrows, const float *grad, int64_t dim,
                            float *weight, int64_t ldw, float *s1, int64_t lds1, float *s2, int64_t lds2, double lr,
                            double eps, double beta1, double beta2, double wd, double bias1, double bias2) {
    if (dim > MAX_DIM) return -2;
    for (int64_t u = 0; u < nu; u++)
        if (rows[u] < 0 || rows[u] >= nrows) return u;
    float buf[MAX_DIM];
    const Rule r = make_rule(rule, dim, weight, ldw, s1, lds1, s2, lds2, lr, eps, beta1, beta2, wd, bias1, bias2);
    for (int64_t u = 0; u < nu; u++) {
        if (u + AHEAD < nu) prefetch_row(&r, rows[u + AHEAD]);
        rule_row(&r, rows[u], grad + u * dim, buf);
    }
    return -1;
}

HOT int64_t shardrec_update_rows(int rule, int64_t nu, const int64_t *rows, int64_t nrows, const int64_t *starts,
                             const int64_t *src, const int64_t *pos, const float *grad, const float *psw, int64_t dim,
                             float *weight, int64_t ldw, float *s1, int64_t lds1, float *s2, int64_t lds2, double lr,
                             double eps, double beta1, double beta2, double wd, double bias1, double bias2) {
    if (dim > MAX_DIM) return -2;
    for (int64_t u = 0; u < nu; u++)
        if (rows[u] < 0 || rows[u] >= nrows) return u;
    float acc[MAX_DIM], buf[MAX_DIM];
    const Rule r = make_rule(rule, dim, weight, ldw, s1, lds1, s2, lds2, lr, eps, beta1, beta2, wd, bias1, bias2);
    for (int64_t u = 0; u < nu; u++) {
        if (u + AHEAD < nu) {
            prefetch_row(&r, rows[u + AHEAD]);
            PREFETCH_R(grad + src[starts[u + AHEAD]]);
        }
        sum_group(starts[u], starts[u + 1], src, pos, grad, psw, dim, acc);
        rule_row(&r, rows[u], acc, buf);
    }
    return -1;
}
