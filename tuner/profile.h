/* profile.h — what the tuner knows about a machine: transfer bandwidths, memory, CPU
 * Adam throughput, and the cost of the model's blocks.
 *
 * A profile is measured by `ferry probe` (fy_probe) or taken from a named profile of
 * hardware ferry may not run on (estimates, each with its source). Block costs come in two
 * forms: measured, for one model shape and sequence length, as a linear fit in the
 * micro-batch size (ms = a + b * B) per task kind; or analytic, from an effective GEMM
 * throughput and memory bandwidth (used when no measurement matches the model).
 *
 * Files are JSON (fy_profile_save / fy_profile_load), refused with one error line when
 * malformed. */
#ifndef FY_PROFILE_H
#define FY_PROFILE_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/core/status.h"
#include "engine/model/model.h"
#include "engine/tasks.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_PROFILE_MAX_THREADS 64

typedef struct fy_profile {
    char name[64];
    char source[512];          /* where the numbers come from */
    bool estimate;             /* not measured on this machine */
    char device[128];
    double h2d_gbps, d2h_gbps;             /* pinned, large transfers, one direction */
    double duplex_h2d_gbps, duplex_d2h_gbps; /* both directions at once */
    double latency_ms;                     /* per transfer */
    int nsizes;                            /* H2D/D2H GB/s by transfer size (probe only) */
    double size_mib[8], h2d_by_size[8], d2h_by_size[8];
    double device_mem_gib, host_mem_gib;
    int cores, numa_nodes;
    int adam_threads_max;
    double adam_gparams[FY_PROFILE_MAX_THREADS + 1]; /* CPU AdamW G params/s by threads */
    /* data parallel: the collectives between the ranks of a job, as a reduce-scatter or an
     * all-gather of S bytes over N ranks takes coll_latency_ms + S (N - 1) / N / coll_gbps
     * (coll_gbps: NCCL's "bus bandwidth"); coll_gbps 0: not known (probed alone). Two
     * paths: device memory (NCCL between GPUs; the cpu backend's is host memory) and host
     * memory over MPI (the blocks whose gradients and weights the CPU keeps) */
    int coll_ranks;            /* the job size they were measured with (0: estimates) */
    double coll_gbps, coll_latency_ms;           /* device memory */
    double coll_host_gbps, coll_host_latency_ms; /* host memory, MPI */
    char coll_source[256];
    /* the disk tier (offload/disk.h): sequential GB/s (1e9 bytes) of its scratch file, as
     * fy_disk_bench measures them (written and fdatasynced, then read back) at queue depth
     * disk_qdepth; a named profile's are a datasheet's peaks (disk_qdepth 0: not stated).
     * 0: not known (probe --disk-dir measures them) */
    double disk_read_gbps, disk_write_gbps;
    int disk_qdepth;
    char disk_source[256];
    /* analytic compute model */
    double compute_tflops;     /* effective matmul throughput */
    double device_mem_gbps;    /* memory-bound device work */
    /* measured block costs (valid when has_blocks) */
    bool has_blocks;
    char block_model[256];     /* fy_model_signature of the model they were measured on */
    int block_seq;
    fy_dtype block_dtype;      /* the storage type the blocks were measured in */
    /* per task kind and block kind: ms = a + b * micro_batch */
    double block_a[FY_T_COUNT][FY_BLOCK_KINDS], block_b[FY_T_COUNT][FY_BLOCK_KINDS];
} fy_profile;

/* Named profiles: "a100-40gb-pcie4", "a100-80gb-pcie4", "rtx4090-pcie4", "h100-80gb-pcie5",
 * "h200-141gb".
 * FY_ERR_INVALID (logged, listing the names) if unknown. */
fy_status fy_profile_named(const char *name, fy_profile *out);
const char *fy_profile_names(void);

fy_status fy_profile_save(const char *path, const fy_profile *p);
fy_status fy_profile_load(const char *path, fy_profile *out);
/* A profile from a file path or a name. */
fy_status fy_profile_open(const char *path_or_name, fy_profile *out);

/* The profile of the same machine with its device's work s times slower (the cpu
 * backend's --sim-slowdown: every compute-lane task, measured or analytic; transfers,
 * collectives, the disk and CPU AdamW as they were). s <= 1 leaves it as it is. */
void fy_profile_slow(fy_profile *p, double s);

/* CPU AdamW throughput with t threads (nearest measured count at or below t). */
double fy_profile_adam_gparams(const fy_profile *p, int threads);

#ifdef __cplusplus
}
#endif
#endif
