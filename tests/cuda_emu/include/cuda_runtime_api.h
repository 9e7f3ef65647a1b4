/* cuda_runtime_api.h — the CUDA header, under the CPU emulation of the kernel tests: cuda_emu.h. */
#include "tests/cuda_emu/cuda_emu.h"
