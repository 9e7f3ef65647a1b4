/* cuda_runtime_api.h — the CUDA header, under the CPU emulation of the kernel tests: cuda_emu.h.
 * In the emulated runtime's build (FY_CUDA_EMU_RT) the toolkit's own header first: the
 * types and the runtime's functions are CUDA's. */
#ifdef FY_CUDA_EMU_RT
#include_next <cuda_runtime_api.h>
#endif
#include "tests/cuda_emu/cuda_emu.h"
