/* hf_config.c — config.json fields, checked on the way in and written in transformers'
 * style on the way out (hf_config.h). */
#include "engine/model/hf_config.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"

static const cJSON *field(const cJSON *cfg, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

fy_status fy_hf_int(const cJSON *cfg, const char *path, const char *key, int def, int lo,
                    int hi, int *out) {
    const cJSON *v = field(cfg, key);
    if (!v && def >= lo) { *out = def; return FY_OK; }
    if (!v) {
        fy_log_error("%s: no %s", path, key);
        return FY_ERR_FORMAT;
    }
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || d != floor(d) || d < lo || d > hi) {
        char *text = cJSON_PrintUnformatted(v);
        fy_log_error("%s: %s is %s; it must be an integer from %d to %d", path, key,
                     text ? text : "?", lo, hi);
        free(text);
        return FY_ERR_FORMAT;
    }
    *out = (int)d;
    return FY_OK;
}

fy_status fy_hf_float(const cJSON *cfg, const char *path, const char *key, double def,
                      double *out) {
    const cJSON *v = field(cfg, key);
    if (!v && def > 0) { *out = def; return FY_OK; }
    if (!v) {
        fy_log_error("%s: no %s", path, key);
        return FY_ERR_FORMAT;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || !(v->valuedouble > 0) ||
        v->valuedouble > 3e38) {
        char *text = cJSON_PrintUnformatted(v);
        fy_log_error("%s: %s is %s; it must be a positive number", path, key, text ? text : "?");
        free(text);
        return FY_ERR_FORMAT;
    }
    *out = v->valuedouble;
    return FY_OK;
}

fy_status fy_hf_bool(const cJSON *cfg, const char *path, const char *key, bool def, bool *out) {
    const cJSON *v = field(cfg, key);
    if (!v) { *out = def; return FY_OK; }
    if (!cJSON_IsBool(v)) {
        fy_log_error("%s: %s must be true or false", path, key);
        return FY_ERR_FORMAT;
    }
    *out = cJSON_IsTrue(v);
    return FY_OK;
}

fy_status fy_hf_one_of(const cJSON *cfg, const char *path, const char *key,
                       const char *const *allowed) {
    const cJSON *v = field(cfg, key);
    if (!v) return FY_OK;
    char list[160] = "";
    for (int i = 0; allowed[i]; i++) {
        if (cJSON_IsString(v) && !strcmp(v->valuestring, allowed[i])) return FY_OK;
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", allowed[i]);
    }
    char *text = cJSON_PrintUnformatted(v);
    fy_log_error("%s: %s %s is not supported (ferry: %s)", path, key, text ? text : "?", list);
    free(text);
    return FY_ERR_FORMAT;
}

fy_status fy_hf_float_array(const cJSON *cfg, const char *path, const char *key, int n,
                           float *out) {
    const cJSON *v = field(cfg, key), *e;
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != n) {
        fy_log_error("%s: %s must be a list of %d numbers", path, key, n);
        return FY_ERR_FORMAT;
    }
    int i = 0;
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsNumber(e) || !(e->valuedouble > 0.0 && e->valuedouble <= 1e30)) {
            fy_log_error("%s: %s[%d] must be a positive number", path, key, i);
            return FY_ERR_FORMAT;
        }
        out[i++] = (float)e->valuedouble;
    }
    return FY_OK;
}

fy_status fy_hf_zero(const cJSON *cfg, const char *path, const char *key, const char *what) {
    const cJSON *v = field(cfg, key);
    if (!v || (cJSON_IsNumber(v) && v->valuedouble == 0.0)) return FY_OK;
    char *text = cJSON_PrintUnformatted(v);
    fy_log_error("%s: %s %s is not supported (ferry: 0; %s)", path, key, text ? text : "?", what);
    free(text);
    return FY_ERR_FORMAT;
}

static void set(cJSON *cfg, const char *key, cJSON *item) {
    if (!item) return; /* out of memory: the key stays absent, as cJSON itself does */
    if (cJSON_GetObjectItemCaseSensitive(cfg, key)) cJSON_ReplaceItemInObjectCaseSensitive(cfg, key, item);
    else cJSON_AddItemToObject(cfg, key, item);
}

void fy_hf_set_int(cJSON *cfg, const char *key, long long v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", v);
    set(cfg, key, cJSON_CreateRaw(buf));
}

/* A float in its shortest form that reads back as the same fp32 value, with a decimal
 * point, as Python writes it ("1e-05", "500000.0"). */
static cJSON *float_item(float v) {
    char buf[48];
    if (fabsf(v) < 1e15f && v == (float)(long long)v) { /* integral: 500000.0, not 5e+05 */
        snprintf(buf, sizeof buf, "%.1f", (double)v);
        return cJSON_CreateRaw(buf);
    }
    for (int digits = 1; digits <= 9; digits++) { /* the shortest that reads back */
        snprintf(buf, sizeof buf, "%.*g", digits, (double)v);
        if (strtof(buf, NULL) == v) break;
    }
    if (!strpbrk(buf, ".en")) strcat(buf, ".0");
    return cJSON_CreateRaw(buf);
}

void fy_hf_set_float(cJSON *cfg, const char *key, float v) { set(cfg, key, float_item(v)); }

void fy_hf_set_float_array(cJSON *cfg, const char *key, const float *v, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++) cJSON_AddItemToArray(a, float_item(v[i]));
    set(cfg, key, a);
}

void fy_hf_set_string_array(cJSON *cfg, const char *key, const char *const *v, int n) {
    set(cfg, key, cJSON_CreateStringArray(v, n));
}

void fy_hf_set_bool(cJSON *cfg, const char *key, bool v) { set(cfg, key, cJSON_CreateBool(v)); }
void fy_hf_set_string(cJSON *cfg, const char *key, const char *v) { set(cfg, key, cJSON_CreateString(v)); }
void fy_hf_set_null(cJSON *cfg, const char *key) { set(cfg, key, cJSON_CreateNull()); }

void fy_hf_set_architecture(cJSON *cfg, const char *cls) {
    const char *const names[] = {cls};
    set(cfg, "architectures", cJSON_CreateStringArray(names, 1));
}

cJSON *fy_hf_set_object(cJSON *cfg, const char *key) {
    cJSON *o = cJSON_CreateObject();
    set(cfg, key, o);
    return o;
}
