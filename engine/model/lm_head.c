/* lm_head.c — the shared classifier (lm_head.h): per chunk of rows, the logits, their
 * loss and, in training, their gradient in place, which gives dxn's rows and dw's share
 * before the next chunk reuses the buffer. */
#include "engine/model/lm_head.h"

#include "engine/device/kernels.h"

void fy_lm_head(const fy_lm_head_io *io, fy_stream *s) {
    const int N = io->N, C = io->C, V = io->V, Vp = fy_lm_vocab_padded(V);
    const size_t es = fy_dtype_size(fy_stream_dtype(s)); /* xn and dxn are stored so */
    const size_t VpC = (size_t)Vp * C;
    const bool train = io->dloss != 0.0f;
    const bool one = train && io->logits_all;
    const int rows = one ? N : (int)fy_lm_logit_rows((size_t)N, (size_t)Vp, es);
    float *logits = one ? io->logits_all : io->logits;
    if (train && io->dw32) fy_memset_async(s, io->dw32, 0, VpC * sizeof(float));
    for (int r0 = 0; r0 < N; r0 += rows) {
        const int n = N - r0 < rows ? N - r0 : rows;
        const float *xn = (const float *)((const char *)io->xn + (size_t)r0 * C * es);
        fy_k_matmul_fwd(logits, xn, io->w, NULL, n, C, Vp, s);
        fy_k_crossentropy(io->losses + r0, logits, io->targets + r0, n, V, Vp, io->dloss, s);
        if (!train) continue;
        float *dxn = (float *)((char *)io->dxn + (size_t)r0 * C * es);
        if (io->dw32) fy_k_matmul_bwd_f32acc(dxn, io->dw32, logits, xn, io->w, n, C, Vp, s);
        else fy_k_matmul_bwd(dxn, io->dw, NULL, logits, xn, io->w, n, C, Vp, s);
    }
    if (train && io->dw32) fy_k_add_f32(io->dw, io->dw32, VpC, s);
}
