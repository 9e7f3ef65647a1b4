/* probe.h — measuring a machine into a profile (`ferry probe`).
 *
 * Measures, through the device interface: H2D and D2H bandwidth from pinned memory (each
 * alone and both at once, over transfer sizes) and the per-transfer latency; device and
 * host memory, cores and NUMA nodes; optim_cpu's AdamW throughput per thread count; and
 * the model's block costs: the engine itself trains a few steps serially (all resident,
 * every layer recomputed, so every compute task kind runs) at two micro-batch sizes (1
 * and the batch, the ends of the sizes the tuner chooses among; 1 and 2 for a batch of
 * 1), and
 * the measured task times are fitted as a + b * micro-batch per task kind and block
 * kind. On the cpu backend with --sim-pcie-gbps the bandwidths are the emulated link's.
 * Under a launcher (cfg->comm of several processes: every rank probes at once, as they
 * train) also the collectives between the ranks: reduce-scatters and all-gathers of two
 * sizes, on device memory as a data-parallel job's blocks (NCCL on GPUs, MPI on the cpu
 * backend), fitted as latency + bytes (N - 1) / N / bandwidth. With a disk directory, last,
 * the disk tier's drive: fy_disk_bench's sequential write (synced) and read of a scratch
 * file there at FY_DISK_QDEPTH (the caller has checked the directory: fy_disk_check_dir). */
#ifndef FY_PROBE_H
#define FY_PROBE_H

#include "engine/comm/comm.h"
#include "engine/device/device.h"
#include "tuner/profile.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_probe_cfg {
    fy_dev_cfg dev;
    const fy_model *model;
    int batch, seq;        /* the micro-batch to measure around */
    int adam_threads_max;  /* 0 = the cores available */
    fy_dtype dtype;        /* the storage type the block costs are measured in */
    bool quiet;
    fy_comm *comm;         /* the job's processes (NULL or one: no collectives) */
    const char *disk_dir;  /* the disk tier's directory; NULL: the disk is not probed */
    size_t disk_nbytes;    /* its scratch file's size (0: 1 GiB) */
} fy_probe_cfg;

fy_status fy_probe(const fy_probe_cfg *cfg, fy_profile *out);

#ifdef __cplusplus
}
#endif
#endif
