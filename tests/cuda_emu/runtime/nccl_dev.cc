/* nccl_dev.cc — PLACEHOLDER for the device half of the emulated NCCL (its collectives, in
 * libfy_cudart_emu.so: see emu_rt.h); the NCCL emulation replaces this file wholesale.
 * Nothing yet. */
