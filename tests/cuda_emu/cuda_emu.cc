/* cuda_emu.cc — the emulation's runtime (cuda_emu.h): a block's threads as fibers, the
 * scheduler that runs them between barriers in the order asked for, the warp exchange,
 * the launch errors, the race check over the three orders. One OS thread runs a grid;
 * several OS threads may each run their own (the state is thread_local). */
#include "tests/cuda_emu/cuda_emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <mutex>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

/* Switching fibers. On x86-64, a switch saves the callee-saved registers on the current
 * stack, stores the stack pointer and loads the other's: no signal mask, so no system
 * call (glibc's swapcontext makes one per switch, which was most of the emulation's
 * time). Elsewhere, ucontext. */
#if defined(__x86_64__)
extern "C" void fy_emu_switch(void **save_sp, void *load_sp);
__asm__(".text\n"
        ".globl fy_emu_switch\n"
        ".type fy_emu_switch,@function\n"
        "fy_emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size fy_emu_switch, .-fy_emu_switch\n");
struct fiber_ctx { void *sp; };
/* A new fiber's stack: as if fy_emu_switch had saved six registers and would return
 * into entry, which is entered with the stack aligned as a call leaves it. */
static void fiber_init(fiber_ctx *c, char *stack, size_t size, void (*entry)()) {
    uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;              /* entry's return address slot: entry never returns */
    *--sp = (void *)entry;        /* fy_emu_switch's ret goes here */
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    c->sp = sp;
}
static void fiber_switch(fiber_ctx *from, fiber_ctx *to) { fy_emu_switch(&from->sp, to->sp); }
#else
struct fiber_ctx { ucontext_t uc; };
static void fiber_init(fiber_ctx *c, char *stack, size_t size, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
static void fiber_switch(fiber_ctx *from, fiber_ctx *to) { swapcontext(&from->uc, &to->uc); }
#endif

namespace fy_emu {

static std::mutex g_launch_mu;
thread_local uint3 cur_thread_idx, cur_block_idx;
thread_local dim3 cur_block_dim, cur_grid_dim;

enum { READY, AT_BARRIER, AT_WARP, DONE };

#define STACK_NBYTES ((size_t)256 << 10) /* kernels keep small locals; ASan's frames are big */
#define MAX_THREADS 1024

struct thread_state {
    fiber_ctx ctx;
    int state;
    uint3 idx;
    uint64_t deposit;          /* AT_WARP: the lane's value, */
    int op_kind;               /* the operation, */
    uint64_t op_count;         /* and how many the lane did before it (lanes at one
                                  exchange agree on both; code positions would not do:
                                  the compiler may clone a loop per branch) */
#ifdef EMU_ASAN
    void *fake;                /* AddressSanitizer's fake stack while switched out */
#endif
};

struct block_run {
    fiber_ctx sched;
    thread_state *th;
    int n;                     /* threads in the block */
    int cur;                   /* the running thread */
    void (*fn)(void *);
    void *ctx;
    const char *name;
    char *shared_lo, *shared_hi; /* the __shared__ section */
    uint64_t released[MAX_THREADS / 32][32]; /* per warp: the last exchange's deposits */
#ifdef EMU_ASAN
    void *sched_fake;          /* the scheduler's, while a fiber runs */
    const void *sched_stack_bottom;
    size_t sched_stack_size;
#endif
};

static thread_local block_run *g_run;
static thread_local int g_order;
#ifndef FY_CUDA_EMU_RT
static thread_local cudaError_t g_last_error = cudaSuccess;
#endif
/* MAX_THREADS stacks and thread states, made once per OS thread, freed with it */
struct fibers {
    char *stacks = nullptr;
    thread_state *threads = nullptr;
    ~fibers() {
        if (stacks) munmap(stacks, (size_t)MAX_THREADS * STACK_NBYTES);
        free(threads);
    }
};
static thread_local fibers g_fibers;
#define g_stacks (g_fibers.stacks)
#define g_threads (g_fibers.threads)

[[noreturn]] static void fail(const char *what) {
    fprintf(stderr, "cuda emulation: kernel %s: %s\n", g_run ? g_run->name : "?", what);
    abort();
}

/* Back to the scheduler from the running fiber (it is blocked or done). */
static void yield_to_scheduler() {
    block_run *r = g_run;
    thread_state *t = &r->th[r->cur];
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(t->state == DONE ? nullptr : &t->fake, r->sched_stack_bottom,
                                   r->sched_stack_size);
#endif
    fiber_switch(&t->ctx, &r->sched);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(t->fake, nullptr, nullptr);
#endif
}

static void fiber_main() {
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_run->sched_stack_bottom, &g_run->sched_stack_size);
#endif
    g_run->fn(g_run->ctx);
    g_run->th[g_run->cur].state = DONE;
    yield_to_scheduler();
    fail("a finished thread was resumed");
}

void syncthreads() {
    if (!g_run) fail("__syncthreads outside a kernel");
    g_run->th[g_run->cur].state = AT_BARRIER;
    yield_to_scheduler();
}

int lane_of_caller() { return g_run->cur & 31; }

void check_full_mask(unsigned mask) {
    if (mask != 0xffffffffu) fail("a warp operation with a partial mask (not emulated)");
    if ((g_run->cur / 32 + 1) * 32 > g_run->n) fail("a warp operation in a partial warp");
}

void warp_exchange(uint64_t value, uint64_t out[32], int kind) {
    block_run *r = g_run;
    thread_state *t = &r->th[r->cur];
    t->deposit = value;
    t->op_kind = kind;
    t->op_count++;
    t->state = AT_WARP;
    yield_to_scheduler();
    memcpy(out, r->released[r->cur / 32], 32 * sizeof(uint64_t));
}

/* The order of this round: forward, reverse, or a shuffle (xorshift, seeded per block). */
static void round_order(int *ord, int n, uint64_t *rng) {
    for (int i = 0; i < n; i++) ord[i] = g_order == 1 ? n - 1 - i : i;
    if (g_order != 2) return;
    for (int i = n - 1; i > 0; i--) {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        int j = (int)(*rng % (uint64_t)(i + 1)), k = ord[i];
        ord[i] = ord[j];
        ord[j] = k;
    }
}

/* Thread i's fiber, ready to start at fiber_main (getcontext, where it is used, returns
 * twice in principle: kept out of the caller's loop). */
__attribute__((noinline)) static void make_fiber(thread_state *t, int i) {
    t->state = READY;
    t->op_count = 0;
    t->idx = uint3{(unsigned)i % cur_block_dim.x, (unsigned)i / cur_block_dim.x % cur_block_dim.y,
                   (unsigned)i / (cur_block_dim.x * cur_block_dim.y)};
    fiber_init(&t->ctx, g_stacks + (size_t)i * STACK_NBYTES, STACK_NBYTES, fiber_main);
}

static void run_block(block_run *r, uint64_t seed) {
    static thread_local int ord[MAX_THREADS];
    if (r->shared_hi > r->shared_lo) memset(r->shared_lo, 0xff, (size_t)(r->shared_hi - r->shared_lo));
    for (int i = 0; i < r->n; i++) make_fiber(&r->th[i], i);
    uint64_t rng = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int done = 0; done < r->n;) {
        round_order(ord, r->n, &rng);
        for (int k = 0; k < r->n; k++) {
            thread_state *t = &r->th[ord[k]];
            if (t->state != READY) continue;
            r->cur = ord[k];
            cur_thread_idx = t->idx;
#ifdef EMU_ASAN
            __sanitizer_start_switch_fiber(&r->sched_fake, g_stacks + (size_t)ord[k] * STACK_NBYTES,
                                           STACK_NBYTES);
#endif
            fiber_switch(&r->sched, &t->ctx);
#ifdef EMU_ASAN
            __sanitizer_finish_switch_fiber(r->sched_fake, nullptr, nullptr);
#endif
        }
        /* every thread is blocked or done: release what can go on */
        int at_barrier = 0, at_warp = 0;
        done = 0;
        for (int i = 0; i < r->n; i++) {
            done += r->th[i].state == DONE;
            at_barrier += r->th[i].state == AT_BARRIER;
            at_warp += r->th[i].state == AT_WARP;
        }
        bool released = false;
        for (int w = 0; w * 32 < r->n && at_warp; w++) {
            int waiting = 0, gone = 0;
            for (int l = 0; l < 32; l++) {
                waiting += r->th[w * 32 + l].state == AT_WARP;
                gone += r->th[w * 32 + l].state == DONE;
            }
            if (waiting == 32) {
                const thread_state *l0 = &r->th[w * 32];
                for (int l = 1; l < 32; l++)
                    if (r->th[w * 32 + l].op_kind != l0->op_kind || r->th[w * 32 + l].op_count != l0->op_count)
                        fail("the lanes of a warp wait at different warp operations");
                for (int l = 0; l < 32; l++) {
                    r->released[w][l] = r->th[w * 32 + l].deposit;
                    r->th[w * 32 + l].state = READY;
                }
                released = true;
            } else if (waiting && gone) {
                fail("a warp operation some lanes of the warp never reach (they returned)");
            }
        }
        if (!released && at_barrier && at_barrier + done == r->n) {
            for (int i = 0; i < r->n; i++)
                if (r->th[i].state == AT_BARRIER) r->th[i].state = READY;
            released = true;
        }
        if (!released && done < r->n)
            fail("deadlock: threads wait at __syncthreads while others wait at a warp operation "
                 "(a divergent barrier)");
    }
}

/* A stride coprime to n (and an offset in *rng): k -> (k * stride + offset) % n visits
 * every block once in a scrambled order, without a table of n entries. */
static uint64_t shuffle_stride(uint64_t n, uint64_t *rng) {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    uint64_t s = n > 2 ? *rng % (n - 1) + 1 : 1;
    while (n > 1) {
        uint64_t a = s, b = n;
        while (b) { uint64_t t = a % b; a = b; b = t; }
        if (a == 1) break;
        s = s % (n - 1) + 1;
    }
    return s;
}

bool launch_config_ok(dim3 grid, dim3 block, size_t shmem) {
    const size_t nthreads = (size_t)block.x * block.y * block.z;
    /* CUDA's limits (compute capability 3.0 and later): grid.x up to 2^31 - 1 */
    return nthreads > 0 && nthreads <= MAX_THREADS && block.z <= 64 && grid.x > 0 && grid.y > 0 &&
           grid.z > 0 && grid.x <= 2147483647u && grid.y <= 65535 && grid.z <= 65535 && shmem == 0;
}

void run_grid(dim3 grid, dim3 block, size_t shmem, const char *name, void (*fn)(void *), void *ctx,
              char *shared_lo, char *shared_hi) {
    const size_t nthreads = (size_t)block.x * block.y * block.z;
    if (!launch_config_ok(grid, block, shmem)) {
#ifdef FY_CUDA_EMU_RT
        fail("a launch configuration the runtime should have refused");
#else
        g_last_error = cudaErrorInvalidConfiguration;
        return;
#endif
    }
    std::lock_guard<std::mutex> one_at_a_time(g_launch_mu); /* the shared section is global */
    if (!g_stacks) {
        void *p = mmap(nullptr, (size_t)MAX_THREADS * STACK_NBYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) fail("cannot map the fibers' stacks");
        g_stacks = (char *)p;
        for (int i = 0; i < MAX_THREADS; i++) /* a stack that overflows faults */
            mprotect(g_stacks + (size_t)i * STACK_NBYTES, 4096, PROT_NONE);
        g_threads = (thread_state *)calloc(MAX_THREADS, sizeof *g_threads);
        if (!g_threads) fail("out of memory");
    }
    block_run *r = new block_run();
    r->th = g_threads;
    r->n = (int)nthreads;
    r->fn = fn;
    r->ctx = ctx;
    r->name = name;
    r->shared_lo = shared_lo;
    r->shared_hi = shared_hi;
    block_run *outer = g_run;
    g_run = r;
    cur_block_dim = block;
    cur_grid_dim = grid;
    /* blocks in the order asked for too: a result that depends on it is a race between
     * blocks (two blocks writing one element, one reading what another writes) */
    const uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
    uint64_t rng = 0x2545f4914f6cdd1dull;
    const uint64_t stride = g_order == 2 ? shuffle_stride(nblocks, &rng) : 1;
    for (uint64_t k = 0; k < nblocks; k++) {
        uint64_t b = g_order == 1 ? nblocks - 1 - k : (k * stride + (g_order == 2 ? rng : 0)) % nblocks;
        cur_block_idx = uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                              (unsigned)(b / ((uint64_t)grid.x * grid.y))};
        run_block(r, k + 1);
    }
    g_run = outer;
    delete r;
}

/* The m16n8k16 fragments' places (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
 * floating point type"), for lane l: g = l >> 2 (groupID), t = l % 4 (threadID_in_group).
 * A's element a_i (i = 0..7, register i / 2, its low half for even i): row g for i in
 * {0, 1, 4, 5}, else g + 8; column 2t + (i & 1), plus 8 for i >= 4. B's b_i (i = 0..3):
 * row 2t + (i & 1), plus 8 for i >= 2; column g. C's and D's c_i: row g for i < 2, else
 * g + 8; column 2t + (i & 1). */
static float bf16_half(uint32_t reg, int hi) {
    uint32_t u = (hi ? reg >> 16 : reg & 0xffffu) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    check_full_mask(0xffffffffu);
    uint64_t a01[32], a23[32], bb[32];
    warp_exchange((uint64_t)a[0] | (uint64_t)a[1] << 32, a01, 4);
    warp_exchange((uint64_t)a[2] | (uint64_t)a[3] << 32, a23, 4);
    warp_exchange((uint64_t)b[0] | (uint64_t)b[1] << 32, bb, 4);
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        const uint32_t ra[4] = {(uint32_t)a01[l], (uint32_t)(a01[l] >> 32), (uint32_t)a23[l],
                                (uint32_t)(a23[l] >> 32)};
        const uint32_t rb[2] = {(uint32_t)bb[l], (uint32_t)(bb[l] >> 32)};
        for (int i = 0; i < 8; i++) {
            const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
            const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
            A[row][col] = bf16_half(ra[i / 2], i & 1);
        }
        for (int i = 0; i < 4; i++) B[2 * t + (i & 1) + (i >= 2 ? 8 : 0)][g] = bf16_half(rb[i / 2], i & 1);
    }
    const int l = lane_of_caller(), g = l >> 2, t = l & 3;
    float out[4];
    for (int i = 0; i < 4; i++) {
        const int row = i < 2 ? g : g + 8, col = 2 * t + (i & 1);
        float acc = c[i];
        for (int k = 0; k < 16; k++) acc += A[row][k] * B[k][col]; /* exact products */
        out[i] = acc;
    }
    memcpy(d, out, sizeof out);
}

} /* namespace fy_emu */

void fy_mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    fy_emu::mma_16816_bf16(d, a, b, c);
}

#ifndef FY_CUDA_EMU_RT
cudaError_t cudaGetLastError(void) {
    cudaError_t e = fy_emu::g_last_error;
    fy_emu::g_last_error = cudaSuccess;
    return e;
}

const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess ? "no error" : e == cudaErrorInvalidConfiguration
                                               ? "invalid launch configuration (emulation)"
                                               : "launch failure (emulation)";
}
#endif

extern "C" void fy_emu_set_order(int order) { fy_emu::g_order = order; }

extern "C" void fy_emu_check_orders(const char *what, void (*run)(void *ctx), void *ctx,
                                    const fy_emu_buf *bufs, int nbufs) {
    static const char *const orders[3] = {"forward", "reverse", "shuffled"};
    void **before = (void **)calloc((size_t)nbufs + 1, sizeof(void *));
    void **first = (void **)calloc((size_t)nbufs + 1, sizeof(void *));
    if (!before || !first) abort();
    for (int k = 0; k < nbufs; k++) {
        before[k] = malloc(bufs[k].nbytes ? bufs[k].nbytes : 1);
        first[k] = malloc(bufs[k].nbytes ? bufs[k].nbytes : 1);
        if (!before[k] || !first[k]) abort();
        memcpy(before[k], bufs[k].p, bufs[k].nbytes);
    }
    for (int o = 0; o < 3; o++) {
        for (int k = 0; k < nbufs && o > 0; k++) memcpy(bufs[k].p, before[k], bufs[k].nbytes);
        fy_emu_set_order(o);
        run(ctx);
        for (int k = 0; k < nbufs; k++) {
            if (o == 0) {
                memcpy(first[k], bufs[k].p, bufs[k].nbytes);
            } else if (memcmp(first[k], bufs[k].p, bufs[k].nbytes)) {
                fprintf(stderr, "cuda emulation: %s: its output %s differs when its threads run in "
                        "%s order: a race\n", what, bufs[k].name, orders[o]);
                abort();
            }
        }
    }
    fy_emu_set_order(0);
    for (int k = 0; k < nbufs; k++) {
        free(before[k]);
        free(first[k]);
    }
    free(before);
    free(first);
}
