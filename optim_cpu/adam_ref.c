/* adam_ref.c — the scalar AdamW reference: the arithmetic every other path must match
 * bit for bit (see adam.h), and the tail loop of the SIMD paths. */
#include "optim_cpu/adam.h"
#include "optim_cpu/adam_impl.h"

#include <math.h>

void fy_adam_consts_init(const fy_adam_hparams *hp, bool decay, fy_adam_consts *c) {
    double bc1 = 1.0 - pow((double)hp->beta1, (double)hp->step);
    double bc2 = 1.0 - pow((double)hp->beta2, (double)hp->step);
    c->grad_scale = hp->grad_scale;
    c->decay_mul = decay ? (float)(1.0 - (double)hp->lr * (double)hp->weight_decay) : 1.0f;
    c->beta1 = hp->beta1;
    c->omb1 = (float)(1.0 - (double)hp->beta1);
    c->beta2 = hp->beta2;
    c->omb2 = (float)(1.0 - (double)hp->beta2);
    c->rsbc2 = (float)(1.0 / sqrt(bc2));
    c->eps = hp->eps;
    c->neg_step_size = (float)(-(double)hp->lr / bc1);
}

static inline float load_grad(const void *g, fy_dtype t, size_t i) {
    switch (t) {
    case FY_BF16: return fy_bf16_to_f32(((const uint16_t *)g)[i]);
    case FY_F16: return fy_f16_to_f32(((const uint16_t *)g)[i]);
    default: return ((const float *)g)[i];
    }
}

static inline void store_out(void *o, fy_dtype t, size_t i, float w) {
    switch (t) {
    case FY_BF16: ((uint16_t *)o)[i] = fy_f32_to_bf16(w); break;
    case FY_F16: ((uint16_t *)o)[i] = fy_f32_to_f16(w); break;
    case FY_F32: ((float *)o)[i] = w; break;
    default: break;
    }
}

fy_status fy_adam_step_ref(const fy_adam_hparams *hp, const fy_adam_range *r) {
    fy_adam_consts c;
    fy_adam_consts_init(hp, r->decay, &c);
    if (hp->check_finite) {
        for (size_t i = 0; i < r->n; i++)
            if (!isfinite(load_grad(r->grad, r->grad_dtype, i) * c.grad_scale))
                return FY_ERR_NONFINITE;
    }
    const float *sp = r->src_param ? r->src_param : r->param;
    const float *sm = r->src_m ? r->src_m : r->m, *sv = r->src_v ? r->src_v : r->v;
    for (size_t i = 0; i < r->n; i++) {
        float g = load_grad(r->grad, r->grad_dtype, i) * c.grad_scale;
        float w = sp[i] * c.decay_mul;
        float m = fmaf(c.beta1, sm[i], c.omb1 * g);
        float v = fmaf(c.beta2, sv[i], (c.omb2 * g) * g);
        float d = fmaf(sqrtf(v), c.rsbc2, c.eps);
        w = fmaf(c.neg_step_size, m / d, w);
        r->param[i] = w;
        r->m[i] = m;
        r->v[i] = v;
        if (r->param_out) store_out(r->param_out, r->out_dtype, i, w);
    }
    return FY_OK;
}

/* The SCALAR path and the tails of the SIMD paths: the same sequence as above, written
 * once in adam_impl.h, so that testing this path against fy_adam_step_ref tests the
 * tails too. */
void fy_adam_kernel_scalar(const fy_adam_consts *c, const fy_adam_range *r, size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; i++) fy_adam_elem(c, r, i);
}

bool fy_adam_scan_scalar(float grad_scale, const void *grad, fy_dtype t, size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; i++)
        if (!isfinite(fy_adam_load_grad(grad, t, i) * grad_scale)) return false;
    return true;
}
