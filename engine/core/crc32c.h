/* crc32c.h — CRC-32C (Castagnoli, the iSCSI/ext4 polynomial), the checksum checkpoints
 * record for each file they write. SSE4.2's crc32 instruction where the CPU has it, three
 * chains at once (8 bytes a cycle), eight tables otherwise; both give the same value. */
#ifndef FY_CRC32C_H
#define FY_CRC32C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The CRC of n bytes continued from crc (0 to start): crc32c(b, crc32c(a, 0)) is the
 * CRC of a then b. crc32c("123456789") == 0xE3069283. */
uint32_t fy_crc32c(const void *data, size_t n, uint32_t crc);
/* The same by the tables alone, on any CPU: the reference the tests hold the hardware
 * path to. */
uint32_t fy_crc32c_portable(const void *data, size_t n, uint32_t crc);

#ifdef __cplusplus
}
#endif
#endif
