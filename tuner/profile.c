/* profile.c — named profiles and profile files. */
#include "tuner/profile.h"

#include "engine/io/json_file.h"
#include "offload/layout.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Estimates for hardware ferry may not run on. Bandwidths are typical measured pinned
 * copy rates (below the link's nominal rate), compute is an effective ~60% of the
 * datasheet's dense bf16 peak, CPU AdamW is memory-bound at ~28 bytes per parameter.
 * Device memory is what the cuda backend would give a run, as a probe measures it: the
 * card's total as nvidia-smi reports it (H200 143771 MiB, H100 PCIe 81559, A100 80GB
 * 81920, A100 40GB 40960, RTX 4090 24564) less ~0.5 GiB for the CUDA context and the backend's 768 MiB
 * workspace reserve (cuda_backend.c). The collectives between the GPUs of a node (a
 * data-parallel job's reduce-scatter and all-gather, as NCCL's bus bandwidth) are
 * estimates from the links: NVLink where the card has it, else PCIe peer copies, at
 * ~75% of the link's nominal rate one way (nccl-tests' large-message bus bandwidth
 * reaches about that share); a job across nodes runs at its network's rate instead
 * (InfiniBand NDR 400 Gb/s: ~45 GB/s a NIC; HDR 200 Gb/s: ~22): give --profile a file
 * with coll_gbps set to it. Host memory over MPI (the CPU optimizer's blocks) is taken as
 * ~8 GB/s between a node's processes (Open MPI's shared-memory transport copies through
 * a shared buffer, about half a DRAM copy's rate). The disk tier's scratch file is taken to
 * sit on one NVMe drive of the host's PCIe generation: a data-centre drive in the servers,
 * a consumer one in the desktop. Its figures are the maker's sequential peaks (datasheet
 * figures as published; no queue depth is stated with them); sustained writes, once a
 * drive's cache is full or it is hot, are lower, and `ferry probe --disk-dir` measures
 * the drive a run has. */
static const struct {
    const char *name, *device, *source;
    double h2d, d2h, duplex, mem_gib, host_gib, tflops, mem_gbps, adam_per_thread, adam_max;
    int cores;
    double coll_gbps;
    const char *coll_source;
    double disk_read, disk_write; /* GB/s: the drive's figures, MB/s / 1000 */
    const char *disk_source;
} named[] = {
    /* each: host memory over MPI between the node's processes (Open MPI's shared-memory
     * transport) at ~8 GB/s, a DRAM copy through a shared buffer */
    {"a100-40gb-pcie4", "NVIDIA A100 40GB PCIe (PCIe 4.0 x16), AMD EPYC host",
     "NVIDIA A100 datasheet (312 TFLOPS dense bf16, 1555 GB/s HBM2); PCIe 4.0 x16 32 GB/s "
     "nominal, ~24 GB/s typical pinned copies; EPYC 7742 8-channel DDR4-3200 ~150 GB/s",
     24, 24, 20, 38.7, 512, 190, 1400, 0.6, 5.0, 64,
     20, "PCIe 4.0 x16 peer copies between the node's A100 PCIe cards (32 GB/s nominal one "
     "way; no NVLink bridge assumed)",
     7.0, 7.0, "Micron 9400 (PCIe 4.0 x4 U.3 data-centre NVMe): 7000/7000 MB/s sequential "
     "read/write at every capacity, the maker's peaks (computerbase.de, 2023-01); sustained "
     "rates may be lower"},
    {"a100-80gb-pcie4", "NVIDIA A100 80GB PCIe (PCIe 4.0 x16), AMD EPYC host",
     "NVIDIA A100 datasheet (80GB PCIe: 312 TFLOPS dense bf16, 1935 GB/s HBM2e); PCIe 4.0 x16 "
     "32 GB/s nominal, ~24 GB/s typical pinned copies; EPYC 7742 8-channel DDR4-3200 ~150 GB/s",
     24, 24, 20, 78.7, 512, 190, 1740, 0.6, 5.0, 64,
     20, "PCIe 4.0 x16 peer copies between the node's A100 PCIe cards (32 GB/s nominal one "
     "way; no NVLink bridge assumed)",
     7.0, 7.0, "Micron 9400 (PCIe 4.0 x4 U.3 data-centre NVMe): 7000/7000 MB/s sequential "
     "read/write at every capacity, the maker's peaks (computerbase.de, 2023-01); sustained "
     "rates may be lower"},
    {"rtx4090-pcie4", "NVIDIA RTX 4090 24GB (PCIe 4.0 x16), desktop host",
     "NVIDIA Ada datasheet (165 TFLOPS dense bf16 with fp32 accumulate, 1008 GB/s GDDR6X); "
     "PCIe 4.0 x16 ~24 GB/s typical; dual-channel DDR5 ~60 GB/s",
     24, 24, 20, 22.7, 128, 100, 900, 0.6, 2.0, 16,
     10, "GeForce RTX 40 cards have no peer-to-peer copies or NVLink: NCCL stages through "
     "host memory, about half a PCIe 4.0 x16 link's rate",
     7.45, 6.9, "Samsung 990 PRO 2TB (PCIe 4.0 x4 M.2, MZ-V9P2T0BW): 7450/6900 MB/s "
     "sequential read/write, the maker's peaks (slashcam.com, 2022-08-28; digitec.ch); "
     "writes past its SLC cache are slower"},
    {"h100-80gb-pcie5", "NVIDIA H100 80GB PCIe (PCIe 5.0 x16), dual-socket host",
     "NVIDIA H100 PCIe datasheet (756 TFLOPS dense bf16, 2000 GB/s HBM2e); PCIe 5.0 x16 64 "
     "GB/s nominal, ~50 GB/s typical pinned copies; 2x 8-channel DDR5 ~400 GB/s",
     50, 50, 40, 78.4, 1024, 450, 1800, 0.7, 12.0, 64,
     45, "PCIe 5.0 x16 peer copies between the node's H100 PCIe cards (64 GB/s nominal one "
     "way; no NVLink bridge assumed)",
     13.0, 6.6, "Samsung PM1743 (PCIe 5.0 x4 data-centre NVMe): 13000/6600 MB/s sequential "
     "read/write, the maker's announced peaks (clubic.com, 2021-12); sustained rates may be "
     "lower"},
    {"h200-141gb", "NVIDIA H200 141GB (PCIe 5.0 x16 host link)",
     "NVIDIA H200 datasheet (989 TFLOPS dense bf16 SXM, ~790 measured on a lent H200, "
     "4800 GB/s HBM3e); PCIe 5.0 x16 ~50 GB/s typical; 16-32 core DDR5 host",
     50, 50, 40, 139.1, 128, 500, 4000, 0.7, 8.0, 16,
     340, "NVLink 4 between the node's H200s (900 GB/s per GPU both ways, 450 one way; "
     "HGX H200 through NVSwitch, H200 NVL through its bridge)",
     13.0, 6.6, "Samsung PM1743 (PCIe 5.0 x4 data-centre NVMe): 13000/6600 MB/s sequential "
     "read/write, the maker's announced peaks (clubic.com, 2021-12); sustained rates may be "
     "lower"},
};

const char *fy_profile_names(void) {
    return "a100-40gb-pcie4, a100-80gb-pcie4, rtx4090-pcie4, h100-80gb-pcie5, h200-141gb";
}

fy_status fy_profile_named(const char *name, fy_profile *out) {
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++) {
        if (strcmp(name, named[i].name)) continue;
        memset(out, 0, sizeof *out);
        snprintf(out->name, sizeof out->name, "%s", named[i].name);
        snprintf(out->device, sizeof out->device, "%s", named[i].device);
        snprintf(out->source, sizeof out->source, "estimate: %s", named[i].source);
        out->estimate = true;
        out->h2d_gbps = named[i].h2d;
        out->d2h_gbps = named[i].d2h;
        out->duplex_h2d_gbps = out->duplex_d2h_gbps = named[i].duplex;
        out->latency_ms = 0.01;
        out->device_mem_gib = named[i].mem_gib;
        out->host_mem_gib = named[i].host_gib;
        out->cores = named[i].cores;
        out->numa_nodes = 1;
        out->adam_threads_max = named[i].cores < FY_PROFILE_MAX_THREADS ? named[i].cores : FY_PROFILE_MAX_THREADS;
        for (int t = 1; t <= out->adam_threads_max; t++) {
            double r = t * named[i].adam_per_thread;
            out->adam_gparams[t] = r < named[i].adam_max ? r : named[i].adam_max;
        }
        out->compute_tflops = named[i].tflops;
        out->device_mem_gbps = named[i].mem_gbps;
        out->coll_gbps = named[i].coll_gbps;
        out->coll_latency_ms = 0.02;
        out->coll_host_gbps = 8;
        out->coll_host_latency_ms = 0.01;
        snprintf(out->coll_source, sizeof out->coll_source, "estimate: %s", named[i].coll_source);
        out->disk_read_gbps = named[i].disk_read;
        out->disk_write_gbps = named[i].disk_write;
        out->disk_qdepth = 0; /* not stated with the figures */
        snprintf(out->disk_source, sizeof out->disk_source, "estimate: %s", named[i].disk_source);
        return FY_OK;
    }
    fy_log_error("unknown profile '%s' (a file, or one of: %s)", name, fy_profile_names());
    return FY_ERR_INVALID;
}

void fy_profile_slow(fy_profile *p, double s) {
    if (!(s > 1.0)) return;
    for (int k = 0; k < FY_T_COUNT; k++) {
        if (fy_task_kind_lane((fy_task_kind)k) != FY_LANE_COMPUTE) continue;
        for (int c = 0; c < FY_BLOCK_KINDS; c++) {
            p->block_a[k][c] *= s;
            p->block_b[k][c] *= s;
        }
    }
    p->compute_tflops /= s;
    p->device_mem_gbps /= s;
    char was[sizeof p->name];
    snprintf(was, sizeof was, "%s", p->name);
    snprintf(p->name, sizeof p->name, "%.40s, %gx slower", was, s);
}

double fy_profile_adam_gparams(const fy_profile *p, int threads) {
    int t = threads < p->adam_threads_max ? threads : p->adam_threads_max;
    while (t > 1 && p->adam_gparams[t] <= 0) t--;
    return t >= 1 ? p->adam_gparams[t] : 0.0;
}


fy_status fy_profile_save(const char *path, const fy_profile *p) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "format", "ferry-profile");
    cJSON_AddNumberToObject(r, "version", 1);
    cJSON_AddStringToObject(r, "name", p->name);
    cJSON_AddStringToObject(r, "device", p->device);
    cJSON_AddStringToObject(r, "source", p->source);
    cJSON_AddBoolToObject(r, "estimate", p->estimate);
    cJSON_AddNumberToObject(r, "h2d_gbps", p->h2d_gbps);
    cJSON_AddNumberToObject(r, "d2h_gbps", p->d2h_gbps);
    cJSON_AddNumberToObject(r, "duplex_h2d_gbps", p->duplex_h2d_gbps);
    cJSON_AddNumberToObject(r, "duplex_d2h_gbps", p->duplex_d2h_gbps);
    cJSON_AddNumberToObject(r, "latency_ms", p->latency_ms);
    if (p->nsizes) {
        cJSON *bs = cJSON_AddArrayToObject(r, "bandwidth_by_size");
        for (int i = 0; i < p->nsizes; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "mib", p->size_mib[i]);
            cJSON_AddNumberToObject(o, "h2d_gbps", p->h2d_by_size[i]);
            cJSON_AddNumberToObject(o, "d2h_gbps", p->d2h_by_size[i]);
            cJSON_AddItemToArray(bs, o);
        }
    }
    cJSON_AddNumberToObject(r, "device_mem_gib", p->device_mem_gib);
    cJSON_AddNumberToObject(r, "host_mem_gib", p->host_mem_gib);
    cJSON_AddNumberToObject(r, "cores", p->cores);
    cJSON_AddNumberToObject(r, "numa_nodes", p->numa_nodes);
    cJSON *adam = cJSON_AddArrayToObject(r, "adam_gparams_by_threads");
    for (int t = 1; t <= p->adam_threads_max; t++) cJSON_AddItemToArray(adam, cJSON_CreateNumber(p->adam_gparams[t]));
    cJSON_AddNumberToObject(r, "compute_tflops", p->compute_tflops);
    cJSON_AddNumberToObject(r, "device_mem_gbps", p->device_mem_gbps);
    if (p->coll_gbps > 0) {
        cJSON *cl = cJSON_AddObjectToObject(r, "collectives");
        cJSON_AddNumberToObject(cl, "ranks", p->coll_ranks);
        cJSON_AddNumberToObject(cl, "gbps", p->coll_gbps);
        cJSON_AddNumberToObject(cl, "latency_ms", p->coll_latency_ms);
        cJSON_AddNumberToObject(cl, "host_gbps", p->coll_host_gbps);
        cJSON_AddNumberToObject(cl, "host_latency_ms", p->coll_host_latency_ms);
        cJSON_AddStringToObject(cl, "source", p->coll_source);
    }
    if (p->disk_read_gbps > 0 && p->disk_write_gbps > 0) { /* both, or not known */
        cJSON *dk = cJSON_AddObjectToObject(r, "disk");
        cJSON_AddNumberToObject(dk, "read_gbps", p->disk_read_gbps);
        cJSON_AddNumberToObject(dk, "write_gbps", p->disk_write_gbps);
        cJSON_AddNumberToObject(dk, "qdepth", p->disk_qdepth);
        cJSON_AddStringToObject(dk, "source", p->disk_source);
    }
    if (p->has_blocks) {
        cJSON *b = cJSON_AddObjectToObject(r, "blocks");
        cJSON_AddStringToObject(b, "model", p->block_model);
        cJSON_AddNumberToObject(b, "seq", p->block_seq);
        cJSON_AddStringToObject(b, "dtype", fy_dtype_name(p->block_dtype == FY_BF16 ? FY_BF16 : FY_F32));
        cJSON *costs = cJSON_AddObjectToObject(b, "ms_a_plus_b_times_batch");
        for (int k = 0; k < FY_T_COUNT; k++) {
            cJSON *kc = NULL;
            for (int c = 0; c < FY_BLOCK_KINDS; c++) {
                if (p->block_a[k][c] == 0 && p->block_b[k][c] == 0) continue;
                if (!kc) kc = cJSON_AddObjectToObject(costs, fy_task_kind_name(k));
                cJSON *ab = cJSON_CreateArray();
                cJSON_AddItemToArray(ab, cJSON_CreateNumber(p->block_a[k][c]));
                cJSON_AddItemToArray(ab, cJSON_CreateNumber(p->block_b[k][c]));
                cJSON_AddItemToObject(kc, fy_block_kind_name((fy_block_kind)c), ab);
            }
        }
    }
    fy_status st = fy_json_write(path, "profile", r);
    cJSON_Delete(r);
    return st;
}

static bool num(const cJSON *o, const char *key, double lo, double hi, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi)) return false;
    *out = v->valuedouble;
    return true;
}

fy_status fy_profile_load(const char *path, fy_profile *out) {
    memset(out, 0, sizeof *out);
    cJSON *r;
    FY_TRY(fy_json_read(path, "profile", &r));
    const char *why = NULL;
    double v;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(r, "format");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "ferry-profile")) { why = "\"format\" is not \"ferry-profile\""; goto done; }
    const char *s;
    if ((s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(r, "name")))) snprintf(out->name, sizeof out->name, "%s", s);
    if ((s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(r, "device")))) snprintf(out->device, sizeof out->device, "%s", s);
    if ((s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(r, "source")))) snprintf(out->source, sizeof out->source, "%s", s);
    out->estimate = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "estimate"));
    if (!num(r, "h2d_gbps", 1e-3, 1e4, &out->h2d_gbps) || !num(r, "d2h_gbps", 1e-3, 1e4, &out->d2h_gbps) ||
        !num(r, "duplex_h2d_gbps", 1e-3, 1e4, &out->duplex_h2d_gbps) ||
        !num(r, "duplex_d2h_gbps", 1e-3, 1e4, &out->duplex_d2h_gbps) ||
        !num(r, "latency_ms", 0, 1e3, &out->latency_ms)) { why = "bandwidths must be positive numbers (GB/s), latency_ms >= 0"; goto done; }
    if (!num(r, "device_mem_gib", 0, 1e6, &out->device_mem_gib) || !num(r, "host_mem_gib", 0, 1e7, &out->host_mem_gib)) { why = "memory sizes must be numbers (GiB)"; goto done; }
    if (!num(r, "cores", 1, 1e5, &v)) { why = "cores must be a positive number"; goto done; }
    out->cores = (int)v;
    out->numa_nodes = num(r, "numa_nodes", 1, 1024, &v) ? (int)v : 1;
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(r, "bandwidth_by_size");
    for (int i = 0; cJSON_IsArray(bs) && i < cJSON_GetArraySize(bs) && i < 8; i++) {
        const cJSON *o = cJSON_GetArrayItem(bs, i);
        if (!num(o, "mib", 0, 1e9, &out->size_mib[i]) || !num(o, "h2d_gbps", 0, 1e6, &out->h2d_by_size[i]) ||
            !num(o, "d2h_gbps", 0, 1e6, &out->d2h_by_size[i])) { why = "bandwidth_by_size entries need mib, h2d_gbps, d2h_gbps"; goto done; }
        out->nsizes = i + 1;
    }
    const cJSON *adam = cJSON_GetObjectItemCaseSensitive(r, "adam_gparams_by_threads");
    int na = cJSON_IsArray(adam) ? cJSON_GetArraySize(adam) : 0;
    if (na < 1 || na > FY_PROFILE_MAX_THREADS) { why = "adam_gparams_by_threads must list 1..64 rates"; goto done; }
    out->adam_threads_max = na;
    for (int t = 1; t <= na; t++) {
        const cJSON *x = cJSON_GetArrayItem(adam, t - 1);
        if (!cJSON_IsNumber(x) || !(x->valuedouble > 0 && x->valuedouble < 1e4)) { why = "adam rates must be positive"; goto done; }
        out->adam_gparams[t] = x->valuedouble;
    }
    if (!num(r, "compute_tflops", 1e-6, 1e5, &out->compute_tflops) || !num(r, "device_mem_gbps", 1e-3, 1e6, &out->device_mem_gbps)) { why = "compute_tflops and device_mem_gbps must be positive"; goto done; }
    const cJSON *cl = cJSON_GetObjectItemCaseSensitive(r, "collectives");
    if (cl) {
        if (!num(cl, "gbps", 1e-3, 1e5, &out->coll_gbps) || !num(cl, "latency_ms", 0, 1e4, &out->coll_latency_ms)) {
            why = "collectives needs gbps (positive, GB/s) and latency_ms (>= 0)";
            goto done;
        }
        out->coll_ranks = num(cl, "ranks", 0, FY_MAX_SHARDS, &v) ? (int)v : 0;
        out->coll_host_gbps = out->coll_gbps; /* not said: one path */
        out->coll_host_latency_ms = out->coll_latency_ms;
        if (cJSON_GetObjectItemCaseSensitive(cl, "host_gbps") &&
            (!num(cl, "host_gbps", 1e-3, 1e5, &out->coll_host_gbps) ||
             !num(cl, "host_latency_ms", 0, 1e4, &out->coll_host_latency_ms))) {
            why = "collectives.host_gbps must be positive (GB/s), with host_latency_ms >= 0";
            goto done;
        }
        if ((s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(cl, "source"))))
            snprintf(out->coll_source, sizeof out->coll_source, "%s", s);
    }
    /* profiles from before the disk tier have none: 0, not known */
    const cJSON *dk = cJSON_GetObjectItemCaseSensitive(r, "disk");
    if (dk) {
        if (!num(dk, "read_gbps", 1e-6, 1e5, &out->disk_read_gbps) ||
            !num(dk, "write_gbps", 1e-6, 1e5, &out->disk_write_gbps)) {
            why = "disk needs read_gbps and write_gbps (positive, GB/s)";
            goto done;
        }
        out->disk_qdepth = num(dk, "qdepth", 0, 1e4, &v) ? (int)v : 0;
        if ((s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(dk, "source"))))
            snprintf(out->disk_source, sizeof out->disk_source, "%s", s);
    }
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(r, "blocks");
    const cJSON *bm = b ? cJSON_GetObjectItemCaseSensitive(b, "model") : NULL;
    if (cJSON_IsObject(bm)) {
        /* written by a ferry before the model interface: its block costs name no family */
        fy_log_info("profile %s: block costs from an older ferry are ignored (probe again to "
                    "measure them)", path);
        b = NULL;
    }
    if (b) {
        const char *ms = cJSON_GetStringValue(bm);
        if (!ms || !*ms || strlen(ms) >= sizeof out->block_model) {
            why = "blocks.model must name the model the block costs were measured on";
            goto done;
        }
        snprintf(out->block_model, sizeof out->block_model, "%s", ms);
        if (!num(b, "seq", 1, 1e7, &v)) { why = "blocks.seq must be positive"; goto done; }
        out->block_seq = (int)v;
        const char *bd = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(b, "dtype"));
        out->block_dtype = FY_F32; /* profiles from before storage types were fp32 */
        if (bd && (fy_dtype_parse(bd, &out->block_dtype) != 0 ||
                   (out->block_dtype != FY_F32 && out->block_dtype != FY_BF16))) {
            why = "blocks.dtype must be \"fp32\" or \"bf16\"";
            goto done;
        }
        const cJSON *costs = cJSON_GetObjectItemCaseSensitive(b, "ms_a_plus_b_times_batch");
        for (int k = 0; k < FY_T_COUNT; k++) {
            const cJSON *kc = cJSON_GetObjectItemCaseSensitive(costs, fy_task_kind_name(k));
            for (int c = 0; c < FY_BLOCK_KINDS && kc; c++) {
                const cJSON *ab = cJSON_GetObjectItemCaseSensitive(kc, fy_block_kind_name((fy_block_kind)c));
                if (!ab) continue;
                if (!cJSON_IsArray(ab) || cJSON_GetArraySize(ab) != 2 ||
                    !cJSON_IsNumber(cJSON_GetArrayItem(ab, 0)) || !cJSON_IsNumber(cJSON_GetArrayItem(ab, 1))) {
                    why = "block costs must be [a, b] pairs";
                    goto done;
                }
                out->block_a[k][c] = cJSON_GetArrayItem(ab, 0)->valuedouble;
                out->block_b[k][c] = cJSON_GetArrayItem(ab, 1)->valuedouble;
            }
        }
        out->has_blocks = true;
    }
done:
    cJSON_Delete(r);
    if (why) {
        fy_log_error("profile %s: %s", path, why);
        return FY_ERR_FORMAT;
    }
    return FY_OK;
}

/* A path that exists (whatever it is: fy_profile_load refuses what is not a regular
 * file) is a file; anything else a name. */
fy_status fy_profile_open(const char *path_or_name, fy_profile *out) {
    struct stat sb;
    if (stat(path_or_name, &sb) == 0) return fy_profile_load(path_or_name, out);
    return fy_profile_named(path_or_name, out);
}
