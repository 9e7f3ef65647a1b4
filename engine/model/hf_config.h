/* hf_config.h — reading and writing the fields of a Hugging Face config.json, for the
 * families' *_io.c: each read checks its type and range and, on failure, logs one line
 * naming the file and the field. Included by families only. */
#ifndef FY_HF_CONFIG_H
#define FY_HF_CONFIG_H

#include <stdbool.h>

#include <cjson/cJSON.h>

#include "engine/core/status.h"

/* An integer field in [lo, hi]: absent or null gives def when def >= lo, else it is
 * missing (an error). */
fy_status fy_hf_int(const cJSON *cfg, const char *path, const char *key, int def, int lo,
                    int hi, int *out);
/* A positive finite number; absent or null gives def (def <= 0: required). */
fy_status fy_hf_float(const cJSON *cfg, const char *path, const char *key, double def,
                      double *out);
/* A boolean; absent or null gives def. */
fy_status fy_hf_bool(const cJSON *cfg, const char *path, const char *key, bool def, bool *out);
/* A string field equal to one of the NULL-terminated allowed values, or absent. */
fy_status fy_hf_one_of(const cJSON *cfg, const char *path, const char *key,
                       const char *const *allowed);

/* A list of exactly n positive numbers. */
fy_status fy_hf_float_array(const cJSON *cfg, const char *path, const char *key, int n,
                           float *out);
/* A number that must be 0 when present (dropout rates ferry does not apply); what says
 * why in the error. */
fy_status fy_hf_zero(const cJSON *cfg, const char *path, const char *key, const char *what);

/* Sets key to a number (replacing it); floats are written in their shortest form that
 * reads back as the same fp32 value, with a decimal point ("1e-05", "500000.0"). */
void fy_hf_set_int(cJSON *cfg, const char *key, long long v);
void fy_hf_set_float(cJSON *cfg, const char *key, float v);
void fy_hf_set_float_array(cJSON *cfg, const char *key, const float *v, int n);
void fy_hf_set_string_array(cJSON *cfg, const char *key, const char *const *v, int n);
void fy_hf_set_bool(cJSON *cfg, const char *key, bool v);
void fy_hf_set_string(cJSON *cfg, const char *key, const char *v);
/* "architectures": [cls], the transformers class that loads the model. */
void fy_hf_set_architecture(cJSON *cfg, const char *cls);
/* Sets key to a fresh object / null, returning it. */
cJSON *fy_hf_set_object(cJSON *cfg, const char *key);
void fy_hf_set_null(cJSON *cfg, const char *key);

#endif
