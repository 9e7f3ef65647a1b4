/* bench_adam.h — `ferry bench adam`: the speed of the host AdamW step against the memory
 * bandwidth of a read-modify-write stream measured in the same run. */
#ifndef FY_BENCH_ADAM_H
#define FY_BENCH_ADAM_H

#ifdef __cplusplus
extern "C" {
#endif

/* argv[0] is "adam"; the rest are its flags (see --help). Prints a table and, last, one
 * JSON line. Returns 0 on success, 1 if the benchmark could not run (e.g. out of memory),
 * 2 on a bad flag (one error line printed). */
int fy_bench_adam_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif
