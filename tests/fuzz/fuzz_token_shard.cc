// libFuzzer target: an llm.c token shard in memory -> validate_token_shard (the checks
// TokenShardData runs on every mapped file). Accepted shards have exactly 1024 + 2 * count bytes
// and every token below the vocabulary size.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "core/status.h"
#include "data/token_shards.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const int vocab : {zt::kGpt2VocabSize, 256}) {
    uint64_t count = 0;
    try {
      count = zt::validate_token_shard(std::span<const uint8_t>(data, size), vocab, "fuzz.bin");
    } catch (const zt::Error&) {
      continue;
    }
    if (zt::kShardHeaderBytes + 2 * count != size) __builtin_trap();
    for (uint64_t i = 0; i < count; ++i) {
      uint16_t t;
      std::memcpy(&t, data + zt::kShardHeaderBytes + 2 * i, 2);
      if (t >= vocab) __builtin_trap();
    }
  }
  return 0;
}
