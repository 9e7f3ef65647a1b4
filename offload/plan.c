/* plan.c — plans: construction, AutoHete shorthands, JSON files, descriptions. */
#include "offload/plan.h"

#include "engine/io/json_file.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *params_names[] = {"resident", "streamed"}; /* version 1's weights */
static const char *where_names[FY_WHERES] = {"device", "host", "disk"};
static const char *update_names[] = {"gpu", "cpu"};
static const char *acts_names[] = {"keep", "recompute", "offload"};
static const char *state_keys[FY_PLAN_STATES] = {"master", "grad", "moments"};

fy_where fy_plan_where(const fy_block_plan *bp, fy_plan_state s) {
    if (bp->update == FY_UPDATE_CPU) return bp->disk && s != FY_PLAN_GRAD ? FY_ON_DISK : FY_ON_HOST;
    return s == FY_PLAN_MASTER ? bp->weights : FY_ON_DEVICE;
}

static fy_status plan_alloc(int nblocks, int micro_batch, int grad_accum, fy_plan *out) {
    memset(out, 0, sizeof *out);
    if (nblocks < 2 || micro_batch <= 0 || grad_accum <= 0 || grad_accum > FY_PLAN_MAX_ACCUM) {
        fy_log_error("plan: blocks, micro-batch and accumulation (at most %d) must be positive",
                     FY_PLAN_MAX_ACCUM);
        return FY_ERR_INVALID;
    }
    out->blocks = calloc((size_t)nblocks, sizeof *out->blocks);
    if (!out->blocks) return FY_ERR_NOMEM;
    out->nblocks = nblocks;
    out->micro_batch = micro_batch;
    out->grad_accum = grad_accum;
    out->prefetch = 1;
    out->dtype = FY_F32;
    return FY_OK;
}

fy_status fy_plan_new(const fy_model *m, int micro_batch, int grad_accum, fy_plan *out) {
    FY_TRY(plan_alloc(fy_model_nblocks(m), micro_batch, grad_accum, out));
    for (int b = 0; b < out->nblocks; b++) {
        const fy_block_spec *blk = fy_model_block(m, b);
        out->blocks[b].kind = blk->kind;
        out->blocks[b].layer = blk->layer;
    }
    out->layers = fy_model_layers(m);
    return FY_OK;
}

void fy_plan_free(fy_plan *p) {
    free(p->blocks);
    p->blocks = NULL;
}

fy_status fy_plan_copy(const fy_plan *src, fy_plan *dst) {
    FY_TRY(plan_alloc(src->nblocks, src->micro_batch, src->grad_accum, dst));
    memcpy(dst->blocks, src->blocks, (size_t)src->nblocks * sizeof *dst->blocks);
    dst->layers = src->layers;
    dst->prefetch = src->prefetch;
    dst->dtype = src->dtype;
    dst->disk_chunk = src->disk_chunk;
    return FY_OK;
}

bool fy_plan_equal(const fy_plan *a, const fy_plan *b) {
    return a->nblocks == b->nblocks && a->micro_batch == b->micro_batch &&
           a->grad_accum == b->grad_accum && a->prefetch == b->prefetch && a->dtype == b->dtype &&
           a->disk_chunk == b->disk_chunk &&
           !memcmp(a->blocks, b->blocks, (size_t)a->nblocks * sizeof *a->blocks);
}

fy_status fy_plan_shorthands(fy_plan *p, double params_ratio, double optim_ratio,
                             int ckpt_layers) {
    const int L = p->layers;
    if (!(params_ratio >= 0 && params_ratio <= 1) || !(optim_ratio >= 0 && optim_ratio <= 1)) {
        fy_log_error("--offload-params and --offload-optim take a ratio in [0, 1]");
        return FY_ERR_INVALID;
    }
    if (ckpt_layers < 0 || ckpt_layers > L) {
        fy_log_error("--ckpt-layers %d: the model has %d layers", ckpt_layers, L);
        return FY_ERR_INVALID;
    }
    /* ceil with a guard so 0.5 * 12 is 6, not 7 from rounding noise */
    int kp = (int)ceil(params_ratio * L - 1e-9), ko = (int)ceil(optim_ratio * L - 1e-9);
    for (int b = 0; b < p->nblocks; b++) {
        fy_block_plan *bp = &p->blocks[b];
        if (bp->kind == FY_BLOCK_LAYER) {
            const int l = bp->layer;
            bp->weights = l < kp ? FY_ON_HOST : FY_ON_DEVICE;
            bp->update = l >= L - ko ? FY_UPDATE_CPU : FY_UPDATE_DEVICE;
            bp->acts = l < ckpt_layers ? FY_ACTS_RECOMPUTE : FY_ACTS_KEEP;
            bp->speculate = false; /* fy_plan_speculate, after */
            bp->disk = false;      /* fy_plan_disk, after */
        } else { /* the embedding and the head move only with a ratio of 1 */
            bp->weights = params_ratio >= 1 ? FY_ON_HOST : FY_ON_DEVICE;
            bp->update = optim_ratio >= 1 ? FY_UPDATE_CPU : FY_UPDATE_DEVICE;
            bp->acts = FY_ACTS_KEEP;
            bp->speculate = false;
            bp->disk = false;
        }
    }
    return FY_OK;
}

/* Whether a shorthand of ratio chooses block bp: one of the last ceil(ratio*L) layers,
 * or with ratio 1 any block (the embedding and the head too). */
static bool among_last(const fy_plan *p, const fy_block_plan *bp, double ratio) {
    const int L = p->layers, k = (int)ceil(ratio * L - 1e-9);
    return bp->kind == FY_BLOCK_LAYER ? bp->layer >= L - k : ratio >= 1;
}

/* FY_ERR_INVALID (logged, naming flag) unless ratio is in [0, 1]. */
static fy_status check_ratio(double ratio, const char *flag) {
    if (ratio >= 0 && ratio <= 1) return FY_OK;
    fy_log_error("%s takes a ratio in [0, 1]", flag);
    return FY_ERR_INVALID;
}

fy_status fy_plan_speculate(fy_plan *p, double ratio) {
    FY_TRY(check_ratio(ratio, "--speculate"));
    for (int b = 0; b < p->nblocks; b++) {
        fy_block_plan *bp = &p->blocks[b];
        bp->speculate = among_last(p, bp, ratio) && bp->update == FY_UPDATE_CPU;
    }
    return FY_OK;
}

fy_status fy_plan_disk(fy_plan *p, double ratio) {
    FY_TRY(check_ratio(ratio, "--disk-optim"));
    for (int b = 0; b < p->nblocks; b++) {
        fy_block_plan *bp = &p->blocks[b];
        bp->disk = among_last(p, bp, ratio) && bp->update == FY_UPDATE_CPU;
        if (bp->disk && bp->speculate) {
            fy_log_error("--disk-optim with --speculate: a speculative update keeps its spare "
                         "state in host memory; put the speculative blocks' state on disk "
                         "or speculate, not both");
            return FY_ERR_INVALID;
        }
    }
    return FY_OK;
}

fy_status fy_plan_offload_acts(fy_plan *p, double ratio) {
    FY_TRY(check_ratio(ratio, "--offload-acts"));
    const int k = (int)ceil(ratio * p->layers - 1e-9);
    for (int b = 0; b < p->nblocks; b++)
        if (p->blocks[b].kind == FY_BLOCK_LAYER && p->blocks[b].layer < k) p->blocks[b].acts = FY_ACTS_OFFLOAD;
    return FY_OK;
}

bool fy_plan_uses_disk(const fy_plan *p) {
    for (int b = 0; b < p->nblocks; b++)
        if (p->blocks[b].disk) return true;
    return false;
}

static void block_name(const fy_block_plan *bp, char *buf, size_t cap) {
    if (bp->kind == FY_BLOCK_LAYER) snprintf(buf, cap, "layer.%d", bp->layer);
    else snprintf(buf, cap, "%s", fy_block_kind_name(bp->kind));
}

fy_status fy_plan_check(const fy_plan *p, const fy_model *m) {
    if (p->nblocks != fy_model_nblocks(m)) {
        fy_log_error("the plan is for %d layers, the model has %d", p->layers, fy_model_layers(m));
        return FY_ERR_INVALID;
    }
    for (int b = 0; b < p->nblocks; b++) {
        const fy_block_spec *blk = fy_model_block(m, b);
        const fy_block_plan *bp = &p->blocks[b];
        if (bp->kind != blk->kind || bp->layer != blk->layer) {
            char name[32];
            block_name(bp, name, sizeof name);
            fy_log_error("plan block %d is %s, the model's is %s", b, name, blk->name);
            return FY_ERR_INVALID;
        }
        if (bp->acts != FY_ACTS_KEEP && bp->kind != FY_BLOCK_LAYER) {
            fy_log_error("plan block %s: only layers can recompute or offload activations", blk->name);
            return FY_ERR_INVALID;
        }
        if ((bp->speculate || bp->disk) && bp->update != FY_UPDATE_CPU) {
            fy_log_error("plan block %s: only an update on the CPU can %s", blk->name,
                         bp->speculate ? "speculate" : "keep its state on disk");
            return FY_ERR_INVALID;
        }
        if (bp->speculate && bp->disk) {
            fy_log_error("plan block %s: a speculative update keeps its state in host memory, "
                         "not on disk", blk->name);
            return FY_ERR_INVALID;
        }
    }
    if (p->disk_chunk % FY_DISK_CHUNK_ALIGN || p->disk_chunk > ((size_t)1 << 40)) {
        fy_log_error("plan: disk_chunk %zu is not a multiple of %zu elements", p->disk_chunk,
                     FY_DISK_CHUNK_ALIGN);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

static int pick(const char *s, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (s && !strcmp(s, names[i])) return i;
    return -1;
}

cJSON *fy_plan_json(const fy_plan *p) {
    cJSON *root = cJSON_CreateObject(), *blocks = cJSON_CreateArray();
    if (!root || !blocks) {
        cJSON_Delete(root);
        cJSON_Delete(blocks);
        return NULL;
    }
    cJSON_AddStringToObject(root, "format", "ferry-plan");
    cJSON_AddNumberToObject(root, "version", 2);
    cJSON_AddNumberToObject(root, "layers", p->layers);
    cJSON_AddNumberToObject(root, "micro_batch", p->micro_batch);
    cJSON_AddNumberToObject(root, "grad_accum", p->grad_accum);
    cJSON_AddNumberToObject(root, "prefetch", p->prefetch);
    if (p->dtype == FY_F32 || p->dtype == FY_BF16)
        cJSON_AddStringToObject(root, "dtype", fy_dtype_name(p->dtype));
    if (p->disk_chunk) cJSON_AddNumberToObject(root, "disk_chunk", (double)p->disk_chunk);
    for (int b = 0; b < p->nblocks; b++) {
        const fy_block_plan *bp = &p->blocks[b];
        char name[32];
        block_name(bp, name, sizeof name);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "block", name);
        cJSON_AddStringToObject(o, "weights", where_names[bp->weights]);
        cJSON_AddStringToObject(o, "update", update_names[bp->update]);
        for (int k = 0; k < FY_PLAN_STATES; k++)
            cJSON_AddStringToObject(o, state_keys[k], where_names[fy_plan_where(bp, (fy_plan_state)k)]);
        cJSON_AddStringToObject(o, "acts", acts_names[bp->acts]);
        if (bp->speculate) cJSON_AddTrueToObject(o, "speculate");
        cJSON_AddItemToArray(blocks, o);
    }
    cJSON_AddItemToObject(root, "blocks", blocks);
    return root;
}

fy_status fy_plan_save(const char *path, const fy_plan *p) {
    cJSON *root = fy_plan_json(p);
    if (!root) {
        fy_log_error("out of host memory writing plan %s", path);
        return FY_ERR_NOMEM;
    }
    fy_status st = fy_json_write(path, "plan", root);
    cJSON_Delete(root);
    return st;
}

/* Block b's entry of a plan file into bp: version 1 says params (resident|streamed) and
 * optim (gpu|cpu); version 2 weights (device|host) and update (gpu|cpu), and may say
 * where the master, the gradient and the moments live, which must be where they follow
 * (fy_plan_where). false, with why, when the entry is not one of these. */
static bool parse_block(const cJSON *o, int b, const char *name, int version, fy_block_plan *bp,
                        char *why, size_t cap) {
    const cJSON *jn = cJSON_GetObjectItemCaseSensitive(o, "block");
    if (!cJSON_IsString(jn) || strcmp(jn->valuestring, name)) {
        snprintf(why, cap, "block %d must be named \"%s\"", b, name);
        return false;
    }
#define KEY(k) cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(o, k))
    const int pw = version == 1 ? pick(KEY("params"), params_names, 2) : pick(KEY("weights"), where_names, FY_WHERES);
    const int pu = pick(KEY(version == 1 ? "optim" : "update"), update_names, 2);
    const int pa = pick(KEY("acts"), acts_names, version == 1 ? 2 : 3);
    if (pw < 0 || pw == FY_ON_DISK || pu < 0 || pa < 0) {
        const bool v2_keys = version == 1 && KEY("weights");
        snprintf(why, cap, version == 1 ? "block %s: params resident|streamed, optim gpu|cpu, acts keep|recompute%s"
                                        : "block %s: weights device|host, update gpu|cpu, acts keep|recompute|offload", name,
                 v2_keys ? " (a version 2 file says \"version\": 2)" : "");
        return false;
    }
    if (pa != FY_ACTS_KEEP && bp->kind != FY_BLOCK_LAYER) {
        snprintf(why, cap, "block %s: only layers can recompute or offload activations", name);
        return false;
    }
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(o, "speculate");
    if (js && (!cJSON_IsBool(js) || (cJSON_IsTrue(js) && pu != FY_UPDATE_CPU))) {
        snprintf(why, cap, "block %s: speculate is true or false, and true only with update cpu", name);
        return false;
    }
    bp->weights = (fy_where)pw;
    bp->update = (fy_update_at)pu;
    bp->acts = (fy_acts_policy)pa;
    bp->speculate = cJSON_IsTrue(js);
    /* "disk" for the master or the moments puts both there */
    bp->disk = version == 2 && ((KEY("master") && !strcmp(KEY("master"), "disk")) ||
                                (KEY("moments") && !strcmp(KEY("moments"), "disk")));
    if (bp->disk && (bp->update != FY_UPDATE_CPU || bp->speculate)) {
        snprintf(why, cap, "block %s: master and moments on disk need update cpu and no speculate", name);
        return false;
    }
    for (int k = 0; k < FY_PLAN_STATES && version == 2; k++) {
        const char *said = KEY(state_keys[k]);
        const fy_where w = fy_plan_where(bp, (fy_plan_state)k);
        if (said && pick(said, where_names, FY_WHERES) != (int)w) {
            snprintf(why, cap, "block %s: %s \"%s\": with weights on the %s and the update on the %s, "
                     "it lives on the %s", name, state_keys[k], said, where_names[bp->weights],
                     update_names[bp->update], where_names[w]);
            return false;
        }
    }
#undef KEY
    return true;
}

fy_status fy_plan_load(const char *path, const fy_model *m, fy_plan *out) {
    const int layers = fy_model_layers(m), nb = fy_model_nblocks(m);
    memset(out, 0, sizeof *out);
    cJSON *root;
    FY_TRY(fy_json_read(path, "plan", &root));
    fy_status st = FY_ERR_FORMAT;
    const char *why = NULL;
    char whybuf[192];
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    const cJSON *jl = cJSON_GetObjectItemCaseSensitive(root, "layers");
    const cJSON *jb = cJSON_GetObjectItemCaseSensitive(root, "micro_batch");
    const cJSON *ja = cJSON_GetObjectItemCaseSensitive(root, "grad_accum");
    const cJSON *blocks = cJSON_GetObjectItemCaseSensitive(root, "blocks");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "ferry-plan")) {
        why = "\"format\" is not \"ferry-plan\"";
        goto done;
    }
    if (!cJSON_IsNumber(jl) || jl->valuedouble != layers) {
        snprintf(whybuf, sizeof whybuf, "written for %g layers, the model has %d",
                 cJSON_IsNumber(jl) ? jl->valuedouble : -1.0, layers);
        why = whybuf;
        goto done;
    }
    if (!cJSON_IsNumber(jb) || jb->valuedouble < 1 || jb->valuedouble > 65536 ||
        jb->valuedouble != floor(jb->valuedouble) || !cJSON_IsNumber(ja) ||
        ja->valuedouble < 1 || ja->valuedouble > 1024 || ja->valuedouble != floor(ja->valuedouble)) {
        why = "micro_batch (1..65536) and grad_accum (1..1024) must be integers in range";
        goto done;
    }
    if (!cJSON_IsArray(blocks) || cJSON_GetArraySize(blocks) != nb) {
        snprintf(whybuf, sizeof whybuf, "\"blocks\" must list %d blocks", nb);
        why = whybuf;
        goto done;
    }
    const cJSON *jp = cJSON_GetObjectItemCaseSensitive(root, "prefetch");
    if (jp && (!cJSON_IsNumber(jp) || jp->valuedouble < 0 || jp->valuedouble > 64 ||
               jp->valuedouble != floor(jp->valuedouble))) {
        why = "prefetch must be an integer in 0..64";
        goto done;
    }
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(root, "dtype");
    fy_dtype dtype = FY_DTYPE_NONE; /* not said: the run's default (--dtype) */
    if (jd && (!cJSON_IsString(jd) || fy_dtype_parse(jd->valuestring, &dtype) != 0 ||
               (dtype != FY_F32 && dtype != FY_BF16))) {
        why = "dtype must be \"fp32\" or \"bf16\"";
        goto done;
    }
    const cJSON *jv = cJSON_GetObjectItemCaseSensitive(root, "version");
    const int version = jv ? (cJSON_IsNumber(jv) ? (int)jv->valuedouble : -1) : 1;
    if (version != 1 && version != 2) {
        why = "version must be 1 or 2";
        goto done;
    }
    if ((st = fy_plan_new(m, (int)jb->valuedouble, (int)ja->valuedouble, out)) != FY_OK)
        goto done;
    if (jp) out->prefetch = (int)jp->valuedouble;
    const cJSON *jc = cJSON_GetObjectItemCaseSensitive(root, "disk_chunk");
    if (jc && (!cJSON_IsNumber(jc) || jc->valuedouble < FY_DISK_CHUNK_ALIGN || jc->valuedouble > 1e12 ||
               fmod(jc->valuedouble, (double)FY_DISK_CHUNK_ALIGN) != 0)) {
        snprintf(whybuf, sizeof whybuf, "disk_chunk must be a positive multiple of %zu elements",
                 FY_DISK_CHUNK_ALIGN);
        why = whybuf;
        st = FY_ERR_FORMAT;
        goto done;
    }
    if (jc) out->disk_chunk = (size_t)jc->valuedouble;
    out->dtype = dtype;
    st = FY_ERR_FORMAT;
    for (int b = 0; b < nb; b++) {
        char name[32];
        block_name(&out->blocks[b], name, sizeof name);
        if (!parse_block(cJSON_GetArrayItem(blocks, b), b, name, version, &out->blocks[b], whybuf,
                         sizeof whybuf)) {
            why = whybuf;
            goto done;
        }
    }
    st = FY_OK;
done:
    cJSON_Delete(root);
    if (st != FY_OK) {
        fy_plan_free(out);
        if (why) fy_log_error("plan %s: %s", path, why);
    }
    return st;
}

static int field_of(const fy_block_plan *bp, int field) {
    return field == 0 ? (int)bp->weights : field == 1 ? (int)bp->update
         : field == 2 ? (int)bp->acts : field == 3 ? (int)bp->speculate : (int)bp->disk;
}

/* Appends "what: layers a-b, c, embed" for the blocks whose field has value: runs of
 * consecutive layers, then the other blocks by kind. */
static void describe_set(const fy_plan *p, const char *what, int field, int value, char *buf,
                         size_t cap) {
    size_t len = strlen(buf);
    snprintf(buf + len, cap - len, "%s%s:", len ? " | " : "", what);
    bool any = false;
    for (int b = 0; b < p->nblocks;) {
        const fy_block_plan *bp = &p->blocks[b];
        if (bp->kind != FY_BLOCK_LAYER || field_of(bp, field) != value) { b++; continue; }
        int e = b;
        while (e + 1 < p->nblocks && p->blocks[e + 1].kind == FY_BLOCK_LAYER &&
               field_of(&p->blocks[e + 1], field) == value)
            e++;
        len = strlen(buf);
        if (e > b) snprintf(buf + len, cap - len, "%s layers %d-%d", any ? "," : "", bp->layer,
                            p->blocks[e].layer);
        else snprintf(buf + len, cap - len, "%s layer %d", any ? "," : "", bp->layer);
        any = true;
        b = e + 1;
    }
    for (int b = 0; b < p->nblocks; b++) {
        const fy_block_plan *bp = &p->blocks[b];
        if (bp->kind == FY_BLOCK_LAYER || field_of(bp, field) != value) continue;
        len = strlen(buf);
        snprintf(buf + len, cap - len, "%s %s", any ? "," : "", fy_block_kind_name(bp->kind));
        any = true;
    }
    if (!any) {
        len = strlen(buf);
        snprintf(buf + len, cap - len, " none");
    }
}

void fy_plan_describe(const fy_plan *p, char *buf, size_t cap) {
    buf[0] = 0;
    describe_set(p, "params streamed", 0, FY_ON_HOST, buf, cap);
    describe_set(p, "optim on cpu", 1, FY_UPDATE_CPU, buf, cap);
    describe_set(p, "recompute", 2, FY_ACTS_RECOMPUTE, buf, cap);
    for (int b = 0; b < p->nblocks; b++)
        if (p->blocks[b].acts == FY_ACTS_OFFLOAD) {
            describe_set(p, "recompute, input on host", 2, FY_ACTS_OFFLOAD, buf, cap);
            break;
        }
    for (int b = 0; b < p->nblocks; b++)
        if (p->blocks[b].disk) {
            describe_set(p, "optim state on disk", 4, 1, buf, cap);
            break;
        }
    for (int b = 0; b < p->nblocks; b++)
        if (p->blocks[b].speculate) { /* said only when some block does */
            describe_set(p, "speculative", 3, 1, buf, cap);
            break;
        }
    if (p->dtype == FY_BF16) snprintf(buf + strlen(buf), cap - strlen(buf), " | bf16 storage");
}
