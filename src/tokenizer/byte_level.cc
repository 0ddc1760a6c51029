// GPT-2's byte-to-symbol mapping and the Unicode classes of its pre-tokenizer (see byte_level.h).
#include "tokenizer/byte_level.h"

#include <unicode/uchar.h>

#include <array>

namespace zt {

namespace {

struct ByteMap {
  std::array<std::string, 256> symbol;
  std::array<int16_t, 512> byte_of{};  // symbol code points are < 0x144
  ByteMap() {
    byte_of.fill(-1);
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = printable(b) ? static_cast<uint32_t>(b) : static_cast<uint32_t>(next++);
      std::string s;
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      symbol[static_cast<size_t>(b)] = s;
      byte_of[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

constexpr CharClass L = CharClass::kLetter, N = CharClass::kNumber, S = CharClass::kSpace, O = CharClass::kOther;

}  // namespace

namespace detail {

// ASCII: \t \n \v \f \r and ' ' are White_Space; 0x1C-0x1F are not (unlike Python's str.isspace).
const CharClass kAsciiClass[128] = {
    O, O, O, O, O, O, O, O, O, S, S, S, S, S, O, O,  // 0x00
    O, O, O, O, O, O, O, O, O, O, O, O, O, O, O, O,  // 0x10
    S, O, O, O, O, O, O, O, O, O, O, O, O, O, O, O,  // ' ' ...
    N, N, N, N, N, N, N, N, N, N, O, O, O, O, O, O,  // 0-9
    O, L, L, L, L, L, L, L, L, L, L, L, L, L, L, L,  // @ A-O
    L, L, L, L, L, L, L, L, L, L, L, O, O, O, O, O,  // P-Z
    O, L, L, L, L, L, L, L, L, L, L, L, L, L, L, L,  // ` a-o
    L, L, L, L, L, L, L, L, L, L, L, O, O, O, O, O,  // p-z, DEL
};

CharClass classify_non_ascii(uint32_t cp) {
  const auto c = static_cast<UChar32>(cp);
  if (u_isUWhiteSpace(c)) return CharClass::kSpace;
  const uint32_t mask = U_GET_GC_MASK(c);
  if (mask & U_GC_L_MASK) return CharClass::kLetter;
  if (mask & U_GC_N_MASK) return CharClass::kNumber;
  return CharClass::kOther;
}

}  // namespace detail

const std::string& byte_symbol(uint8_t b) { return byte_map().symbol[b]; }

int symbol_byte(uint32_t cp) { return cp < 512 ? byte_map().byte_of[cp] : -1; }

bool symbols_to_bytes(std::string_view s, std::string* bytes, uint32_t* bad_symbol) {
  bytes->clear();
  for (size_t i = 0; i < s.size();) {
    size_t len;
    const uint32_t cp = detail::decode_utf8(s, i, &len);
    const int b = cp == 0xFFFFFFFFu ? -1 : symbol_byte(cp);
    if (b < 0) {
      if (bad_symbol) *bad_symbol = cp == 0xFFFFFFFFu ? static_cast<uint8_t>(s[i]) : cp;
      return false;
    }
    bytes->push_back(static_cast<char>(b));
    i += len;
  }
  return true;
}

std::string bytes_to_symbols(std::string_view bytes) {
  std::string s;
  s.reserve(bytes.size() * 2);
  for (char c : bytes) s += byte_symbol(static_cast<uint8_t>(c));
  return s;
}

}  // namespace zt
