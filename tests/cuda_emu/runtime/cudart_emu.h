/* cudart_emu.h — inside libfy_cudart_emu.so, the emulated CUDA runtime (emu_rt.h says what
 * its parts are): the state its files share.
 *
 *   cudart_emu_proc.cc    the emulated devices' processes: the first call reserves every
 *                         device's address range and the pinned arena, maps the control
 *                         memory both sides share, and forks one process per device, which
 *                         maps that device's allocations and runs its work; a fault there is
 *                         the device's sticky error;
 *   cudart_emu_mem.cc     allocations and their accounting (contexts, modules, libraries),
 *                         the pointer kinds (fy_emu_mem_of);
 *   cudart_emu_stream.cc  streams (a host worker each), host functions, waits;
 *   cudart_emu_event.cc   events;
 *   cudart_emu_copy.cc    copies and memsets;
 *   cudart_emu_launch.cc  kernel launches (cuda_emu.h's FY_LAUNCH), the race check;
 *   cudart_emu.cc         devices, versions, properties, errors.
 *
 * Errors: every entry point returns CUDA's code and leaves a failure as the calling
 * thread's last error (emu_ret); a device's sticky error (a fault, a dead device process)
 * lives in the control memory, so both processes see it, and every later call that
 * touches the device returns it.
 *
 * What it cannot see: kernels never run at the same time as each other (the kernel
 * emulator runs one grid at a time, cuda_emu.cc), so two kernels on streams that miss an
 * event between them run in some order instead of overlapping, and only a wrong result
 * shows it; the race check (FERRY_EMU_RACECHECK=1) restores device allocations between a
 * kernel's three runs, not pinned memory, so a kernel that updates pinned memory in
 * place is not checked for races there; a kernel that reads pageable host memory through
 * a pointer it was not given as an argument (one stored in device memory) reads a copy as
 * old as the device process, where a GPU faults. */
#ifndef FY_CUDART_EMU_H
#define FY_CUDART_EMU_H

#ifndef __cplusplus
#error "cudart_emu.h is the C++ runtime's"
#endif

#include <pthread.h>
#include <sys/types.h>

#include <atomic>
#include <unordered_set>

#include "tests/cuda_emu/runtime/emu_rt.h"

#define EMU_MAX_GPUS 16
#define EMU_MAX_ALLOCS 16384           /* live allocations a device (and the pinned arena) holds */
#define EMU_GRANULE ((size_t)2 << 20)  /* the driver's device allocation granularity */
#define EMU_PAGE ((size_t)4096)

/* ---- memory shared with the device processes ----------------------------------------- */

/* One live allocation: [base, base + nbytes) is what the caller got; [slot, slot +
 * slot_nbytes) the address range it takes (its rounded size and the guard after it). */
typedef struct emu_alloc {
    uintptr_t base;
    size_t nbytes;
    uintptr_t slot;
    size_t slot_nbytes;
    int internal;                      /* the runtime's own (a stream's staging buffer) */
    int dev;                           /* its device (pinned: the one current at the call) */
} emu_alloc;

typedef struct emu_table {
    int n;                             /* sorted by base */
    emu_alloc a[EMU_MAX_ALLOCS];
} emu_table;

typedef struct emu_gpu_shared {
    std::atomic<int> sticky;                /* cudaError_t: cudaSuccess, or the device's sticky error */
    size_t charged;                    /* device memory in use, as cudaMemGetInfo counts it */
    emu_table allocs;
} emu_gpu_shared;

typedef struct emu_shared {
    pthread_mutex_t mu;                /* process-shared, robust: the tables and `charged` */
    emu_gpu_shared gpu[EMU_MAX_GPUS];
    emu_table pinned;
} emu_shared;

/* ---- the process's state --------------------------------------------------------------- */

typedef struct emu_stream emu_stream;

typedef struct emu_gpu {
    uintptr_t lo, hi;                  /* the device's address range (PROT_NONE in the host) */
    int ctl;                           /* the host's end of the device process's control socket */
    pthread_mutex_t ctl_mu;            /* one control request at a time */
    pid_t pid;
    std::atomic<int> ctx;                   /* the primary context exists (its memory is charged) */
    std::atomic<int> module;                /* the kernels' module is loaded (charged) */
    std::atomic<unsigned> flags;            /* cudaSetDeviceFlags */
    pthread_mutex_t mu;                /* the stream list and the legacy stream */
    emu_stream *streams;               /* live streams, the legacy one included */
    emu_stream *legacy;                /* the NULL stream, made at its first use */
} emu_gpu;

typedef struct emu_state {
    int ngpus;
    size_t capacity;                   /* per device: FERRY_EMU_GPU_MEM */
    bool strict;                       /* FERRY_EMU_STRICT (default 1) */
    bool racecheck;                    /* FERRY_EMU_RACECHECK */
    int driver_version;                /* FERRY_EMU_DRIVER_VERSION, else CUDART_VERSION */
    pid_t pid;                         /* the host process */
    emu_shared *sh;
    char *pinned;                      /* the pinned arena, mapped shared at one address */
    size_t pinned_nbytes;
    emu_gpu gpu[EMU_MAX_GPUS];
} emu_state;

extern emu_state g_emu;

/* The live handles of one kind (streams, events; T has an atomic `refs`): a handle is live
 * from its create to its destroy. get takes a reference under the lock, so a destroy that
 * runs meanwhile cannot free what get hands out; a dead or unknown handle is NULL. */
template <typename T> struct emu_handles {
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    std::unordered_set<const void *> *live = nullptr;

    void add(T *h) {
        pthread_mutex_lock(&mu);
        if (!live) live = new std::unordered_set<const void *>();
        live->insert(h);
        pthread_mutex_unlock(&mu);
    }
    T *get(const void *h) {
        pthread_mutex_lock(&mu);
        T *t = h && live && live->count(h) ? (T *)h : NULL;
        if (t) t->refs++;
        pthread_mutex_unlock(&mu);
        return t;
    }
    /* No longer live: the handle, whose reference the caller now holds, or NULL. */
    T *remove(const void *h) {
        pthread_mutex_lock(&mu);
        T *t = h && live && live->erase(h) ? (T *)h : NULL;
        pthread_mutex_unlock(&mu);
        return t;
    }
};

/* ---- cudart_emu_proc.cc ---------------------------------------------------------------- */

/* Starts the emulation once per process (every entry point's first step): cudaSuccess, or
 * the error that stopped it (reported), which every later call returns. */
cudaError_t emu_init(void);
/* Locks the shared tables (a device process that died holding the lock left them whole:
 * it only reads them). */
void emu_lock(void);
void emu_unlock(void);
/* Control requests to device d's process: map [lo, hi) readable and writable, unmap it
 * (contents dropped), take fd as a new stream's channel. cudaSuccess or the sticky error. */
cudaError_t emu_ctl_map(int d, uintptr_t lo, size_t nbytes);
cudaError_t emu_ctl_unmap(int d, uintptr_t lo, size_t nbytes);
cudaError_t emu_ctl_stream(int d, int fd);
/* Device d's sticky error, cudaSuccess if none; emu_fail sets it (the first one stays)
 * and reports why once. */
cudaError_t emu_sticky(int d);
void emu_fail(int d, cudaError_t e, const char *why);
/* In a device process: which device it is. */
int emu_device_index(void);
/* Whether fn's code was mapped when the device processes were forked (they have it). */
bool emu_code_on_device(const void *fn);

/* One device work item on a stream's channel: the header, then nbytes of arguments. */
typedef struct emu_msg {
    fy_emu_dev_fn fn;
    uint32_t nbytes;
    char what[64];
} emu_msg;

/* ---- cudart_emu.cc: errors and the calling thread -------------------------------------- */

/* Records e as the calling thread's last error (unless cudaSuccess) and returns it. */
cudaError_t emu_ret(cudaError_t e);
/* The prologue of an entry point: the emulation started, not called from a host function,
 * and (ctx) the calling thread's device has its context and no sticky error. *dev is that
 * device. */
cudaError_t emu_enter(bool ctx, int *dev);
#define EMU_ENTER(ctx, dev)                          \
    int dev;                                         \
    do {                                             \
        cudaError_t e_ = emu_enter((ctx), &dev);     \
        if (e_ != cudaSuccess) return emu_ret(e_);   \
    } while (0)
/* The calling thread is running a host function (cudaLaunchHostFunc). */
extern thread_local bool emu_in_host_fn;

/* ---- cudart_emu_mem.cc ----------------------------------------------------------------- */

/* Creates device d's context (its memory charged) unless it exists. */
cudaError_t emu_ctx(int d);
/* Charges nbytes of device d's memory: cudaErrorMemoryAllocation if it does not fit. */
cudaError_t emu_charge(int d, size_t nbytes);
void emu_uncharge(int d, size_t nbytes);
/* Where [p, p + nbytes) lies, and for device and pinned memory, the allocation's device
 * (-1 otherwise). */
fy_emu_mem emu_mem_find(const void *p, size_t nbytes, int *dev);
/* Runtime-internal pinned memory (a stream's staging buffer): NULL if the arena is full. */
void *emu_pinned_internal(size_t nbytes);
void emu_pinned_internal_free(void *p);
/* Device d's live allocations, copied into out (at most cap); their number. */
int emu_dev_allocs(int d, emu_alloc *out, int cap);

/* ---- cudart_emu_stream.cc -------------------------------------------------------------- */

/* The stream behind a handle (NULL: the legacy stream of device `dev`), with a reference
 * the caller drops with emu_stream_put; NULL for an unknown or destroyed handle. */
emu_stream *emu_stream_get(cudaStream_t s, int dev);
/* The same, or the error for the handle (reported, naming `call`: a destroyed or unknown
 * handle is a bug a GPU would not always catch). */
cudaError_t emu_stream_lookup(cudaStream_t s, int dev, const char *call, emu_stream **out);
void emu_stream_ref(emu_stream *st);
void emu_stream_put(emu_stream *st);
int emu_stream_dev(const emu_stream *st);
/* Queues a marker on st: mark(arg) runs on its worker when the earlier work is done
 * (after a device error too), release(arg) when the marker is dropped (release also when
 * it cannot be queued). Its number in *seq. */
cudaError_t emu_stream_mark(emu_stream *st, void (*mark)(void *arg), void (*release)(void *arg), void *arg,
                            uint64_t *seq);
/* Queues on st a wait for stream `on` to have done its item seq (taking the caller's
 * reference to on). */
cudaError_t emu_stream_wait_for(emu_stream *st, emu_stream *on, uint64_t seq);
/* Whether st has done its item seq; waiting for it (spinning: a busy loop, or blocking). */
bool emu_stream_done(emu_stream *st, uint64_t seq);
void emu_stream_wait_done(emu_stream *st, uint64_t seq, bool spin);
/* Queues device work (a copy of args) on st. */
cudaError_t emu_stream_dev_work(emu_stream *st, fy_emu_dev_fn fn, const void *args, size_t nbytes,
                                const char *what);
/* Runs fn(st, arg) on st's host worker in stream order and waits for it (the stream's
 * earlier work done first); fn may call emu_worker_dev_work. fn's result. */
cudaError_t emu_stream_run_sync(emu_stream *st, cudaError_t (*fn)(emu_stream *st, void *arg), void *arg);
/* From a host worker (inside emu_stream_run_sync's fn): runs device work on the stream's
 * channel now and returns its result. */
cudaError_t emu_worker_dev_work(emu_stream *st, fy_emu_dev_fn fn, const void *args, size_t nbytes,
                                const char *what);
/* Waits for the work queued on device d's streams so far (spinning or blocking); the
 * device's sticky error, else the first error its work met since the last wait. */
cudaError_t emu_device_sync(int d, bool spin);
/* Whether a wait for device d spins (cudaSetDeviceFlags: all but BlockingSync). */
bool emu_dev_spins(int d);
/* The stream's pinned staging buffer (EMU_STAGE_NBYTES), made at its first use. */
#define EMU_STAGE_NBYTES ((size_t)8 << 20)
char *emu_stream_stage(emu_stream *st);

#endif
