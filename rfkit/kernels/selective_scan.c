/* Selective scan (Mamba S6 recurrence) for the CPU, one sequential pass per channel.
 *
 * rfkit compiles this file on first use with the system C compiler (see rfkit/cpu_kernels.py)
 * and calls it through ctypes; the pure-PyTorch scans in rfkit/mamba.py are its twins and the
 * tests compare the two. Inference only (no backward).
 *
 * Layouts, all float32 and contiguous:
 *   u, delta, z, y : (batch, dim, length)      delta already includes bias and softplus
 *   A              : (dim, n)
 *   Bt, Ct         : (batch, length, n)        B and C transposed so one token's n values are adjacent
 *   Dskip          : (dim,)                    may be NULL
 *   z              : may be NULL (no gate)
 *   h              : (batch, dim, n)           initial state in, last state out
 *
 * Rows row_begin..row_end-1 of the flattened (batch * dim) channels are processed, so callers
 * can split the work between threads.
 *
 *   h_t = exp(delta_t * A) * h_{t-1} + delta_t * u_t * B_t
 *   y_t = (<C_t, h_t> + Dskip * u_t) * silu(z_t)
 */
#include <math.h>
#include <stdint.h>

void rf_selective_scan_f32(const float *u, const float *delta, const float *A, const float *Bt,
                           const float *Ct, const float *Dskip, const float *z, float *h, float *y,
                           int64_t dim, int64_t length, int64_t n, int64_t row_begin,
                           int64_t row_end) {
    for (int64_t row = row_begin; row < row_end; ++row) {
        const int64_t b = row / dim, d = row % dim;
        const float *u_r = u + row * length, *dt_r = delta + row * length;
        const float *z_r = z ? z + row * length : 0;
        float *y_r = y + row * length;
        float *h_r = h + row * n;
        const float *A_d = A + d * n;
        const float *B_b = Bt + b * length * n, *C_b = Ct + b * length * n;
        const float skip = Dskip ? Dskip[d] : 0.0f;
        for (int64_t t = 0; t < length; ++t) {
            const float dt = dt_r[t], x = u_r[t], dx = dt * x;
            const float *B_t = B_b + t * n, *C_t = C_b + t * n;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < n; ++k) {
                const float hk = expf(dt * A_d[k]) * h_r[k] + dx * B_t[k];
                h_r[k] = hk;
                acc += hk * C_t[k];
            }
            float out = acc + skip * x;
            if (z_r) {
                const float g = z_r[t];
                out *= g / (1.0f + expf(-g));
            }
            y_r[t] = out;
        }
    }
}
