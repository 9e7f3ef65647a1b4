/* gpt2_io.h — GPT-2 weights in safetensors files with Hugging Face names and layout.
 *
 * Names are Hugging Face's (wte.weight, h.{i}.attn.c_attn.weight, ..., ln_f.bias), with
 * or without the "transformer." prefix; Conv1D weights are stored (in, out) and
 * transposed to ferry's (out, in) on load and back on save; the LM head is tied to
 * wte and never stored; legacy attention-mask buffers (h.{i}.attn.bias of rank 4,
 * h.{i}.attn.masked_bias) are ignored. F32, BF16 and F16 tensors are read; files are
 * written in F32 with __metadata__ {"format": "pt"} plus ferry's config keys
 * (ferry.vocab, ferry.max_seq, ferry.channels, ferry.layers, ferry.heads). */
#ifndef FY_GPT2_IO_H
#define FY_GPT2_IO_H

#include "engine/io/safetensors.h"
#include "engine/model/gpt2.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The model shape a file holds: vocab and channels from wte, positions from wpe, layers
 * from the h.{i} present. Heads: heads_flag if > 0, else the file's ferry.heads
 * metadata, else n_head of a config.json beside the file; otherwise FY_ERR_INVALID
 * asking for --heads. */
fy_status fy_gpt2_file_config(const fy_st_file *f, int heads_flag, fy_gpt2_config *out);

/* Fills host[b] (lay->blocks[b].nelem floats each) for every block from the file. Every
 * tensor must be present with the shape the layout expects (FY_ERR_FORMAT, naming it). */
fy_status fy_gpt2_load_blocks(const fy_st_file *f, const fy_gpt2_layout *lay,
                              float *const *host);

/* Writes all blocks (host[b]) to path atomically. */
fy_status fy_gpt2_save(const char *path, const fy_gpt2_layout *lay, float *const *host);

#ifdef __cplusplus
}
#endif
#endif
