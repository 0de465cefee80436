// A step's keys and values into the engine's paged KV cache (IsoExec's CPU attention layout:
// row (block, head, slot) holds K[token] | V[token] verbatim).
//
// Why compiled: the torch write is two advanced-index assignments plus the slot arithmetic and
// a host check for padding, about 75 us a layer call inside an engine step, against 2 us for
// vLLM's own reshape-and-cache (#37's profile). This is a copy: it moves bytes, so it cannot
// change a bit. Tokens whose slot is negative (padding) are skipped.
#include <cstdint>
#include <cstring>

extern "C" int isx_kv_write(int64_t tokens, int64_t heads, int64_t dim, int64_t esize,
                            const char* key, int64_t k_tok, int64_t k_head, const char* value,
                            int64_t v_tok, int64_t v_head, const int64_t* slots, char* cache,
                            int64_t blocks, int64_t block_size, int64_t c_blk, int64_t c_head,
                            int64_t c_slot) {
  // strides in elements; K at element 0 of a cache row, V at element `dim`
  if (tokens < 0 || heads < 1 || dim < 1 || block_size < 1) return 2;
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= blocks * block_size) return 3;  // past the cache: nothing written
  const size_t row = size_t(dim * esize);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    const int64_t blk = s / block_size, off = s % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      char* dst = cache + (blk * c_blk + h * c_head + off * c_slot) * esize;
      std::memcpy(dst, key + (t * k_tok + h * k_head) * esize, row);
      std::memcpy(dst + row, value + (t * v_tok + h * v_head) * esize, row);
    }
  }
  return 0;
}
