/* kernels_emu.cc — engine/device/cuda/cuda_kernels.cu, the same source nvcc builds,
 * compiled by the host C++ compiler under the emulation (cuda_emu.h; see its top). */
#include "engine/device/cuda/cuda_kernels.cu"
