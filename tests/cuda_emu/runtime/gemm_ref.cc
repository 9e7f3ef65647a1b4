/* gemm_ref.cc — PLACEHOLDER for the device half of the emulated cuBLASLt (the reference
 * GEMM, in libfy_cudart_emu.so: see emu_rt.h); the cuBLASLt emulation replaces this file
 * wholesale. Nothing yet. */
