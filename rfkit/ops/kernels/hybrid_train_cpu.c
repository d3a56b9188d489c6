/* Training forward and backward of the window mixers (rfkit.models.window: sink + recent softmax
 * attention; rfkit.models.hybrid: plus the linear-attention state of the tokens that left the
 * window) on the CPU, for one block of L tokens that starts from an empty state (every training
 * and attention-transfer forward). The PyTorch tiled path is the twin: the tests compare outputs and
 * every gradient. float32, every array contiguous.
 *
 *   q      : (batch, hq, L, hd)   rotated queries of the replaced heads (unscaled)
 *   k, v   : (batch, hkv, L, hd)  rotated keys and values
 *   fmap   : (hkv, hd, f / 2)     the feature map (NULL: plain window attention, no state)
 *   g      : (hq,)                the old tokens' weight relu(gate) * exp(log_scale)
 *   decay  : (hkv,)               gamma per KV head, or NULL (no decay)
 *   kvq    : (hq,)                KV head of every query head
 *   out    : (batch, L, hq, hd)   the layout the layer's output projection reads
 *   m, D   : (batch, hq, L)       saved for the backward: each query's highest window score and
 *                                 its normaliser Z + c zl
 *
 * Query i attends to the sink tokens j < min(sink, i + 1) and to the recent tokens
 * max(sink, i - window + 1) .. i; the token j = i - window (when j >= sink) is folded into the
 * state S = sum gamma^(i - window - j) phi(k_j) v_j^T, z likewise, before query i reads it:
 *
 *   y = (A + c a) / (Z + c zl),  c = g exp(-sharp max(m, -60)),  a = phi(q) S,  zl = phi(q) . z
 *
 * with A, Z the window's sums of exp(s - m) v and exp(s - m), s = scaling q . k.
 *
 * The backward runs per (batch, KV head) row in two sweeps. Forward in i it rebuilds the state,
 * recomputes each query's window probabilities from the saved m and turns dy into dq, the window
 * keys' dk and dv, dg and, through c's dependence on m, the gradient that reaches the highest score;
 * it keeps phi(q), da = c dN and dzl = c dD per query. Backward in i it runs the adjoint of the
 * state, R_i = sum_{i' >= i} gamma^(i' - i) phi(q_i') da_i'^T (and r for z), which gives every folded
 * key's dphi(k) and dv, and T_i = sum_{i' > i} (i' - i) gamma^(i' - i) phi(q_i') da_i'^T for d log gamma.
 * The feature map's gradient comes back as the gradients of the projections x W (the caller
 * multiplies), d log gamma per row and dg per batch element (the caller sums them). Rows run in parallel on OpenMP threads when the library has OpenMP.
 * Each function returns 0, or -1 when a work buffer cannot be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "phi.h"

#define RF_MIN_MAX_SCORE (-60.0f)

typedef struct {
    const float *q, *k, *v, *fmap, *g, *decay;
    const int64_t *kvq;
    int64_t B, hq, hkv, hd, L, sink, window, f;
    float scaling, sharp;
} train_args;

/* The window of query i: sink tokens 0 .. nsink - 1 and recent tokens first .. i. */
static inline void window_of(const train_args *a, int64_t i, int64_t *nsink, int64_t *first, int64_t *nw) {
    *nsink = i + 1 < a->sink ? i + 1 : a->sink;
    const int64_t lo = i - a->window + 1;
    *first = lo > a->sink ? lo : a->sink;
    *nw = *first <= i ? i - *first + 1 : 0;
}

#define RF_INLINE static inline __attribute__((always_inline))

/* Sixteen floats as one vector value (GCC/Clang vector extension; the compiler maps it to the
 * machine's registers: one AVX-512 register, two AVX2 ones, ...). The window loops below keep a
 * query, an output or a gradient row of hd channels in hd / 16 of them across all the window's
 * keys when hd is a multiple of 16 up to 128 (SmolLM2 and Llama: 64, 128); the compiler does not
 * keep a float array in registers across a loop by itself. Other widths take scalar loops. */
typedef float rf_v16 __attribute__((vector_size(64)));
#define RF_MAXV 8

RF_INLINE rf_v16 ld16(const float *p) {
    rf_v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

RF_INLINE void st16(float *p, rf_v16 v) { memcpy(p, &v, sizeof v); }

RF_INLINE float hsum16(rf_v16 v) {
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) s += v[j];
    return s;
}

RF_INLINE int vectorised(int64_t hd) { return hd % 16 == 0 && hd <= 16 * RF_MAXV; }

/* A row of nv * 16 floats into nv vectors, and back. */
RF_INLINE void ld_row(rf_v16 *out, const float *p, int64_t nv) {
    for (int64_t c = 0; c < nv; ++c) out[c] = ld16(p + 16 * c);
}

RF_INLINE void st_row(float *p, const rf_v16 *v, int64_t nv) {
    for (int64_t c = 0; c < nv; ++c) st16(p + 16 * c, v[c]);
}

/* The dot product of a row held in vectors with a row in memory. */
RF_INLINE float dot_row(const rf_v16 *a, const float *p, int64_t nv) {
    rf_v16 acc = a[0] * ld16(p);
    for (int64_t c = 1; c < nv; ++c) acc += a[c] * ld16(p + 16 * c);
    return hsum16(acc);
}

static inline int64_t key_index(int64_t t, int64_t nsink, int64_t first) { return t < nsink ? t : first + t - nsink; }

/* Scores of query qh (unscaled) against the window's keys, into s[0 .. nsink + nw); returns the
 * highest and its position in *arg (the first of equal ones). */
RF_INLINE float window_scores(const train_args *a, const float *qh, const float *kr, int64_t nsink, int64_t first,
                              int64_t nw, float *s, int64_t *arg, const int64_t hd) {
    float m = -FLT_MAX;
    *arg = 0;
    rf_v16 qv[RF_MAXV];
    const int64_t nv = vectorised(hd) ? hd / 16 : 0;
    ld_row(qv, qh, nv);
    for (int64_t t = 0; t < nsink + nw; ++t) {
        const float *kt = kr + key_index(t, nsink, first) * hd;
        float dot = 0.0f;
        if (nv) {
            dot = dot_row(qv, kt, nv);
        } else {
            for (int64_t d = 0; d < hd; ++d) dot += qh[d] * kt[d];
        }
        s[t] = dot * a->scaling;
        if (s[t] > m) {
            m = s[t];
            *arg = t;
        }
    }
    return m;
}

/* acc (hd, in place) += sum over the window's values of e[t] v_t. */
RF_INLINE void weighted_values(const float *e, const float *vr, int64_t nsink, int64_t first, int64_t nw, float *acc,
                               const int64_t hd) {
    if (vectorised(hd)) {
        rf_v16 av[RF_MAXV];
        const int64_t nv = hd / 16;
        ld_row(av, acc, nv);
        for (int64_t t = 0; t < nsink + nw; ++t) {
            const float *vt = vr + key_index(t, nsink, first) * hd;
            for (int64_t c = 0; c < nv; ++c) av[c] += e[t] * ld16(vt + 16 * c);
        }
        st_row(acc, av, nv);
        return;
    }
    for (int64_t t = 0; t < nsink + nw; ++t) {
        const float *vt = vr + key_index(t, nsink, first) * hd;
        for (int64_t d = 0; d < hd; ++d) acc[d] += e[t] * vt[d];
    }
}

/* The window's share of the backward for one query, given its probabilities p (in place: ds),
 * dN = dy / D and dD: dv_t += p_t dN, ds_t = p_t (dN . v_t + dD); returns -sum ds_t (m's gradient
 * through the window sums). */
RF_INLINE float window_value_grads(float *p, const float *dN, float dD, const float *vr, float *dvr, int64_t nsink,
                                   int64_t first, int64_t nw, const int64_t hd) {
    float dm = 0.0f;
    rf_v16 nvv[RF_MAXV];
    const int64_t nv = vectorised(hd) ? hd / 16 : 0;
    ld_row(nvv, dN, nv);
    for (int64_t t = 0; t < nsink + nw; ++t) {
        const int64_t j = key_index(t, nsink, first);
        const float pt = p[t], *vt = vr + j * hd;
        float *dvt = dvr + j * hd, dot = 0.0f;
        if (nv) {
            dot = dot_row(nvv, vt, nv);
            for (int64_t c = 0; c < nv; ++c) st16(dvt + 16 * c, ld16(dvt + 16 * c) + pt * nvv[c]);
        } else {
            for (int64_t d = 0; d < hd; ++d) {
                dot += dN[d] * vt[d];
                dvt[d] += pt * dN[d];
            }
        }
        p[t] = pt * (dot + dD);
        dm -= p[t];
    }
    return dm;
}

/* The scores' gradients ds (already scaled by the softmax scaling w_t = scaling ds_t): dq += sum_t
 * w_t k_t, dk_t += w_t q. */
RF_INLINE void window_key_grads(const float *ds, float scaling, const float *qh, const float *kr, float *dkr,
                                float *dqh, int64_t nsink, int64_t first, int64_t nw, const int64_t hd) {
    if (vectorised(hd)) {
        rf_v16 qv[RF_MAXV], av[RF_MAXV];
        const int64_t nv = hd / 16;
        ld_row(qv, qh, nv);
        ld_row(av, dqh, nv);
        for (int64_t t = 0; t < nsink + nw; ++t) {
            const int64_t j = key_index(t, nsink, first);
            const float w = ds[t] * scaling, *kt = kr + j * hd;
            float *dkt = dkr + j * hd;
            for (int64_t c = 0; c < nv; ++c) {
                av[c] += w * ld16(kt + 16 * c);
                st16(dkt + 16 * c, ld16(dkt + 16 * c) + w * qv[c]);
            }
        }
        st_row(dqh, av, nv);
        return;
    }
    for (int64_t t = 0; t < nsink + nw; ++t) {
        const int64_t j = key_index(t, nsink, first);
        const float w = ds[t] * scaling, *kt = kr + j * hd;
        float *dkt = dkr + j * hd;
        for (int64_t d = 0; d < hd; ++d) {
            dqh[d] += w * kt[d];
            dkt[d] += w * qh[d];
        }
    }
}

/* out[x] = M_x . v for the n rows of M (hd floats each), v kept in registers. */
RF_INLINE void rows_dot(const float *M, int64_t n, const float *v, float *out, const int64_t hd) {
    if (vectorised(hd)) {
        rf_v16 vv[RF_MAXV];
        const int64_t nv = hd / 16;
        ld_row(vv, v, nv);
        for (int64_t x = 0; x < n; ++x) out[x] = dot_row(vv, M + x * hd, nv);
        return;
    }
    for (int64_t x = 0; x < n; ++x) {
        float acc = 0.0f;
        for (int64_t d = 0; d < hd; ++d) acc += M[x * hd + d] * v[d];
        out[x] = acc;
    }
}

/* M_x += w[x] v for the n rows of M, v kept in registers. */
RF_INLINE void rows_add(float *M, int64_t n, const float *w, const float *v, const int64_t hd) {
    if (vectorised(hd)) {
        rf_v16 vv[RF_MAXV];
        const int64_t nv = hd / 16;
        ld_row(vv, v, nv);
        for (int64_t x = 0; x < n; ++x)
            for (int64_t c = 0; c < nv; ++c) st16(M + x * hd + 16 * c, ld16(M + x * hd + 16 * c) + w[x] * vv[c]);
        return;
    }
    for (int64_t x = 0; x < n; ++x)
        for (int64_t d = 0; d < hd; ++d) M[x * hd + d] += w[x] * v[d];
}

/* For the key folded at this step: dphi[x] = r[x] + R_x . v, tx[x] = t[x] + T_x . v (both n rows),
 * and dv += sum_x phi[x] R_x; v and dv kept in registers. */
RF_INLINE void adjoint_reads(const float *R, const float *T, const float *r, const float *t, const float *phi, int64_t n,
                             const float *v, float *dv, float *dphi, float *tx, const int64_t hd) {
    if (vectorised(hd)) {
        rf_v16 vv[RF_MAXV], dvv[RF_MAXV];
        const int64_t nv = hd / 16;
        ld_row(vv, v, nv);
        ld_row(dvv, dv, nv);
        for (int64_t x = 0; x < n; ++x) {
            const float *Rx = R + x * hd, *Tx = T + x * hd;
            rf_v16 a = vv[0] * ld16(Rx), b = vv[0] * ld16(Tx);
            dvv[0] += phi[x] * ld16(Rx);
            for (int64_t c = 1; c < nv; ++c) {
                const rf_v16 rc = ld16(Rx + 16 * c);
                a += vv[c] * rc;
                b += vv[c] * ld16(Tx + 16 * c);
                dvv[c] += phi[x] * rc;
            }
            dphi[x] = r[x] + hsum16(a);
            tx[x] = t[x] + hsum16(b);
        }
        st_row(dv, dvv, nv);
        return;
    }
    for (int64_t x = 0; x < n; ++x) {
        float a = r[x], b = t[x];
        for (int64_t d = 0; d < hd; ++d) {
            a += R[x * hd + d] * v[d];
            b += T[x * hd + d] * v[d];
            dv[d] += phi[x] * R[x * hd + d];
        }
        dphi[x] = a;
        tx[x] = b;
    }
}

/* The state ages by one token, then folds token j = i - window when it is past the sink. */
RF_INLINE void fold(const train_args *a, int64_t i, int64_t kv, const float *kr, const float *vr, const float *fm,
                    float *S, float *z, float *phi, const int64_t hd) {
    const int64_t f = a->f;
    if (a->decay) {
        const float gm = a->decay[kv];
        for (int64_t j = 0; j < f * hd; ++j) S[j] *= gm;
        for (int64_t j = 0; j < f; ++j) z[j] *= gm;
    }
    const int64_t j = i - a->window;
    if (j < a->sink) return;
    feature(kr + j * hd, fm, hd, f / 2, phi);
    for (int64_t r = 0; r < f; ++r) z[r] += phi[r];
    rows_add(S, f, phi, vr + j * hd, hd);
}

RF_INLINE int train_fwd_body(const train_args *a, int64_t row, float *out, float *m_out, float *D_out, const int64_t hd) {
    const int64_t b = row / a->hkv, kv = row % a->hkv, L = a->L, f = a->f, hq = a->hq;
    const float *kr = a->k + row * L * hd, *vr = a->v + row * L * hd;
    const float *fm = a->fmap ? a->fmap + kv * hd * (f / 2) : NULL;
    float *buf = (float *)calloc((size_t)(f * hd + 2 * f + a->sink + a->window + hd + 1), sizeof(float));
    if (!buf) return -1;
    float *S = buf, *z = S + f * hd, *phi = z + f, *s = phi + f, *acc = s + a->sink + a->window;
    for (int64_t i = 0; i < L; ++i) {
        if (fm) fold(a, i, kv, kr, vr, fm, S, z, phi, hd);
        int64_t nsink, first, nw, arg;
        window_of(a, i, &nsink, &first, &nw);
        for (int64_t h = 0; h < hq; ++h) {
            if (a->kvq[h] != kv) continue;
            const float *qh = a->q + ((b * hq + h) * L + i) * hd;
            const float m = window_scores(a, qh, kr, nsink, first, nw, s, &arg, hd);
            float Z = 0.0f;
            for (int64_t t = 0; t < nsink + nw; ++t) { /* apart from the sums below: one vector expf for many keys */
                s[t] = expf(s[t] - m);
                Z += s[t];
            }
            for (int64_t d = 0; d < hd; ++d) acc[d] = 0.0f;
            weighted_values(s, vr, nsink, first, nw, acc, hd);
            if (fm) {
                const float c = a->g[h] * expf(-a->sharp * (m > RF_MIN_MAX_SCORE ? m : RF_MIN_MAX_SCORE));
                feature(qh, fm, hd, f / 2, phi);
                float zl = 0.0f;
                for (int64_t r = 0; r < f; ++r) {
                    zl += phi[r] * z[r];
                    phi[r] *= c;
                }
                weighted_values(phi, S, f, 0, 0, acc, hd); /* acc += c phi^T S: S's f rows as "keys" */
                Z += c * zl;
            }
            float *y = out + ((b * L + i) * hq + h) * hd;
            const float inv = 1.0f / Z;
            for (int64_t d = 0; d < hd; ++d) y[d] = acc[d] * inv;
            m_out[(b * hq + h) * L + i] = m;
            D_out[(b * hq + h) * L + i] = Z;
        }
    }
    free(buf);
    return 0;
}

/* phi = [softmax(p), softmax(-p)], p = x W: dp from dphi (half entries). */
static inline void feature_grad(const float *phi, const float *dphi, int64_t half, float *dp) {
    float s1 = 0.0f, s2 = 0.0f;
    for (int64_t j = 0; j < half; ++j) {
        s1 += phi[j] * dphi[j];
        s2 += phi[half + j] * dphi[half + j];
    }
    for (int64_t j = 0; j < half; ++j) dp[j] = phi[j] * (dphi[j] - s1) - phi[half + j] * (dphi[half + j] - s2);
}

RF_INLINE int train_bwd_body(const train_args *a, int64_t row, const float *out, const float *m_in, const float *D_in,
                            const float *dout, float *dq, float *dk, float *dv, float *dpq, float *dpk, float *dg,
                            float *dlog_gamma, const int64_t hd) {
    const int64_t b = row / a->hkv, kv = row % a->hkv, L = a->L, f = a->f, hq = a->hq, half = f / 2;
    const float *kr = a->k + row * L * hd, *vr = a->v + row * L * hd;
    float *dkr = dk + row * L * hd, *dvr = dv + row * L * hd;
    const float *fm = a->fmap ? a->fmap + kv * hd * half : NULL;
    int64_t rep = 0;
    for (int64_t h = 0; h < hq; ++h) rep += a->kvq[h] == kv;
    const int64_t nwin = a->sink + a->window;
    /* state S, z (and in the second sweep R, r, T, t), scratch, and per query and head phi(q), da, dzl */
    const size_t scratch = (size_t)(3 * f * hd + 6 * f + nwin + hd);
    const size_t keep = fm ? (size_t)(L * rep * (f + hd + 1)) : 0;
    float *buf = (float *)calloc(scratch + keep, sizeof(float));
    if (!buf) return -1;
    float *restrict S = buf, *restrict z = S + f * hd, *restrict R = z + f, *restrict r = R + f * hd;
    float *restrict T = r + f, *restrict t_ = T + f * hd;
    float *restrict s = t_ + f, *restrict dN = s + nwin;
    float *restrict phi = dN + hd, *restrict dphi = phi + f, *restrict tx = dphi + f;
    float *restrict kphi = buf + scratch, *restrict kda = kphi + L * rep * f, *restrict kdzl = kda + L * rep * hd;
    for (int64_t i = 0; i < L; ++i) {
        if (fm) fold(a, i, kv, kr, vr, fm, S, z, phi, hd);
        int64_t nsink, first, nw, arg, slot = 0;
        window_of(a, i, &nsink, &first, &nw);
        for (int64_t h = 0; h < hq; ++h) {
            if (a->kvq[h] != kv) continue;
            const int64_t qi = (b * hq + h) * L + i;
            const float *restrict qh = a->q + qi * hd, *restrict y = out + ((b * L + i) * hq + h) * hd;
            const float *restrict dy = dout + ((b * L + i) * hq + h) * hd;
            float *restrict dqh = dq + qi * hd;
            const float m = m_in[qi], D = D_in[qi];
            float dD = 0.0f;
            for (int64_t d = 0; d < hd; ++d) {
                dN[d] = dy[d] / D;
                dD -= dy[d] * y[d];
            }
            dD /= D;
            window_scores(a, qh, kr, nsink, first, nw, s, &arg, hd);
            float dm = 0.0f;
            for (int64_t t = 0; t < nsink + nw; ++t) s[t] = expf(s[t] - m); /* vectorised: the probabilities */
            dm += window_value_grads(s, dN, dD, vr, dvr, nsink, first, nw, hd); /* s: now ds */
            if (fm) {
                const float mc = m > RF_MIN_MAX_SCORE ? m : RF_MIN_MAX_SCORE, e = expf(-a->sharp * mc), c = a->g[h] * e;
                feature(qh, fm, hd, half, phi);
                rows_dot(S, f, dN, dphi, hd); /* dphi[x] = dN . S_x for now: dN . a = sum_x phi[x] dphi[x] */
                float zl = 0.0f, dc = 0.0f;
                for (int64_t x = 0; x < f; ++x) {
                    dc += phi[x] * dphi[x];
                    zl += phi[x] * z[x];
                }
                dc += dD * zl;
                dg[b * hq + h] += dc * e;
                if (m > RF_MIN_MAX_SCORE) dm -= a->sharp * c * dc;
                const float dzl = c * dD; /* and da = c dN: dphi(q) = S da + z dzl */
                float *kp = kphi + (i * rep + slot) * f, *kd = kda + (i * rep + slot) * hd;
                for (int64_t d = 0; d < hd; ++d) kd[d] = c * dN[d];
                kdzl[i * rep + slot] = dzl;
                for (int64_t x = 0; x < f; ++x) {
                    dphi[x] = c * dphi[x] + z[x] * dzl;
                    kp[x] = phi[x];
                }
                feature_grad(phi, dphi, half, dpq + qi * half); /* the caller maps it through W */
                ++slot;
            }
            s[arg] += dm; /* the highest score carries m's own gradient */
            window_key_grads(s, a->scaling, qh, kr, dkr, dqh, nsink, first, nw, hd);
        }
    }
    if (fm) {
        const float gm = a->decay ? a->decay[kv] : 1.0f;
        float dlg = 0.0f;
        for (int64_t i = L - 1; i >= 0; --i) {
            if (a->decay) { /* T_i = gamma (T_{i+1} + R_{i+1}), then R_i = gamma R_{i+1} + X_i */
                for (int64_t x = 0; x < f * hd; ++x) {
                    T[x] = gm * (T[x] + R[x]);
                    R[x] *= gm;
                }
                for (int64_t x = 0; x < f; ++x) {
                    t_[x] = gm * (t_[x] + r[x]);
                    r[x] *= gm;
                }
            }
            for (int64_t slot = 0; slot < rep; ++slot) {
                const float *kp = kphi + (i * rep + slot) * f, dzl = kdzl[i * rep + slot];
                rows_add(R, f, kp, kda + (i * rep + slot) * hd, hd);
                for (int64_t x = 0; x < f; ++x) r[x] += kp[x] * dzl;
            }
            const int64_t j = i - a->window; /* the token folded before query i read the state */
            if (j < a->sink) continue;
            feature(kr + j * hd, fm, hd, half, phi);
            adjoint_reads(R, T, r, t_, phi, f, vr + j * hd, dvr + j * hd, dphi, tx, hd);
            for (int64_t x = 0; x < f; ++x) dlg += phi[x] * tx[x];
            feature_grad(phi, dphi, half, dpk + (row * L + j) * half); /* the caller maps it through W */
        }
        if (dlog_gamma) dlog_gamma[row] = dlg;
    }
    free(buf);
    return 0;
}

/* The bodies with the head width a compile-time constant for the usual widths (64, 128): the
 * channel loops then unroll into whole vector registers. */
static int train_fwd_row(const train_args *a, int64_t row, float *out, float *m_out, float *D_out) {
    if (a->hd == 64) return train_fwd_body(a, row, out, m_out, D_out, 64);
    if (a->hd == 128) return train_fwd_body(a, row, out, m_out, D_out, 128);
    return train_fwd_body(a, row, out, m_out, D_out, a->hd);
}

static int train_bwd_row(const train_args *a, int64_t row, const float *out, const float *m_in, const float *D_in,
                         const float *dout, float *dq, float *dk, float *dv, float *dpq, float *dpk, float *dg,
                         float *dlog_gamma) {
    if (a->hd == 64) return train_bwd_body(a, row, out, m_in, D_in, dout, dq, dk, dv, dpq, dpk, dg, dlog_gamma, 64);
    if (a->hd == 128) return train_bwd_body(a, row, out, m_in, D_in, dout, dq, dk, dv, dpq, dpk, dg, dlog_gamma, 128);
    return train_bwd_body(a, row, out, m_in, D_in, dout, dq, dk, dv, dpq, dpk, dg, dlog_gamma, a->hd);
}

static train_args make_args(const float *q, const float *k, const float *v, const float *fmap, const float *g,
                            const float *decay, const int64_t *kvq, int64_t B, int64_t hq, int64_t hkv, int64_t hd,
                            int64_t L, int64_t sink, int64_t window, int64_t f, float scaling, float sharp) {
    train_args a = {q, k, v, fmap, g, decay, kvq, B, hq, hkv, hd, L, sink, window, fmap ? f : 0, scaling, sharp};
    return a;
}

int rf_window_train_fwd_f32(const float *q, const float *k, const float *v, const float *fmap, const float *g,
                            const float *decay, const int64_t *kvq, float *out, float *m_out, float *D_out, int64_t B,
                            int64_t hq, int64_t hkv, int64_t hd, int64_t L, int64_t sink, int64_t window, int64_t f,
                            float scaling, float sharp) {
    const train_args a = make_args(q, k, v, fmap, g, decay, kvq, B, hq, hkv, hd, L, sink, window, f, scaling, sharp);
    int rc = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) reduction(| : rc)
#endif
    for (int64_t row = 0; row < B * hkv; ++row) rc |= train_fwd_row(&a, row, out, m_out, D_out);
    return rc;
}

/* dq, dk, dv, dpq (B, hq, L, f / 2), dpk (B, hkv, L, f / 2), dg (B, hq) and dlog_gamma (B * hkv) must
 * be zero on entry; dpq, dpk, dg and dlog_gamma may be NULL for plain window attention (dlog_gamma
 * also without decay). dpq and dpk are the gradients of the feature map's projections x W of every
 * query and every folded key: the caller adds W dp to dq and dk and sums x dp^T into dW (matrix
 * products, where BLAS does them better than a loop here). */
int rf_window_train_bwd_f32(const float *q, const float *k, const float *v, const float *fmap, const float *g,
                            const float *decay, const int64_t *kvq, const float *out, const float *m_in,
                            const float *D_in, const float *dout, float *dq, float *dk, float *dv, float *dpq,
                            float *dpk, float *dg, float *dlog_gamma, int64_t B, int64_t hq, int64_t hkv, int64_t hd, int64_t L,
                            int64_t sink, int64_t window, int64_t f, float scaling, float sharp) {
    const train_args a = make_args(q, k, v, fmap, g, decay, kvq, B, hq, hkv, hd, L, sink, window, f, scaling, sharp);
    int rc = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) reduction(| : rc)
#endif
    for (int64_t row = 0; row < B * hkv; ++row)
        rc |= train_bwd_row(&a, row, out, m_in, D_in, dout, dq, dk, dv, dpq, dpk, dg, dlog_gamma);
    return rc;
}
