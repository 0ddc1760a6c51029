// GPT-2's byte level: the bytes <-> printable-unicode mapping its vocab.json and merges.txt are
// written in, and its pre-tokenizer (the regex below, hand-compiled; Unicode classes from ICU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace zt {

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100 onwards in byte order. Returns the UTF-8 of byte b's symbol.
const std::string& byte_symbol(uint8_t b);
// The byte a symbol (one code point) stands for, or -1 when the code point is no byte's symbol.
int symbol_byte(uint32_t code_point);
// A byte-level string (vocab.json / merges.txt entry) to the bytes it stands for; false when it is
// not UTF-8 or holds a code point that is no byte's symbol (*bad_symbol: that code point).
bool symbols_to_bytes(std::string_view symbols, std::string* bytes, uint32_t* bad_symbol = nullptr);
std::string bytes_to_symbols(std::string_view bytes);

// Splits UTF-8 text as GPT-2's pattern does, calling piece(offset, length) for each match in order:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// \p{L} and \p{N} are the Unicode general categories L* and N*, \s the White_Space property (as
// Oniguruma, which Hugging Face tokenizers uses, defines them). A byte that is not part of valid
// UTF-8 is one code point of its own in [^\s\p{L}\p{N}] (the regex engines refuse such text).
template <typename F>
void split_gpt2(std::string_view text, F&& piece);

// ---- implementation ---------------------------------------------------------------------------

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

namespace detail {
extern const CharClass kAsciiClass[128];
CharClass classify_non_ascii(uint32_t cp);
// Decodes the code point at text[i] (i < size); *len: its byte length (1 for an invalid byte).
inline uint32_t decode_utf8(std::string_view t, size_t i, size_t* len) {
  const auto b0 = static_cast<uint8_t>(t[i]);
  if (b0 < 0x80) {
    *len = 1;
    return b0;
  }
  auto cont = [&](size_t k) { return i + k < t.size() && (static_cast<uint8_t>(t[i + k]) & 0xC0) == 0x80; };
  auto c = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(t[i + k]) & 0x3F); };
  if (b0 >= 0xC2 && b0 < 0xE0 && cont(1)) {
    *len = 2;
    return ((b0 & 0x1Fu) << 6) | c(1);
  }
  if (b0 >= 0xE0 && b0 < 0xF0 && cont(1) && cont(2)) {
    const uint32_t cp = ((b0 & 0x0Fu) << 12) | (c(1) << 6) | c(2);
    if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) {
      *len = 3;
      return cp;
    }
  } else if (b0 >= 0xF0 && b0 < 0xF5 && cont(1) && cont(2) && cont(3)) {
    const uint32_t cp = ((b0 & 0x07u) << 18) | (c(1) << 12) | (c(2) << 6) | c(3);
    if (cp >= 0x10000 && cp <= 0x10FFFF) {
      *len = 4;
      return cp;
    }
  }
  *len = 1;
  return 0xFFFFFFFFu;  // invalid: classified as kOther
}
inline CharClass classify(uint32_t cp) {
  if (cp < 128) return kAsciiClass[cp];
  if (cp == 0xFFFFFFFFu) return CharClass::kOther;
  return classify_non_ascii(cp);
}
}  // namespace detail

template <typename F>
void split_gpt2(std::string_view t, F&& piece) {
  using detail::classify;
  using detail::decode_utf8;
  const size_t n = t.size();
  size_t i = 0;
  // End of the run of characters of class `cls` starting at j.
  auto run_end = [&](size_t j, CharClass cls) {
    while (j < n) {
      size_t len;
      if (classify(decode_utf8(t, j, &len)) != cls) break;
      j += len;
    }
    return j;
  };
  while (i < n) {
    if (t[i] == '\'' && i + 1 < n) {  // contractions, lowercase only (the pattern is case-sensitive)
      const char a = t[i + 1], b = i + 2 < n ? t[i + 2] : '\0';
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
      else if ((a == 'r' || a == 'v') && b == 'e') len = 3;
      else if (a == 'l' && b == 'l') len = 3;
      if (len) {
        piece(i, len);
        i += len;
        continue;
      }
    }
    size_t len0;
    const CharClass c0 = classify(decode_utf8(t, i, &len0));
    if (c0 != CharClass::kSpace || (t[i] == ' ' && i + 1 < n)) {
      // " ?X+" for X = letters, numbers, or neither-space-letter-nor-number: an ASCII space joins the
      // run that follows it.
      size_t start = i;
      CharClass cls = c0;
      if (c0 == CharClass::kSpace) {
        size_t len1;
        cls = classify(decode_utf8(t, i + 1, &len1));
        if (cls != CharClass::kSpace) start = i + 1;
      }
      if (cls != CharClass::kSpace) {
        const size_t end = run_end(start, cls);
        piece(i, end - i);
        i = end;
        continue;
      }
    }
    // Whitespace: \s+(?!\S) takes the run but leaves its last character when a non-space follows
    // (that character then starts the next piece, joining it when it is ' '); \s+ takes a single
    // whitespace character before a non-space.
    const size_t end = run_end(i, CharClass::kSpace);
    if (end == n) {
      piece(i, end - i);
      i = end;
      continue;
    }
    size_t last = i, k = i;  // last: start of the run's last character
    while (k < end) {
      size_t len;
      decode_utf8(t, k, &len);
      last = k;
      k += len;
    }
    const size_t stop = last > i ? last : end;
    piece(i, stop - i);
    i = stop;
  }
}

}  // namespace zt
