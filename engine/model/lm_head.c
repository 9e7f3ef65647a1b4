/* lm_head.c — the shared classifier by vocabulary chunks (lm_head.h). */
#include "engine/model/lm_head.h"

#include "engine/device/kernels.h"
#include "engine/model/model_impl.h"

static float *rows_at(const float *w, int v0, int C, fy_stream *s) {
    return fy_rows(w, (size_t)v0, (size_t)C, fy_dtype_size(fy_stream_dtype(s)));
}

void fy_lm_head_fwd_chunk(const fy_lm_head_io *io, int k, const float *w_k, fy_stream *s) {
    const int v0 = fy_lm_chunk_v0(io->chunks, k), nv = fy_lm_chunk_nv(io->chunks, k);
    fy_k_matmul_fwd(io->logits, io->xn, w_k, NULL, io->N, io->C, nv, s);
    fy_k_ce_chunk_fwd(io->logits, io->targets, io->max, io->sum, io->tlogit, io->losses, io->N,
                      v0, nv, io->V, io->softcap, s);
}

void fy_lm_head_bwd_chunk(const fy_lm_head_io *io, int k, const float *w_k, float *dw_k,
                          bool fresh, fy_stream *s) {
    const int v0 = fy_lm_chunk_v0(io->chunks, k), nv = fy_lm_chunk_nv(io->chunks, k);
    const int N = io->N, C = io->C;
    if (!fresh) fy_k_matmul_fwd(io->logits, io->xn, w_k, NULL, N, C, nv, s);
    fy_k_ce_chunk_bwd(io->logits, io->targets, io->max, io->sum, N, v0, nv, io->V, io->dloss,
                      io->softcap, s);
    if (k == io->chunks.n - 1) fy_memset_async(s, io->dxn32, 0, (size_t)N * C * sizeof(float));
    fy_k_matmul_bwd_dx32(io->dxn32, dw_k, io->logits, io->xn, w_k, N, C, nv, s);
    if (k == 0 && io->dxn) {
        fy_memset_async(s, io->dxn, 0, (size_t)N * C * fy_dtype_size(fy_stream_dtype(s)));
        fy_k_add_f32(io->dxn, io->dxn32, (size_t)N * C, s);
    }
}

void fy_lm_head(const fy_lm_head_io *io, const float *w, float *dw, fy_stream *s) {
    const int K = io->chunks.n;
    for (int k = 0; k < K; k++)
        fy_lm_head_fwd_chunk(io, k, rows_at(w, fy_lm_chunk_v0(io->chunks, k), io->C, s), s);
    if (io->dloss == 0.0f) return;
    for (int k = K - 1; k >= 0; k--) {
        const int v0 = fy_lm_chunk_v0(io->chunks, k);
        fy_lm_head_bwd_chunk(io, k, rows_at(w, v0, io->C, s), rows_at(dw, v0, io->C, s),
                             k == K - 1, s);
    }
}
